//! What a step costs and moves on the device: the operations a decode step issues whatever the
//! batch, rows that stay on the device when only their summary is read, and `check-greedy`
//! comparing a device's reply with a CPU pass.

use candle_core::Device;
use hearth_worker::fixtures::TinySpec;
use hearth_worker::gen_model::{self, Like};
use hearth_worker::generic::{DeviceKv, GenericModel, LoadOptions};
use hearth_worker::kv::KvDtype;
use hearth_worker::model::SeqChunk;

use crate::both;
use crate::common::{prompt, temp_dir, VOCAB};

/// A decode step of a Gemma 3 270M-shaped model (gen-model's random weights, the published
/// Q4_K_M file's formats) on candle's CPU device: the device operations it issues (counted by
/// what each costs on CUDA, see `DeviceOps`) per layer and per token, the same at batch 1, 4 and
/// 16: attention is one launch for the whole step.
#[test]
fn a_decode_step_issues_few_device_operations_whatever_the_batch() {
    let path = temp_dir("device-ops").join("270m.gguf");
    gen_model::write(Like::Gemma3_270m, &path, 1).unwrap();
    let model = GenericModel::load_gguf(&path, &Device::Cpu, LoadOptions::default()).unwrap();
    let c = model.config.clone();
    // Q/K/V are one product in every layer (Q5_0 beside Q8_0 becomes Q8_0), as are gate/up.
    assert!((0..c.num_layers).all(|l| model.products_per_layer(l) == 4));
    let mut kv =
        DeviceKv::new(&Device::Cpu, c.num_layers, 48, 16, c.kv_dim(), KvDtype::F16).unwrap();
    let mut steps = Vec::new();
    for batch in [1u32, 4, 16] {
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|i| vec![3 * i, 3 * i + 1, 3 * i + 2])
            .collect();
        let tokens: Vec<[u32; 1]> = (0..batch).map(|i| [1000 + i]).collect();
        let chunks: Vec<SeqChunk<'_>> = (0..batch as usize)
            .map(|i| SeqChunk {
                tokens: &tokens[i],
                start_pos: 20 + i,
                blocks: &tables[i],
                packed: &[],
                logit_rows: 1,
                // Greedy decoding: the rows stay on the device, their summaries come back.
                summary_only: true,
            })
            .collect();
        let before = model.device_ops().count();
        let (mut logits, mut summaries) = (Vec::new(), Vec::new());
        model
            .forward(&chunks, &mut kv, &mut logits, &mut summaries)
            .unwrap();
        assert_eq!(summaries.len(), batch as usize);
        assert!(logits.is_empty() || logits.len() == batch as usize * c.vocab_size);
        steps.push(model.device_ops().count().since(before));
    }
    assert_eq!(steps[0], steps[1], "batch 1 and 4");
    assert_eq!(steps[0], steps[2], "batch 1 and 16");
    let per_token = steps[0].total();
    // Outside the layers: the meta upload, the embedding lookup and its norm, the output
    // product (2), the summaries and their download.
    let per_layer = (per_token - 7) as f64 / c.num_layers as f64;
    eprintln!(
        "decode step: {} kernel launches and {} copies, {per_layer:.1} per layer, {per_token} per \
         token at batch 1 (the same at 4 and 16)",
        steps[0].kernels, steps[0].copies
    );
    assert!(per_layer <= 22.0, "{per_layer} device operations per layer");
    assert!(per_token <= 400, "{per_token} device operations per token");
}

