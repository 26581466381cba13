//! `hearth-worker gen-model`: random-weight GGUF files with the tensor shapes, quantization mix
//! and metadata of real Gemma 3 models, and a vocabulary llama.cpp loads, so both engines can
//! run the same file. Weight values do not change speed, so these files measure the model sizes
//! that GPUs serve where the real weights (gigabytes, behind a model hub) cannot be brought.
//!
//! The quantization mix is llama.cpp's Q4_K_M: Q4_K for most matrices; Q6_K for `attn_v` and
//! `ffn_down` in the layers llama.cpp gives more bits (the first and last eighth, and every
//! third between); Q6_K for the tied embedding; and where a matrix's rows are not whole 256-value
//! super-blocks (Gemma 3 270M's and 1B's hidden sizes), Q5_0 for Q4_K and Q8_0 for Q6_K, as
//! llama.cpp falls back. For `gemma-3-270m` this gives the types of the published Q4_K_M file,
//! tensor for tensor.
//!
//! The data are random block bytes with each block's f16 scales set so a matrix's values have
//! about the spread `1/sqrt(fan-in)`, and norm weights near 1 (see [`norm_gain`]): finite, with
//! the activations of a working model and greedy replies that do not repeat one token, at the
//! cost of a random fill.

pub mod gguf;
pub mod vocab;

use std::io;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

pub use gguf::TensorSpec;

/// Which model a generated file is shaped like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Like {
    /// A small Gemma 3 (6 layers of 256, a 4,096-token vocabulary): seconds on a CPU, for
    /// checking the scripts that use the others.
    Tiny,
    #[value(name = "gemma-3-270m")]
    Gemma3_270m,
    #[value(name = "gemma-3-1b")]
    Gemma3_1b,
    #[value(name = "gemma-3-4b")]
    Gemma3_4b,
}

/// The architecture of a Gemma 3 text model, as its `config.json` gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub context: usize,
    pub sliding_window: usize,
    /// Linear RoPE scaling of the global layers (Gemma 3 4B: 8).
    pub rope_scale: Option<f32>,
}

impl Like {
    pub fn shape(self) -> Shape {
        let gemma3 = |name, vocab, hidden, layers, heads, kv_heads, ffn| Shape {
            name,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim: 256,
            ffn,
            context: 32768,
            sliding_window: 512,
            rope_scale: None,
        };
        match self {
            Self::Tiny => Shape {
                head_dim: 64,
                context: 4096,
                sliding_window: 64,
                ..gemma3("tiny", 4096, 256, 6, 4, 1, 512)
            },
            Self::Gemma3_270m => gemma3("gemma-3-270m", 262_144, 640, 18, 4, 1, 2048),
            Self::Gemma3_1b => gemma3("gemma-3-1b", 262_144, 1152, 26, 4, 1, 6912),
            Self::Gemma3_4b => Shape {
                context: 131_072,
                sliding_window: 1024,
                rope_scale: Some(8.0),
                ..gemma3("gemma-3-4b", 262_208, 2560, 34, 8, 4, 10240)
            },
        }
    }
}

/// llama.cpp's "more bits" layers of Q4_K_M (its `use_more_bits`).
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// `want`, or llama.cpp's fallback when rows of `cols` values are not whole super-blocks.
fn quant(want: GgmlDType, cols: usize) -> GgmlDType {
    match want {
        GgmlDType::Q4K if !cols.is_multiple_of(256) => GgmlDType::Q5_0,
        GgmlDType::Q6K if !cols.is_multiple_of(256) => GgmlDType::Q8_0,
        t => t,
    }
}

