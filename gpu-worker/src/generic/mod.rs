//! The device-generic Gemma forward pass: the same architecture as [`crate::model`], written on
//! candle tensors so one piece of code runs on `Device::Cuda(n)` and on candle's CPU device.
//!
//! Weights come from the GGUF file onto the device as they are stored: block-quantized matrices
//! stay quantized ([`QMatMul`]: candle's quantized kernels, which on CUDA multiply up to 8 rows
//! with matrix-vector kernels and more with tiled int8 kernels, both reading the blocks as
//! stored), norm vectors become f32 tensors, and the token embedding is one quantized table
//! shared with the tied output projection (rows are dequantized as they are looked up, never the
//! whole table). With [`LoadOptions::dense_gemm_tokens`], the layers' matrices also get a
//! dequantized f16 copy, and steps of at least that many tokens multiply through it (cuBLAS on
//! CUDA): an alternative for prefill and large batches, to be chosen by measuring.
//!
//! A step takes the same [`SeqChunk`]s as the CPU engine: every sequence's new tokens at their own
//! positions, with their own block tables. Linear layers see all tokens of the step as one
//! `[tokens, hidden]` matrix; each layer scatters the step's keys and values into their slots of
//! the paged [`DeviceKv`] in one operation, and attention gathers each sequence's visible
//! positions by slot (the sliding window on local layers) and runs as two batched matrix
//! products over the heads sharing each KV head, with a causal (and window) mask.
//!
//! The CPU engine keeps its own kernels ([`crate::model`]): they are several times faster on the
//! CPU. This path exists for accelerators, and is tested on candle's CPU device against them.

mod kv;

pub use kv::DeviceKv;

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};

use crate::model::{special_tokens, GemmaConfig, ModelError, SeqChunk};

/// How [`GenericModel::load_gguf`] lays the weights out on the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Steps of at least this many tokens multiply the layers' matrices through dequantized f16
    /// copies (kept beside the stored blocks) instead of the quantized kernels; `None`: never.
    pub dense_gemm_tokens: Option<usize>,
}

/// One weight matrix of a layer: its stored blocks, and under
/// [`LoadOptions::dense_gemm_tokens`] a dequantized f16 copy.
#[derive(Debug)]
struct Linear {
    blocks: QMatMul,
    /// [`QMatMul::TensorF16`]: activations go to f16 for the product and back.
    dense: Option<QMatMul>,
}

impl Linear {
    /// `x · wᵀ` for `x` of `[tokens, in]`: through the f16 copy when `dense` and there is one.
    fn forward(&self, x: &Tensor, dense: bool) -> Result<Tensor, ModelError> {
        Ok(match &self.dense {
            Some(copy) if dense => copy.forward(x)?,
            _ => self.blocks.forward(x)?,
        })
    }
}

/// One layer's weights on the device (GGUF tensor `blk.N.<name>`).
#[derive(Debug)]
struct Layer {
    /// `attn_norm.weight`
    attn_norm: Tensor,
    /// `attn_q`, `attn_k`, `attn_v`
    q: Linear,
    k: Linear,
    v: Linear,
    /// `attn_output`
    o: Linear,
    /// `attn_q_norm`, `attn_k_norm` (Gemma 3)
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// `post_attention_norm` (Gemma 2 and 3)
    post_attn_norm: Option<Tensor>,
    /// `ffn_norm`
    ffn_norm: Tensor,
    /// `ffn_gate`, `ffn_up`, `ffn_down`
    gate: Linear,
    up: Linear,
    down: Linear,
    /// `post_ffw_norm` (Gemma 2 and 3)
    post_ffn_norm: Option<Tensor>,
}

/// Gemma's weights on a candle device; immutable and shared with the engine thread.
#[derive(Debug)]
pub struct GenericModel {
    pub config: GemmaConfig,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub end_of_turn_id: Option<u32>,
    device: Device,
    /// `token_embd.weight`, in its stored format.
    embedding: Arc<QTensor>,
    layers: Vec<Layer>,
    /// `output_norm.weight`
    output_norm: Tensor,
    /// `output.weight`, or the embedding when the file ties them.
    output: QMatMul,
    inv_freq_global: Vec<f32>,
    inv_freq_local: Vec<f32>,
    weights_bytes: usize,
    /// [`LoadOptions::dense_gemm_tokens`]
    dense_gemm_tokens: Option<usize>,
}

