//! One step of the device-generic pass: every sequence's new tokens at their own positions, in
//! one batch, through the fused ops of [`super::ops`]; and the count of what it issues.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Tensor};

use super::ops::{
    EmbedNorm, GeluMul, Heads, KvWrite, PagedAttention, QPrep, ResidualNorm, Softcap, StepMeta,
    Summarize,
};
use super::{DeviceKv, GenericModel};
use crate::model::{ModelError, SeqChunk};
use crate::sampling::LogitSummary;

/// Device operations issued so far: kernel launches and copies between host and device.
///
/// Counted where the pass issues them, by what each costs on CUDA: a fused op, an embedding
/// lookup, a row gather, a concatenation or a softcap is one launch; a product through candle's
/// quantized kernels two (the activations' 8-bit quantization, then the product: candle's MMVQ
/// kernel up to 8 rows, its MMQ kernel beyond), through an f16 copy three (two conversions and
/// cuBLAS), through f32 weights one; each upload or download is one copy. The same rules count
/// a CPU run, so tests check a step's count without a GPU.
/// A replayed step ([`super::graphs`]) is one graph launch.
#[derive(Debug, Default)]
pub struct DeviceOps {
    kernels: AtomicUsize,
    copies: AtomicUsize,
    graphs: AtomicUsize,
}

/// A snapshot of [`DeviceOps`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCount {
    pub kernels: usize,
    pub copies: usize,
    pub graphs: usize,
}

impl OpCount {
    pub fn total(&self) -> usize {
        self.kernels + self.copies + self.graphs
    }

    /// What was issued between `before` and this snapshot.
    pub fn since(&self, before: OpCount) -> OpCount {
        OpCount {
            kernels: self.kernels - before.kernels,
            copies: self.copies - before.copies,
            graphs: self.graphs - before.graphs,
        }
    }
}