impl Shape {
    /// The file's tensors, in the order llama.cpp's converter writes them.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let (h, q, kv, f) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.ffn,
        );
        let t = |name: String, dims: Vec<usize>, dtype| TensorSpec { name, dims, dtype };
        let m = |name: String, rows, cols, want| t(name, vec![rows, cols], quant(want, cols));
        let norm = |name: String, n| t(name, vec![n], GgmlDType::F32);
        let mut v = vec![
            norm("output_norm.weight".into(), h),
            m("token_embd.weight".into(), self.vocab, h, GgmlDType::Q6K),
        ];
        for i in 0..self.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let more = if more_bits(i, self.layers) {
                GgmlDType::Q6K
            } else {
                GgmlDType::Q4K
            };
            v.extend([
                m(n("attn_k"), kv, h, GgmlDType::Q4K),
                norm(n("attn_k_norm"), self.head_dim),
                norm(n("attn_norm"), h),
                m(n("attn_output"), h, q, GgmlDType::Q4K),
                m(n("attn_q"), q, h, GgmlDType::Q4K),
                norm(n("attn_q_norm"), self.head_dim),
                m(n("attn_v"), kv, h, more),
                m(n("ffn_down"), h, f, more),
                m(n("ffn_gate"), f, h, GgmlDType::Q4K),
                norm(n("ffn_norm"), h),
                m(n("ffn_up"), f, h, GgmlDType::Q4K),
                norm(n("post_attention_norm"), h),
                norm(n("post_ffw_norm"), h),
            ]);
        }
        v
    }

    /// Parameters in the file.
    pub fn parameters(&self) -> usize {
        self.tensors().iter().map(TensorSpec::elements).sum()
    }

    /// The file's metadata: llama.cpp's `gemma3` keys and the vocabulary.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let u = |v: usize| Value::U32(v as u32);
        let g = |k: &str, v: Value| (format!("gemma3.{k}"), v);
        let mut md = vec![
            (
                "general.architecture".to_string(),
                Value::String("gemma3".into()),
            ),
            (
                "general.name".to_string(),
                Value::String(format!("random-weight {}", self.name)),
            ),
            // Q4_K_M, as llama.cpp numbers its file types.
            ("general.file_type".to_string(), Value::U32(15)),
            ("general.quantization_version".to_string(), Value::U32(2)),
            g("context_length", u(self.context)),
            g("embedding_length", u(self.hidden)),
            g("block_count", u(self.layers)),
            g("feed_forward_length", u(self.ffn)),
            g("attention.head_count", u(self.heads)),
            g("attention.head_count_kv", u(self.kv_heads)),
            g("attention.key_length", u(self.head_dim)),
            g("attention.value_length", u(self.head_dim)),
            g("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
            g("rope.freq_base", Value::F32(1_000_000.0)),
            g("attention.sliding_window", u(self.sliding_window)),
        ];
        if let Some(factor) = self.rope_scale {
            md.push(g("rope.scaling.type", Value::String("linear".into())));
            md.push(g("rope.scaling.factor", Value::F32(factor)));
        }
        md.extend(vocab::metadata(self.vocab));
        md
    }
}

/// The mean weight of a norm. With random weights attention spreads evenly over a sequence, so
/// its output is nearly the same at every position: at full weight it would push every position
/// toward one token. Scaled down, the feed-forward blocks (a random function of each token)
/// decide the next token, and greedy replies vary. The final norm's gain spreads the logits
/// about as wide as a trained model's (a standard deviation of about 2).
fn norm_gain(name: &str) -> f32 {
    if name.ends_with("post_attention_norm.weight") {
        0.2
    } else if name == "output_norm.weight" {
        8.0
    } else {
        1.0
    }
}

/// Fills `buf` with tensor `t`'s random data: blocks of random quants whose scales give values of
/// about `spread`, or f32 norm weights `1 ± 0.2`.
fn fill(t: &TensorSpec, seed: u64, buf: &mut [u8]) {
    let seed = t.name.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    if t.dtype == GgmlDType::F32 {
        let gain = norm_gain(&t.name);
        let ws = crate::fixtures::noise(buf.len() / 4, seed, 0.2);
        for (c, w) in buf.chunks_exact_mut(4).zip(ws) {
            c.copy_from_slice(&(gain * (1.0 + w)).to_le_bytes());
        }
        return;
    }
    let cols = t.dims.last().copied().unwrap_or(1);
    // An embedding is scaled by sqrt(hidden) on the way in and read as it is by the tied output
    // projection, where a token's logit for itself grows with hidden × spread²: kept small, so
    // a token does not simply predict itself.
    let spread = if t.name == "token_embd.weight" {
        0.25 / (cols as f32).sqrt()
    } else {
        1.0 / (cols as f32).sqrt()
    };
    let size = t.dtype.type_size();
    // Blocks are filled in parallel, each chunk from its own stream.
    const CHUNK: usize = 4096;
    buf.par_chunks_mut(size * CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = crate::fixtures::xorshift(seed.wrapping_add(c as u64));
            for word in chunk.chunks_mut(8) {
                let r = rng.next().unwrap_or(0).to_le_bytes();
                word.copy_from_slice(&r[..word.len()]);
            }
            for block in chunk.chunks_exact_mut(size) {
                set_scales(t.dtype, block, spread);
            }
        });
}