impl GenericModel {
    /// Loads a Gemma GGUF file onto `device`.
    pub fn load_gguf(
        path: &Path,
        device: &Device,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        let mut f = GgufReader::open(path, device, options.dense_gemm_tokens.is_some())?;
        let config = GemmaConfig::from_gguf(&f.content)?;
        let (bos_id, eos_id, end_of_turn_id) = special_tokens(&f.content.metadata);
        let embedding = Arc::new(f.tensor("token_embd.weight")?);
        let output = if f.has("output.weight") {
            f.matrix("output.weight")?
        } else {
            QMatMul::from_arc(embedding.clone())?
        };
        let output_norm = f.vector("output_norm.weight")?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: f.vector(&n("attn_norm"))?,
                q: f.linear(&n("attn_q"))?,
                k: f.linear(&n("attn_k"))?,
                v: f.linear(&n("attn_v"))?,
                o: f.linear(&n("attn_output"))?,
                q_norm: f.opt_vector(&n("attn_q_norm"))?,
                k_norm: f.opt_vector(&n("attn_k_norm"))?,
                post_attn_norm: f.opt_vector(&n("post_attention_norm"))?,
                ffn_norm: f.vector(&n("ffn_norm"))?,
                gate: f.linear(&n("ffn_gate"))?,
                up: f.linear(&n("ffn_up"))?,
                down: f.linear(&n("ffn_down"))?,
                post_ffn_norm: f.opt_vector(&n("post_ffw_norm"))?,
            });
        }
        let hd = config.head_dim;
        Ok(Self {
            inv_freq_global: crate::model::ops::rope_inv_freq(
                hd,
                config.rope_base_global,
                config.rope_scale_global,
            ),
            inv_freq_local: crate::model::ops::rope_inv_freq(hd, config.rope_base_local, 1.0),
            config,
            bos_id,
            eos_id,
            end_of_turn_id,
            device: device.clone(),
            embedding,
            layers,
            output_norm,
            output,
            weights_bytes: f.bytes,
            dense_gemm_tokens: options.dense_gemm_tokens,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weights held on the device.
    pub fn weights_bytes(&self) -> usize {
        self.weights_bytes
    }

    /// Runs one step; writes `vocab_size` logits for each of every chunk's last `logit_rows`
    /// positions, in order, to `logits` (as [`crate::model::Model::forward`]).
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut DeviceKv,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        logits.clear();
        let n_tok: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        if n_tok == 0 {
            return Ok(());
        }
        let x = self.hidden(chunks, kv)?;
        // Only the rows that sample need the (expensive) output projection.
        let mut rows = Vec::new();
        let mut end = 0u32;
        for ch in chunks {
            end += ch.tokens.len() as u32;
            let n = ch.logit_rows.min(ch.tokens.len()) as u32;
            rows.extend(end - n..end);
        }
        if rows.is_empty() {
            return Ok(());
        }
        let rows = Tensor::new(rows.as_slice(), &self.device)?;
        let x = rms_norm(
            &x.index_select(&rows, 0)?,
            &self.output_norm,
            self.config.rms_eps,
        )?;
        let mut out = self.output.forward(&x)?;
        if let Some(cap) = self.config.final_logit_softcap {
            out = softcap(&out, cap)?;
        }
        *logits = out.flatten_all()?.to_vec1::<f32>()?;
        Ok(())
    }

    /// The final hidden state (`[tokens, hidden]`) of every token of `chunks`, writing their K/V.
    fn hidden(&self, chunks: &[SeqChunk<'_>], kv: &mut DeviceKv) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let dev = &self.device;
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let ids: Vec<u32> = chunks
            .iter()
            .flat_map(|ch| ch.tokens.iter().copied())
            .collect();
        if let Some(&t) = ids.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::Shape(format!(
                "token id {t} outside vocabulary of {}",
                c.vocab_size
            )));
        }
        let n_tok = ids.len();
        let dense = self.dense_gemm_tokens.is_some_and(|min| n_tok >= min);
        let mut x = self
            .embedding
            .embedding(&Tensor::new(ids.as_slice(), dev)?)?
            .to_dtype(DType::F32)?
            .affine((h as f32).sqrt() as f64, 0.0)?;

        // Positions and slots of every token row, and each chunk's visible spans per layer kind.
        let mut pos = Vec::with_capacity(n_tok);
        let mut slots = Vec::with_capacity(n_tok);
        for ch in chunks {
            for i in 0..ch.tokens.len() {
                let p = ch.start_pos + i;
                pos.push(p as f32);
                slots.push(kv.slot(ch.blocks, p));
            }
        }
        let slots = Tensor::new(slots.as_slice(), dev)?;
        let rope_global = Rope::new(&pos, &self.inv_freq_global, dev)?;
        let rope_local = Rope::new(&pos, &self.inv_freq_local, dev)?;
        let spans = [
            Span::all(chunks, None, kv, dev)?,
            Span::all(chunks, c.sliding_window, kv, dev)?,
        ];
        let scale = 1.0 / (c.query_pre_attn_scalar as f64).sqrt();

        for (li, layer) in self.layers.iter().enumerate() {
            let local = c.is_sliding(li);
            let (rope, spans) = if local {
                (&rope_local, &spans[1])
            } else {
                (&rope_global, &spans[0])
            };
            let hn = rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let mut q = layer.q.forward(&hn, dense)?.reshape((n_tok, nh, hd))?;
            let mut k = layer.k.forward(&hn, dense)?.reshape((n_tok, nkv, hd))?;
            let v = layer.v.forward(&hn, dense)?;
            if let Some(w) = &layer.q_norm {
                q = rms_norm(&q, w, c.rms_eps)?;
            }
            if let Some(w) = &layer.k_norm {
                k = rms_norm(&k, w, c.rms_eps)?;
            }
            let q = rope.apply(&q)?;
            let k = rope.apply(&k)?.reshape((n_tok, nkv * hd))?;
            // This step's K/V first, so attention reads every position from one place.
            kv.write(li, &slots, &k, &v)?;
            let mut outs = Vec::with_capacity(chunks.len());
            let mut off = 0;
            for (ch, span) in chunks.iter().zip(spans) {
                let n = ch.tokens.len();
                outs.push(attend(c, li, &q.narrow(0, off, n)?, kv, span, scale)?);
                off += n;
            }
            let attn = Tensor::cat(&outs, 0)?;
            let mut o = layer.o.forward(&attn, dense)?;
            if let Some(w) = &layer.post_attn_norm {
                o = rms_norm(&o, w, c.rms_eps)?;
            }
            x = (x + o)?;

            let hn = rms_norm(&x, &layer.ffn_norm, c.rms_eps)?;
            let g = layer.gate.forward(&hn, dense)?.gelu()?;
            let u = layer.up.forward(&hn, dense)?;
            let mut d = layer.down.forward(&(g * u)?, dense)?;
            if let Some(w) = &layer.post_ffn_norm {
                d = rms_norm(&d, w, c.rms_eps)?;
            }
            x = (x + d)?;
        }
        Ok(x)
    }
}

