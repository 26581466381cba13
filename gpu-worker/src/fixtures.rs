//! Tiny random-weight Gemma-3-shaped models, written as GGUF or as a safetensors checkpoint, so
//! tests run the real loading code and forward pass in milliseconds. The same spec and seed give
//! the same weights in both formats.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Shape of a tiny model. Widths are multiples of 32 (8-bit blocks) and the attention output and
/// FFN widths multiples of 256 (k-quant super-blocks), like the real model's.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub sliding_window: usize,
    pub sliding_window_pattern: usize,
    pub seed: u64,
    /// Use the real model's quantization mix (Q5_0, Q8_0, Q4_K, Q6_K) instead of F32.
    pub quantized: bool,
    /// A vocabulary whose letters have their case swapped (`a`'s id holds `A`): a tokenizer
    /// that reads every letter differently from the default one, for models with their own.
    pub swap_case: bool,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            layers: 6,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 256,
            vocab: 512,
            context: 1024,
            sliding_window: 16,
            sliding_window_pattern: 3,
            seed: 7,
            quantized: true,
            swap_case: false,
        }
    }
}

/// Special token ids, as in Gemma's vocabulary.
pub const PAD: u32 = 0;
pub const EOS: u32 = 1;
pub const BOS: u32 = 2;
pub const START_OF_TURN: u32 = 105;
pub const END_OF_TURN: u32 = 106;

/// Ordinary characters of the tiny tokenizer, one token each, in id order after the specials.
const TINY_CHARS: &str =
    "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()[]{}<>/@#$%^&*+=_~`|\\";

/// Writes a `tokenizer.json` for the tiny models: the same vocabulary size (512), Gemma's special
/// tokens at Gemma's ids (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<start_of_turn>` 105,
/// `<end_of_turn>` 106), one token per ASCII character with `▁` for a space, and byte-fallback
/// tokens (`<0x00>`…`<0xFF>`) for everything else, like Gemma's. Every id decodes, so whatever a
/// random-weight model generates can be shown.
pub fn write_tiny_tokenizer(path: &Path, vocab: usize) -> std::io::Result<()> {
    write_tiny_tokenizer_for(
        path,
        &TinySpec {
            vocab,
            ..TinySpec::default()
        },
    )
}

/// [`write_tiny_tokenizer`] for the vocabulary of `spec` (its size and [`TinySpec::swap_case`]).
pub fn write_tiny_tokenizer_for(path: &Path, spec: &TinySpec) -> std::io::Result<()> {
    use serde_json::{json, Map, Value};
    let mut model_vocab = Map::new();
    for (id, (name, _)) in tiny_vocab(spec.vocab, spec.swap_case)
        .into_iter()
        .enumerate()
    {
        model_vocab.insert(name, Value::from(id));
    }
    let added: Vec<Value> = TINY_SPECIALS
        .iter()
        .map(|(id, name)| {
            json!({"id": id, "content": name, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                  "vocab": model_vocab, "merges": []}
    });
    std::fs::write(path, tokenizer.to_string())
}

/// Gemma's special tokens at Gemma's ids.
const TINY_SPECIALS: [(u32, &str); 5] = [
    (PAD, "<pad>"),
    (EOS, "<eos>"),
    (BOS, "<bos>"),
    (START_OF_TURN, "<start_of_turn>"),
    (END_OF_TURN, "<end_of_turn>"),
];

/// llama.cpp's token types, as the tiny GGUF stores them.
const TYPE_NORMAL: i32 = 1;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;

/// The tiny vocabulary (see [`write_tiny_tokenizer`]): each token's piece and type, by id. The
/// GGUF and the tokenizer hold the same one, so the worker's vocabulary (constrained decoding)
/// and the orchestrator's tokenizer agree.
fn tiny_vocab(vocab: usize, swap_case: bool) -> Vec<(String, i32)> {
    let mut names: Vec<Option<(String, i32)>> = vec![None; vocab];
    for (id, name) in TINY_SPECIALS {
        if let Some(slot) = names.get_mut(id as usize) {
            *slot = Some((name.to_string(), TYPE_CONTROL));
        }
    }
    let swap = |c: char| match c {
        'a'..='z' if swap_case => c.to_ascii_uppercase(),
        'A'..='Z' if swap_case => c.to_ascii_lowercase(),
        _ => c,
    };
    let ordinary = TINY_CHARS
        .chars()
        .map(|c| (String::from(swap(c)), TYPE_NORMAL))
        .chain((0..=255u32).map(|b| (format!("<0x{b:02X}>"), TYPE_BYTE)))
        .chain((0..).map(|i| (format!("<unused{i}>"), TYPE_CONTROL)));
    let free: Vec<usize> = (0..vocab).filter(|&i| names[i].is_none()).collect();
    for (slot, name) in free.into_iter().zip(ordinary) {
        names[slot] = Some(name);
    }
    names.into_iter().flatten().collect()
}

/// The tiny vocabulary's text by id (`▁` as a space; byte and special tokens by their names).
pub fn tiny_vocab_text(vocab: usize) -> Vec<String> {
    tiny_vocab(vocab, false)
        .into_iter()
        .map(|(name, _)| name.replace('▁', " "))
        .collect()
}

/// A deterministic xorshift stream: the one source of pseudo-random fixtures and bench inputs.
pub fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

/// `n` deterministic values uniform in `[-scale, scale)`.
pub fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    xorshift(seed)
        .take(n)
        .map(|s| ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale)
        .collect()
}