/// An f16 scale, at least f16's smallest (subnormal) value: the small scales of wide k-quant
/// matrices are subnormal in f16, which every reader converts exactly.
fn scale(x: f32) -> [u8; 2] {
    f16::from_f32(x.max(f16::from_bits(1).to_f32()))
        .to_bits()
        .to_le_bytes()
}

/// Sets a block's f16 scales for values of about `spread` (the rest of the block stays random:
/// any quants, sub-block scales and minimums are valid).
fn set_scales(dtype: GgmlDType, block: &mut [u8], spread: f32) {
    match dtype {
        // d · q, q in -128..=127 (spread of q about 74).
        GgmlDType::Q8_0 => block[..2].copy_from_slice(&scale(spread / 74.0)),
        // d · (q - 16), q in 0..32 (spread about 9.2).
        GgmlDType::Q5_0 => block[..2].copy_from_slice(&scale(spread / 9.2)),
        // d · sc · q - dmin · m with sc, m in 0..64 and q in 0..16: dmin = 7.5 d centres it.
        GgmlDType::Q4K => {
            let d = spread / 180.0;
            block[..2].copy_from_slice(&scale(d));
            block[2..4].copy_from_slice(&scale(7.5 * d));
        }
        // d · sc · (q - 32), sc in -128..=127, q in 0..64 (spread about 1370); d is last.
        GgmlDType::Q6K => {
            let n = block.len();
            block[n - 2..].copy_from_slice(&scale(spread / 1370.0));
        }
        _ => {}
    }
}

/// The `hearth-worker gen-model` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GenModelOptions {
    /// The model whose shapes, quantization mix and metadata the file takes.
    #[arg(long, value_enum)]
    pub like: Like,
    /// Where to write the GGUF file.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Writes a random-weight GGUF file shaped like `like` to `path`; returns the bytes written.