/// Rows whose sampler reads only their summary stay on the device: a step mixing them with rows
/// that come to the host writes just those, at their places, with the same values and summaries
/// as a step that brings every row.
#[test]
fn summary_only_rows_stay_on_the_device_and_the_others_arrive_in_place() {
    let (_, generic) = both(&TinySpec::default());
    let c = generic.config.clone();
    let tables: [Vec<u32>; 3] = [vec![0, 1], vec![2, 3], vec![4, 5]];
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(12, 60 + i, VOCAB)).collect();
    let run = |summary_only: [bool; 3], logits: &mut Vec<f32>| {
        let mut kv =
            DeviceKv::new(&Device::Cpu, c.num_layers, 6, 16, c.kv_dim(), KvDtype::F32).unwrap();
        let chunks: Vec<SeqChunk<'_>> = (0..3)
            .map(|i| SeqChunk {
                tokens: &prompts[i],
                start_pos: 0,
                blocks: &tables[i],
                packed: &[],
                logit_rows: 2,
                summary_only: summary_only[i],
            })
            .collect();
        let mut summaries = Vec::new();
        generic
            .forward(&chunks, &mut kv, logits, &mut summaries)
            .unwrap();
        summaries
    };
    let mut all = Vec::new();
    let want = run([false; 3], &mut all);
    let vocab = c.vocab_size;
    assert_eq!(all.len(), 6 * vocab);
    // A buffer from an earlier step, marked, so rows left alone show.
    let mut mixed = vec![f32::NAN; 6 * vocab];
    let got = run([false, true, false], &mut mixed);
    assert_eq!(got, want, "summaries");
    assert_eq!(mixed.len(), 6 * vocab);
    for r in [0, 1, 4, 5] {
        assert_eq!(
            mixed[r * vocab..][..vocab],
            all[r * vocab..][..vocab],
            "row {r}"
        );
    }
    assert!(mixed[2 * vocab..4 * vocab].iter().all(|x| x.is_nan()));
    // Only summaries: no row comes to the host.
    let before = generic.device_ops().count();
    let mut none = vec![f32::NAN; 6 * vocab];
    assert_eq!(run([true; 3], &mut none), want);
    assert!(none.iter().all(|x| x.is_nan()));
    let ops = generic.device_ops().count().since(before);
    assert_eq!(ops.copies, 2, "the meta upload and the summaries' download");
}

/// `check-greedy` on the CPU: the candle pass's greedy reply against itself (exact) and against
/// the CPU kernels (within their tolerance); held to a tolerance of zero against the kernels, the
/// check sees the positions where the two round differently and fails.
#[test]
fn check_greedy_compares_a_devices_reply_with_a_cpu_pass() {
    use hearth_worker::check::{check_greedy, CheckOptions, Reference};
    use hearth_worker::device::DeviceSpec;
    use hearth_worker::server::config::{ForwardPass, RunOn};
    let path = temp_dir("check-greedy").join("tiny.gguf");
    gen_model::write(Like::Tiny, &path, 2).unwrap();
    let options = |reference, tolerance, spread_tolerance| CheckOptions {
        model: None,
        run_on: RunOn {
            device: DeviceSpec::Cpu,
            forward: ForwardPass::Candle,
            dense_gemm_tokens: None,
            cuda_graphs: true,
            kernels: Default::default(),
        },
        prompt_tokens: 24,
        tokens: 32,
        reference,
        tolerance,
        spread_tolerance,
    };
    let same = check_greedy(&path, &options(Reference::Candle, 1.0, 0.25)).unwrap();
    assert_eq!(same["pass"], true, "{same}");
    assert_eq!(same["same_argmax"], 32, "{same}");
    assert_eq!(same["worst_gap_logits"], 0.0, "{same}");
    assert_eq!(same["device_logits"]["worst_rms_over_std"], 0.0, "{same}");
    let distinct: std::collections::HashSet<_> = same["reply"].as_array().unwrap().iter().collect();
    assert!(distinct.len() >= 8, "a degenerate reply: {same}");
    let kernels = check_greedy(&path, &options(Reference::Kernels, 1.0, 0.25)).unwrap();
    assert_eq!(kernels["pass"], true, "{kernels}");
    let gap = kernels["worst_gap_logits"].as_f64().unwrap();
    assert!(gap > 0.0, "{kernels}");
    let spread = kernels["device_logits"]["worst_rms_over_std"]
        .as_f64()
        .unwrap();
    assert!(spread > 0.0 && spread < 0.25, "{kernels}");
    let strict = check_greedy(&path, &options(Reference::Kernels, 0.0, 0.25)).unwrap();
    assert_eq!(strict["pass"], false, "{strict}");
    let strict = check_greedy(&path, &options(Reference::Kernels, 1.0, spread / 2.0)).unwrap();
    assert_eq!(strict["pass"], false, "{strict}");
}