impl DeviceOps {
    pub(super) fn kernels(&self, n: usize) {
        self.kernels.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn copies(&self, n: usize) {
        self.copies.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn graphs(&self, n: usize) {
        self.graphs.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes back what was counted but not issued (work recorded into a graph).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn discount(&self, c: OpCount) {
        self.kernels.fetch_sub(c.kernels, Ordering::Relaxed);
        self.copies.fetch_sub(c.copies, Ordering::Relaxed);
        self.graphs.fetch_sub(c.graphs, Ordering::Relaxed);
    }

    pub fn count(&self) -> OpCount {
        OpCount {
            kernels: self.kernels.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            graphs: self.graphs.load(Ordering::Relaxed),
        }
    }
}

/// Kernel launches of one product through `m` on CUDA.
pub(super) fn matmul_launches(m: &QMatMul) -> usize {
    match m {
        QMatMul::QTensor(_) => 2,
        QMatMul::TensorF16(_) => 3,
        QMatMul::Tensor(_) => 1,
    }
}

/// Which rows of a step get the output projection.
pub(super) enum Sampled {
    /// None (prompt chunks that do not end their prompt).
    Nothing,
    /// Every token's (a decode step).
    Every,
    /// Those at these indices (a `[rows]` u32 tensor).
    Rows(Tensor),
}

/// `logits` at `len` values without writing them: growing zeroes only what is new.
fn resize_unwritten(logits: &mut Vec<f32>, len: usize) {
    if logits.len() < len {
        logits.resize(len, 0.0);
    }
    logits.truncate(len);
}

/// The device's summaries of `[rows, vocab]` logits, downloaded.
pub(super) fn summarize(out: &Tensor) -> Result<Vec<LogitSummary>, ModelError> {
    from_device(&out.apply_op1_no_bwd(&Summarize)?)
}

/// Summaries (`[rows, 3]` on the device) as the sampler takes them.
pub(super) fn from_device(s: &Tensor) -> Result<Vec<LogitSummary>, ModelError> {
    Ok(s.to_vec2::<f32>()?
        .into_iter()
        .map(|s| LogitSummary {
            argmax: s[0] as u32,
            max: s[1],
            lse: s[2],
        })
        .collect())
}

/// The halves of a `[2, n, h]` pair of rows: the residual stream and its normalized copy.
fn halves(pair: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
    Ok((pair.get(0)?, pair.get(1)?))
}

impl GenericModel {
    /// Runs one step; writes `vocab_size` logits for each of every chunk's last `logit_rows`
    /// positions, in order, to `logits` (as [`crate::model::Model::forward`]), and the summaries
    /// of all those rows, made on the device, to `summaries`. The rows of
    /// [`SeqChunk::summary_only`] chunks stay on the device: their place in `logits` is left as
    /// it was.
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut DeviceKv,
        logits: &mut Vec<f32>,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(), ModelError> {
        summaries.clear();
        let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        if n == 0 {
            logits.clear();
            return Ok(());
        }
        let dense = self.dense_gemm_tokens.is_some_and(|min| n >= min);
        let greedy_decode = chunks
            .iter()
            .all(|ch| ch.tokens.len() == 1 && ch.logit_rows == 1 && ch.summary_only);
        if greedy_decode && !dense && kv.graphs.is_some() {
            self.replayed_step(chunks, kv, summaries)?;
            resize_unwritten(logits, n * self.config.vocab_size);
            return Ok(());
        }
        let ops = &self.ops;
        let (meta, step, rows, host) = self.meta(chunks, kv)?;
        let meta_len = meta.len();
        let meta = Tensor::from_vec(meta, meta_len, &self.device)?;
        ops.copies(1);
        if rows.is_empty() {
            self.run(&meta, step, Sampled::Nothing, dense, kv)?;
            logits.clear();
            return Ok(());
        }
        let at = |len: usize, from_end: usize| meta.narrow(0, meta_len - from_end, len);
        let host_at = if host.len() < rows.len() {
            host.len()
        } else {
            0
        };
        let sampled = if rows.len() == n {
            Sampled::Every
        } else {
            Sampled::Rows(at(rows.len(), host_at + rows.len())?)
        };
        let out = self.run(&meta, step, sampled, dense, kv)?;
        ops.kernels(1);
        ops.copies(1);
        summaries.extend(summarize(&out)?);
        // Rows whose sampler reads them come to the host: all of them in one copy, or those
        // gathered first.
        let vocab = self.config.vocab_size;
        if host.len() == rows.len() {
            ops.copies(1);
            *logits = out.flatten_all()?.to_vec1::<f32>()?;
            return Ok(());
        }
        resize_unwritten(logits, rows.len() * vocab);
        if !host.is_empty() {
            ops.kernels(1);
            ops.copies(1);
            let got = out
                .index_select(&at(host.len(), host.len())?, 0)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (&r, row) in host.iter().zip(got.chunks_exact(vocab)) {
                logits[r as usize * vocab..][..vocab].copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// The device's part of a step, from the meta tensor on: the embedding, the layers (writing
    /// the step's K/V), and the output projection of the [`Sampled`] rows, softcapped:
    /// `[rows, vocab]` logits (the final norm's output when nothing samples).
    pub(super) fn run(
        &self,
        meta: &Tensor,
        step: StepMeta,
        sampled: Sampled,
        dense: bool,
        kv: &DeviceKv,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let ops = &self.ops;
        ops.kernels(2);
        let emb = self
            .embedding
            .embedding(&meta.narrow(0, 0, step.n)?)?
            .to_dtype(DType::F32)?;
        let (mut x, mut hn) = halves(&emb.apply_op2_no_bwd(
            &self.first_norm,
            &EmbedNorm {
                scale: (c.hidden_size as f32).sqrt(),
                eps: c.rms_eps,
            },
        )?)?;
        let heads = Heads {
            nh: c.num_heads,
            nkv: c.num_kv_heads,
            hd: c.head_dim,
            eps: c.rms_eps,
            qk_norm: self.qk_norm,
        };
        let residual = ResidualNorm {
            eps: c.rms_eps,
            post: self.post_norms,
        };
        let scale = 1.0 / c.query_pre_attn_scalar.sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            let qkv = layer.qkv.forward(&hn, dense, ops)?;
            ops.kernels(3);
            let q = qkv.apply_op3_no_bwd(meta, &layer.aux, &QPrep { heads, meta: step })?;
            let cache = kv.layer(li);
            cache.inplace_op3(
                &qkv,
                meta,
                &KvWrite {
                    heads,
                    meta: step,
                    aux: layer.aux.clone(),
                },
            )?;
            let attn = q.apply_op3_no_bwd(
                cache,
                meta,
                &PagedAttention {
                    heads,
                    meta: step,
                    window: c.sliding_window.filter(|_| c.is_sliding(li)),
                    scale,
                    softcap: c.attn_logit_softcap,
                },
            )?;
            let o = layer.o.forward(&attn, dense, ops)?;
            ops.kernels(1);
            (x, hn) = halves(&x.apply_op3_no_bwd(&o, &layer.attn_norms, &residual)?)?;
            let gu = layer.gate_up.forward(&hn, dense, ops)?;
            ops.kernels(1);
            let g = gu.apply_op1_no_bwd(&GeluMul)?;
            let d = layer.down.forward(&g, dense, ops)?;
            ops.kernels(1);
            (x, hn) = halves(&x.apply_op3_no_bwd(&d, &layer.ffn_norms, &residual)?)?;
        }
        // `hn` is the final norm's output. Only the rows that sample need the (expensive) output
        // projection: every row of a decode step, the last of a prompt's chunk.
        let hn = match sampled {
            Sampled::Nothing => return Ok(hn),
            Sampled::Every => hn,
            Sampled::Rows(rows) => {
                ops.kernels(1);
                hn.index_select(&rows, 0)?
            }
        };
        ops.kernels(matmul_launches(&self.output));
        let out = self.output.forward(&hn)?;
        if let Some(cap) = c.final_logit_softcap {
            ops.kernels(1);
            out.inplace_op1(&Softcap(cap))?;
        }
        Ok(out)
    }

    /// A chunk the device can run: its token ids in the vocabulary, its block table covering
    /// its positions (a kernel would read past either).
    pub(super) fn check_chunk(
        &self,
        ch: &SeqChunk<'_>,
        block_size: usize,
    ) -> Result<(), ModelError> {
        let vocab = self.config.vocab_size;
        if let Some(&t) = ch.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Shape(format!(
                "token id {t} outside vocabulary of {vocab}"
            )));
        }
        if ch.blocks.len() * block_size < ch.start_pos + ch.tokens.len() {
            return Err(ModelError::Shape(format!(
                "a block table of {} blocks does not cover position {}",
                ch.blocks.len(),
                ch.start_pos + ch.tokens.len() - 1
            )));
        }
        Ok(())
    }

    /// The step's meta values (ids, positions, sequence of each token, block tables; then the
    /// rows that sample when not every token does, and which of those go to the host when not
    /// all do), where they lie, the rows that sample and the host's rows among them.
    #[allow(clippy::type_complexity)]
    fn meta(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &DeviceKv,
    ) -> Result<(Vec<u32>, StepMeta, Vec<u32>, Vec<u32>), ModelError> {
        let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        let bs = kv.block_size();
        let max_blocks = chunks.iter().map(|ch| ch.blocks.len()).max().unwrap_or(1);
        let mut meta = Vec::with_capacity(3 * n + chunks.len() * max_blocks);
        for ch in chunks {
            self.check_chunk(ch, bs)?;
            meta.extend_from_slice(ch.tokens);
        }
        for ch in chunks {
            meta.extend((0..ch.tokens.len()).map(|i| (ch.start_pos + i) as u32));
        }
        for (s, ch) in chunks.iter().enumerate() {
            meta.extend(std::iter::repeat_n(s as u32, ch.tokens.len()));
        }
        for ch in chunks {
            meta.extend_from_slice(ch.blocks);
            meta.extend(std::iter::repeat_n(0, max_blocks - ch.blocks.len()));
        }
        let (mut rows, mut host) = (Vec::new(), Vec::new());
        let mut end = 0u32;
        for ch in chunks {
            end += ch.tokens.len() as u32;
            let r = ch.logit_rows.min(ch.tokens.len()) as u32;
            if !ch.summary_only {
                let first = rows.len() as u32;
                host.extend(first..first + r);
            }
            rows.extend(end - r..end);
        }
        if rows.len() < n {
            meta.extend_from_slice(&rows);
        }
        if !host.is_empty() && host.len() < rows.len() {
            meta.extend_from_slice(&host);
        }
        let step = StepMeta {
            n,
            max_blocks,
            block_size: bs,
        };
        Ok((meta, step, rows, host))
    }
}