pub fn write(like: Like, path: &Path, seed: u64) -> io::Result<u64> {
    let shape = like.shape();
    let file = std::fs::File::create(path)?;
    gguf::write(
        io::BufWriter::with_capacity(1 << 22, file),
        &shape.metadata(),
        &shape.tensors(),
        |t, buf| {
            fill(t, seed, buf);
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Content;
    use candle_core::Device;

    /// The text models' parameter counts, from their published `config.json`s (Gemma 3 4B's
    /// language model, without its vision tower); 270M's is also the sum over the published
    /// Q4_K_M GGUF's tensors.
    const PUBLISHED: [(Like, usize); 3] = [
        (Like::Gemma3_270m, 268_098_176),
        (Like::Gemma3_1b, 999_885_952),
        (Like::Gemma3_4b, 3_880_263_168),
    ];

    #[test]
    fn each_shapes_metadata_loads_with_the_real_models_parameter_count() {
        for (like, params) in PUBLISHED {
            let shape = like.shape();
            assert_eq!(shape.parameters(), params, "{}", shape.name);
            // The header alone (no tensor data): what the loaders read first.
            let mut header = Vec::new();
            gguf::write(&mut header, &shape.metadata(), &[], |_, _| Ok(())).unwrap();
            let content = Content::read(&mut std::io::Cursor::new(&header)).unwrap();
            let c = crate::model::GemmaConfig::from_gguf(&content).unwrap();
            assert_eq!(
                (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads),
                (shape.vocab, shape.hidden, shape.layers, shape.heads)
            );
            assert_eq!((c.num_kv_heads, c.head_dim), (shape.kv_heads, 256));
            assert_eq!(c.sliding_window, Some(shape.sliding_window));
            assert_eq!(c.rope_scale_global, shape.rope_scale.unwrap_or(1.0));
            let (bos, eos, eot) = crate::model::special_tokens(&content.metadata);
            assert_eq!((bos, eos, eot), (Some(2), Some(1), Some(106)));
        }
    }

    #[test]
    fn the_quantization_mix_is_llama_cpps_q4_k_m() {
        assert_eq!(
            (0..18).filter(|&i| more_bits(i, 18)).collect::<Vec<_>>(),
            [0, 1, 4, 7, 10, 13, 15, 16, 17],
            "the layers of the published 270M file with Q6_K ffn_down"
        );
        let ty = |like: Like, name: &str| {
            like.shape()
                .tensors()
                .into_iter()
                .find(|t| t.name == name)
                .unwrap()
                .dtype
        };
        use GgmlDType::*;
        // 270M and 1B rows are not whole super-blocks: Q5_0 and Q8_0 stand in.
        for like in [Like::Gemma3_270m, Like::Gemma3_1b] {
            assert_eq!(ty(like, "token_embd.weight"), Q8_0);
            assert_eq!(ty(like, "blk.0.attn_q.weight"), Q5_0);
            assert_eq!(ty(like, "blk.0.attn_v.weight"), Q8_0);
            assert_eq!(ty(like, "blk.3.attn_v.weight"), Q5_0);
            assert_eq!(ty(like, "blk.0.ffn_down.weight"), Q6K);
            assert_eq!(ty(like, "blk.3.ffn_down.weight"), Q4K);
            assert_eq!(ty(like, "blk.0.attn_output.weight"), Q4K);
        }
        assert_eq!(ty(Like::Gemma3_4b, "token_embd.weight"), Q6K);
        assert_eq!(ty(Like::Gemma3_4b, "blk.3.attn_q.weight"), Q4K);
    }

    #[test]
    fn the_published_270m_file_has_the_same_tensors_and_types() {
        let real =
            crate::server::config::default_models_dir().join(crate::server::config::DEFAULT_MODEL);
        let Ok(mut f) = std::fs::File::open(&real) else {
            // `make test` fetches the model first; a bare `cargo test` may not have it.
            eprintln!("skipped: {} is missing (make fetch-model)", real.display());
            return;
        };
        let content = Content::read(&mut f).unwrap();
        let mine = Like::Gemma3_270m.shape().tensors();
        assert_eq!(mine.len(), content.tensor_infos.len());
        for t in mine {
            let info = &content.tensor_infos[&t.name];
            assert_eq!(info.shape.dims(), t.dims.as_slice(), "{}", t.name);
            assert_eq!(info.ggml_dtype, t.dtype, "{}", t.name);
        }
    }

    #[test]
    fn a_tiny_file_loads_and_its_weights_are_finite_and_spread() {
        let dir = std::env::temp_dir().join(format!("hearth-gen-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        let bytes = write(Like::Tiny, &path, 3).unwrap();
        assert_eq!(bytes, std::fs::metadata(&path).unwrap().len());
        let model = crate::model::load_gguf(&path).unwrap();
        assert_eq!(model.config.num_layers, 6);
        let mut f = std::fs::File::open(&path).unwrap();
        let content = Content::read(&mut f).unwrap();
        for name in [
            "blk.0.attn_q.weight",
            "blk.0.attn_v.weight",
            "blk.2.ffn_down.weight",
            "blk.0.ffn_down.weight",
            "token_embd.weight",
        ] {
            let t = content.tensor(&mut f, name, &Device::Cpu).unwrap();
            let v: Vec<f32> = t
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
            assert!(v.iter().all(|x| x.is_finite()), "{name}");
            // Within a factor of 3 of the spread asked for (the quants' distributions differ).
            let cols = *t.shape().dims().last().unwrap() as f32;
            let want = if name == "token_embd.weight" {
                0.25
            } else {
                1.0
            } / cols.sqrt();
            assert!(
                rms > want / 3.0 && rms < want * 3.0,
                "{name}: rms {rms}, want {want}"
            );
        }
        // Another seed, other weights; the same seed, the same file.
        let again = dir.join("again.gguf");
        write(Like::Tiny, &again, 3).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&again).unwrap()
        );
        write(Like::Tiny, &again, 4).unwrap();
        assert_ne!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&again).unwrap()
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