fn name_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One tensor of the model in HF orientation: `(gguf name, hf name, rows, cols, kind)`.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Matrix(GgmlDType),
    Norm,
}

fn tensors(spec: &TinySpec) -> Vec<(String, String, usize, usize, Kind)> {
    let (h, q, kv, f) = (
        spec.hidden,
        spec.heads * spec.head_dim,
        spec.kv_heads * spec.head_dim,
        spec.ffn,
    );
    let qt = |t| if spec.quantized { t } else { GgmlDType::F32 };
    let mut v = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            spec.vocab,
            h,
            Kind::Matrix(qt(GgmlDType::Q8_0)),
        ),
        (
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            1,
            h,
            Kind::Norm,
        ),
    ];
    for i in 0..spec.layers {
        let g = |s: &str| format!("blk.{i}.{s}");
        let hf = |s: &str| format!("model.layers.{i}.{s}");
        v.extend([
            (
                g("attn_norm.weight"),
                hf("input_layernorm.weight"),
                1,
                h,
                Kind::Norm,
            ),
            (
                g("attn_q.weight"),
                hf("self_attn.q_proj.weight"),
                q,
                h,
                Kind::Matrix(qt(GgmlDType::Q5_0)),
            ),
            (
                g("attn_k.weight"),
                hf("self_attn.k_proj.weight"),
                kv,
                h,
                Kind::Matrix(qt(GgmlDType::Q5_0)),
            ),
            (
                g("attn_v.weight"),
                hf("self_attn.v_proj.weight"),
                kv,
                h,
                Kind::Matrix(qt(GgmlDType::Q8_0)),
            ),
            (
                g("attn_output.weight"),
                hf("self_attn.o_proj.weight"),
                h,
                q,
                Kind::Matrix(qt(GgmlDType::Q4K)),
            ),
            (
                g("attn_q_norm.weight"),
                hf("self_attn.q_norm.weight"),
                1,
                spec.head_dim,
                Kind::Norm,
            ),
            (
                g("attn_k_norm.weight"),
                hf("self_attn.k_norm.weight"),
                1,
                spec.head_dim,
                Kind::Norm,
            ),
            (
                g("post_attention_norm.weight"),
                hf("post_attention_layernorm.weight"),
                1,
                h,
                Kind::Norm,
            ),
            (
                g("ffn_norm.weight"),
                hf("pre_feedforward_layernorm.weight"),
                1,
                h,
                Kind::Norm,
            ),
            (
                g("ffn_gate.weight"),
                hf("mlp.gate_proj.weight"),
                f,
                h,
                Kind::Matrix(qt(GgmlDType::Q5_0)),
            ),
            (
                g("ffn_up.weight"),
                hf("mlp.up_proj.weight"),
                f,
                h,
                Kind::Matrix(qt(GgmlDType::Q5_0)),
            ),
            (
                g("ffn_down.weight"),
                hf("mlp.down_proj.weight"),
                h,
                f,
                Kind::Matrix(qt(GgmlDType::Q6K)),
            ),
            (
                g("post_ffw_norm.weight"),
                hf("post_feedforward_layernorm.weight"),
                1,
                h,
                Kind::Norm,
            ),
        ]);
    }
    v
}

/// HF-convention values of one tensor (norms as `w` in `x * (1 + w)`).
fn values(spec: &TinySpec, name: &str, rows: usize, cols: usize, kind: Kind) -> Vec<f32> {
    let seed = name_seed(spec.seed, name);
    match kind {
        Kind::Norm => noise(cols, seed, 0.2),
        // Small embeddings keep the tied output logits spread out (a random model with large ones
        // predicts one token everywhere); other matrices scaled by fan-in so activations stay O(1).
        Kind::Matrix(_) if name == "token_embd.weight" => noise(rows * cols, seed, 0.15),
        Kind::Matrix(_) => noise(rows * cols, seed, (3.0 / cols as f32).sqrt()),
    }
}