/// Reads a GGUF file's tensors onto a device, counting the bytes they take there.
struct GgufReader {
    content: Content,
    reader: BufReader<File>,
    device: Device,
    bytes: usize,
    /// Give layer matrices a dequantized f16 copy.
    dense: bool,
}

impl GgufReader {
    fn open(path: &Path, device: &Device, dense: bool) -> Result<Self, ModelError> {
        let io = |reason: String| ModelError::Io {
            path: path.display().to_string(),
            reason,
        };
        let mut reader = BufReader::new(File::open(path).map_err(|e| io(e.to_string()))?);
        let content =
            Content::read(&mut reader).map_err(|e| io(format!("not a GGUF file: {e}")))?;
        Ok(Self {
            content,
            reader,
            device: device.clone(),
            bytes: 0,
            dense,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        if !self.has(name) {
            return Err(ModelError::MissingTensor(name.into()));
        }
        let t = self.content.tensor(&mut self.reader, name, &self.device)?;
        self.bytes += t.storage_size_in_bytes();
        Ok(t)
    }

    /// A matrix, kept in its stored format.
    fn matrix(&mut self, name: &str) -> Result<QMatMul, ModelError> {
        Ok(QMatMul::from_qtensor(self.tensor(name)?)?)
    }

    /// A layer's matrix: its stored blocks, and a dequantized f16 copy when asked for.
    fn linear(&mut self, name: &str) -> Result<Linear, ModelError> {
        let t = self.tensor(name)?;
        let dense = if self.dense {
            let w = t.dequantize_f16(&self.device)?;
            self.bytes += w.elem_count() * DType::F16.size_in_bytes();
            Some(QMatMul::TensorF16(w))
        } else {
            None
        };
        Ok(Linear {
            blocks: QMatMul::from_qtensor(t)?,
            dense,
        })
    }

    /// A norm's weights, as f32.
    fn vector(&mut self, name: &str) -> Result<Tensor, ModelError> {
        let device = self.device.clone();
        Ok(self
            .tensor(name)?
            .dequantize(&device)?
            .to_dtype(DType::F32)?)
    }

    fn opt_vector(&mut self, name: &str) -> Result<Option<Tensor>, ModelError> {
        self.has(name).then(|| self.vector(name)).transpose()
    }
}

/// The positions one chunk's tokens see in one kind of layer: the slots of positions
/// `lo..=start_pos + n - 1` and the additive mask (`[n, span]`: 0 where token `r` sees the
/// position, `-inf` where it is in the future or outside the window).
#[derive(Debug)]
struct Span {
    slots: Tensor,
    mask: Option<Tensor>,
}

impl Span {
    fn all(
        chunks: &[SeqChunk<'_>],
        window: Option<usize>,
        kv: &DeviceKv,
        dev: &Device,
    ) -> Result<Vec<Self>, ModelError> {
        chunks
            .iter()
            .map(|ch| {
                let n = ch.tokens.len();
                let last = |r: usize| ch.start_pos + r;
                let first = |r: usize| window.map_or(0, |w| (last(r) + 1).saturating_sub(w));
                let (lo, hi) = (first(0), last(n - 1));
                let slots: Vec<u32> = (lo..=hi).map(|p| kv.slot(ch.blocks, p)).collect();
                let span = hi + 1 - lo;
                // A single decoded token sees its whole span: no mask needed.
                let mask = (n > 1)
                    .then(|| {
                        let mut m = vec![0f32; n * span];
                        for r in 0..n {
                            for (j, v) in m[r * span..(r + 1) * span].iter_mut().enumerate() {
                                let p = lo + j;
                                if p < first(r) || p > last(r) {
                                    *v = f32::NEG_INFINITY;
                                }
                            }
                        }
                        Tensor::from_vec(m, (n, span), dev)
                    })
                    .transpose()?;
                Ok(Self {
                    slots: Tensor::new(slots.as_slice(), dev)?,
                    mask,
                })
            })
            .collect()
    }
}

/// Attention of one chunk's query rows (`[n, heads, head_dim]`) over its span of layer `li`.
fn attend(
    c: &GemmaConfig,
    li: usize,
    q: &Tensor,
    kv: &DeviceKv,
    span: &Span,
    scale: f64,
) -> Result<Tensor, ModelError> {
    let (n, nh, hd) = q.dims3()?;
    let (nkv, group) = (c.num_kv_heads, c.num_heads / c.num_kv_heads);
    let (k, v) = kv.gather(li, &span.slots)?;
    let len = k.dim(0)?;
    let heads = |t: Tensor| t.reshape((len, nkv, hd))?.transpose(0, 1)?.contiguous();
    let (k, v) = (heads(k)?, heads(v)?);
    // Query heads sharing KV head g are rows g·group .. (g+1)·group: [nkv, group·n, hd].
    let q = q
        .transpose(0, 1)?
        .contiguous()?
        .reshape((nkv, group * n, hd))?;
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = c.attn_logit_softcap {
        scores = softcap(&scores, cap)?;
    }
    if let Some(mask) = &span.mask {
        scores = scores
            .reshape((nkv, group, n, len))?
            .broadcast_add(mask)?
            .reshape((nkv, group * n, len))?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    let out = p.matmul(&v)?; // [nkv, group·n, hd]
    Ok(out
        .reshape((nh, n, hd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, nh * hd))?)
}

/// Rotary embedding tables for the step's token positions (`[tokens, 1, head_dim / 2]`).
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(pos: &[f32], inv_freq: &[f32], dev: &Device) -> Result<Self, ModelError> {
        let half = inv_freq.len();
        // Angles on the host in f32, as the CPU engine computes them.
        let mut cos = Vec::with_capacity(pos.len() * half);
        let mut sin = Vec::with_capacity(pos.len() * half);
        for &p in pos {
            for &f in inv_freq {
                let (s, c) = (p * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        let shape = (pos.len(), 1, half);
        Ok(Self {
            cos: Tensor::from_vec(cos, shape, dev)?,
            sin: Tensor::from_vec(sin, shape, dev)?,
        })
    }

    /// Rotates the two halves of each head (`[tokens, heads, head_dim]`), as Gemma does.
    fn apply(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let half = x.dim(D::Minus1)? / 2;
        let (a, b) = (
            x.narrow(D::Minus1, 0, half)?,
            x.narrow(D::Minus1, half, half)?,
        );
        let ra = (a.broadcast_mul(&self.cos)? - b.broadcast_mul(&self.sin)?)?;
        let rb = (a.broadcast_mul(&self.sin)? + b.broadcast_mul(&self.cos)?)?;
        Ok(Tensor::cat(&[ra, rb], D::Minus1)?)
    }
}

/// `x · w / rms(x)` over the last dimension (Gemma's `1 + w` is folded into the GGUF's `w`).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps as f64)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(w)?)
}

fn softcap(x: &Tensor, cap: f32) -> Result<Tensor, ModelError> {
    let cap = cap as f64;
    Ok((x / cap)?.tanh()?.affine(cap, 0.0)?)
}