/// Writes the model as a GGUF file with `gemma3` metadata and a token list.
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let mut qtensors = Vec::new();
    for (gname, _, rows, cols, kind) in tensors(spec) {
        let vals = values(spec, &gname, rows, cols, kind);
        let qt = match kind {
            Kind::Norm => QTensor::quantize(
                &Tensor::from_vec(vals.iter().map(|w| 1.0 + w).collect::<Vec<_>>(), cols, &dev)?,
                GgmlDType::F32,
            )?,
            Kind::Matrix(dt) => {
                QTensor::quantize(&Tensor::from_vec(vals, (rows, cols), &dev)?, dt)?
            }
        };
        qtensors.push((gname, qt));
    }
    let (tokens, types): (Vec<Value>, Vec<Value>) = tiny_vocab(spec.vocab, spec.swap_case)
        .into_iter()
        .map(|(name, ty)| (Value::String(name), Value::I32(ty)))
        .unzip();
    let u = |v: usize| Value::U32(v as u32);
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("general.name", Value::String("tiny-gemma3-test".into())),
        ("gemma3.context_length", u(spec.context)),
        ("gemma3.embedding_length", u(spec.hidden)),
        ("gemma3.block_count", u(spec.layers)),
        ("gemma3.feed_forward_length", u(spec.ffn)),
        ("gemma3.attention.head_count", u(spec.heads)),
        ("gemma3.attention.head_count_kv", u(spec.kv_heads)),
        ("gemma3.attention.key_length", u(spec.head_dim)),
        ("gemma3.attention.value_length", u(spec.head_dim)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("gemma3.rope.freq_base", Value::F32(1_000_000.0)),
        ("gemma3.attention.sliding_window", u(spec.sliding_window)),
        (
            "gemma3.attention.sliding_window_pattern",
            u(spec.sliding_window_pattern),
        ),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.bos_token_id", Value::U32(BOS)),
        ("tokenizer.ggml.eos_token_id", Value::U32(EOS)),
        ("tokenizer.ggml.padding_token_id", Value::U32(PAD)),
    ];
    let mut f = std::fs::File::create(path)?;
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs)
}

/// Writes the model as a HuggingFace checkpoint directory (`config.json`, `model.safetensors`).
pub fn write_tiny_safetensors(dir: &Path, spec: &TinySpec) -> candle_core::Result<()> {
    std::fs::create_dir_all(dir)?;
    let dev = Device::Cpu;
    let mut map = HashMap::new();
    for (gname, hfname, rows, cols, kind) in tensors(spec) {
        let vals = values(spec, &gname, rows, cols, kind);
        let t = match kind {
            Kind::Norm => Tensor::from_vec(vals, cols, &dev)?,
            Kind::Matrix(_) => Tensor::from_vec(vals, (rows, cols), &dev)?,
        };
        map.insert(hfname, t);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let config = serde_json::json!({
        "model_type": "gemma3_text",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.context,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": spec.sliding_window,
        "sliding_window_pattern": spec.sliding_window_pattern,
        "query_pre_attn_scalar": spec.head_dim,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config).map_err(candle_core::Error::wrap)?,
    )?;
    Ok(())
}

/// A `hearth-worker serve` child process on loopback ports the OS chose (or its gRPC service on
/// an address the test chose), for tests and benchmarks that need the real binary. Killed when
/// dropped.
#[derive(Debug)]
pub struct WorkerProcess {
    pub child: std::process::Child,
    /// `host:port` of the gRPC service.
    pub grpc: String,
    /// `host:port` of `/metrics`, `/healthz` and `/readyz`.
    pub metrics: String,
    /// Held open so the worker never writes into a closed pipe.
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl WorkerProcess {
    /// Starts `bin serve --model model` plus `extra` flags and reads the address line it prints.
    pub fn spawn(bin: &Path, model: &Path, extra: &[&str]) -> std::io::Result<Self> {
        Self::spawn_at(bin, model, "127.0.0.1:0", extra)
    }

    /// [`Self::spawn`] with the gRPC service on `listen` (e.g. another loopback address, so that
    /// several workers share a port as they would on several hosts).
    pub fn spawn_at(
        bin: &Path,
        model: &Path,
        listen: &str,
        extra: &[&str],
    ) -> std::io::Result<Self> {
        Self::spawn_with(bin, model, listen, extra, std::process::Stdio::inherit())
    }

    /// [`Self::spawn_at`], its log (stderr) written to `log`.
    pub fn spawn_logged(
        bin: &Path,
        model: &Path,
        listen: &str,
        extra: &[&str],
        log: std::fs::File,
    ) -> std::io::Result<Self> {
        Self::spawn_with(bin, model, listen, extra, log.into())
    }

    fn spawn_with(
        bin: &Path,
        model: &Path,
        listen: &str,
        extra: &[&str],
        stderr: std::process::Stdio,
    ) -> std::io::Result<Self> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new(bin)
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--listen", listen, "--metrics-listen", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()?;
        let mut stdout = std::io::BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| std::io::Error::other("no stdout pipe"))?,
        );
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            std::io::Error::other(format!(
                "worker printed `{line}` instead of its addresses: {e}"
            ))
        })?;
        let addr = |k: &str| {
            v["listening"][k]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| std::io::Error::other(format!("no {k} address in `{line}`")))
        };
        Ok(Self {
            grpc: addr("grpc")?,
            metrics: addr("metrics")?,
            child,
            _stdout: stdout,
        })
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
