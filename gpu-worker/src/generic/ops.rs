//! The device-generic pass's fused operations, as candle custom ops: each is one kernel launch on
//! CUDA (`kernels.cu`, launched from [`super::cuda`]) and plain Rust on candle's CPU device, which
//! the tests run against Hearth's CPU engine. Each replaces a chain of candle operations:
//!
//! | op | replaces |
//! | --- | --- |
//! | [`EmbedNorm`] | scale the embedding, then RMS norm (9 ops) |
//! | [`ResidualNorm`] | post-norm, residual add, next pre-norm (17 ops) |
//! | [`QPrep`] | split, QK-norm, RoPE of the query heads (about 20 ops) |
//! | [`KvWrite`] | QK-norm and RoPE of the key heads, K and V scatters (about 25 ops) |
//! | [`PagedAttention`] | per sequence: gathers, masks, two products, softmax (about 20 ops each) |
//! | [`GeluMul`] | GELU of the gate, times up (3 ops) |
//! | [`Summarize`] | copying the rows to the host to find argmax and log-sum-exp there |
//!
//! A step's token ids, positions, sequence of each token and block tables travel in one u32
//! tensor, [`StepMeta`], uploaded once a step.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, InplaceOp1, InplaceOp3, Layout, Result, Shape,
    Storage, Tensor,
};
use half::f16;

use crate::math::exp;
use crate::model::ops::rms_norm_rows;

/// Where a step's values lie in its meta tensor: `ids[n] | pos[n] | seq[n] | tables[seqs ×
/// max_blocks]`, then the rows to sample when not every token's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepMeta {
    /// Tokens of the step.
    pub n: usize,
    /// Entries of each sequence's block table.
    pub max_blocks: usize,
    pub block_size: usize,
}

impl StepMeta {
    pub fn pos(&self, meta: &[u32], t: usize) -> usize {
        meta[self.n + t] as usize
    }

    fn seq(&self, meta: &[u32], t: usize) -> usize {
        meta[2 * self.n + t] as usize
    }

    /// The cache slot of position `p` of token t's sequence.
    pub fn slot(&self, meta: &[u32], t: usize, p: usize) -> usize {
        let table = 3 * self.n + self.seq(meta, t) * self.max_blocks;
        meta[table + p / self.block_size] as usize * self.block_size + p % self.block_size
    }
}

/// The contiguous f32 values of a CPU tensor argument.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: not contiguous")))?;
    Ok(&s.as_slice::<f32>()?[a..b])
}

fn u32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: not contiguous")))?;
    Ok(&s.as_slice::<u32>()?[a..b])
}

/// A CPU tensor held by an op (weights that ride along with the arguments), as f32 values.
fn held_f32(t: &Tensor) -> Result<Vec<f32>> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => Ok(f32s(c, l, "held tensor")?.to_vec()),
        _ => candle_core::bail!("held tensor is not on the CPU"),
    }
}

/// One head: RMS-normalized with `norm` (if any), then rotated by `pos` (halves together).
fn norm_rope(head: &mut [f32], norm: Option<&[f32]>, inv_freq: &[f32], pos: usize, eps: f32) {
    if let Some(w) = norm {
        rms_norm_rows(head, w, eps);
    }
    let half = inv_freq.len();
    let (a, b) = head.split_at_mut(half);
    for i in 0..half {
        let (s, c) = (pos as f32 * inv_freq[i]).sin_cos();
        let (x0, x1) = (a[i], b[i]);
        a[i] = x0 * c - x1 * s;
        b[i] = x0 * s + x1 * c;
    }
}

/// `[2, n, h]`: the embedding rows times `scale`, then those RMS-normalized with weights `w`.
/// Arguments: the looked-up rows `[n, h]` and `w` `[h]`.
#[derive(Debug, Clone, Copy)]
pub struct EmbedNorm {
    pub scale: f32,
    pub eps: f32,
}

impl CustomOp2 for EmbedNorm {
    fn name(&self) -> &'static str {
        "embed_norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, h) = l1.shape().dims2()?;
        let (emb, w) = (f32s(s1, l1, "embedding")?, f32s(s2, l2, "norm")?);
        let mut out: Vec<f32> = emb.iter().map(|v| v * self.scale).collect();
        out.extend_from_within(..);
        rms_norm_rows(&mut out[n * h..], w, self.eps);
        Ok((CpuStorage::F32(out), Shape::from((2, n, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::embed_norm(self, s1, l1, s2, l2)
    }
}

/// `[2, n, h]`: `x + rms_norm(o) · w[0]` (`x + o` without `post`), then that RMS-normalized with
/// `w[1]`. Arguments: `x`, `o` `[n, h]` and `w` `[2, h]`.
#[derive(Debug, Clone, Copy)]
pub struct ResidualNorm {
    pub eps: f32,
    /// Whether the block's output is normalized before the add (Gemma 2 and 3).
    pub post: bool,
}

impl CustomOp3 for ResidualNorm {
    fn name(&self) -> &'static str {
        "residual_norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, h) = l1.shape().dims2()?;
        let (x, o, w) = (
            f32s(s1, l1, "residual")?,
            f32s(s2, l2, "block output")?,
            f32s(s3, l3, "norms")?,
        );
        let mut o = o.to_vec();
        if self.post {
            rms_norm_rows(&mut o, &w[..h], self.eps);
        }
        let mut out: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        out.extend_from_within(..);
        rms_norm_rows(&mut out[n * h..], &w[h..], self.eps);
        Ok((CpuStorage::F32(out), Shape::from((2, n, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::residual_norm(self, s1, l1, s2, l2, s3, l3)
    }
}

/// The head layout of a fused QKV product and what the layer does to its heads.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    pub eps: f32,
    /// Whether query and key heads are RMS-normalized (Gemma 3).
    pub qk_norm: bool,
}

impl Heads {
    /// Values of one fused QKV row.
    pub fn width(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// `aux`'s parts: query norm, key norm (`hd` each), RoPE inverse frequencies (`hd / 2`).
    fn parts<'a>(&self, aux: &'a [f32]) -> (Option<&'a [f32]>, Option<&'a [f32]>, &'a [f32]) {
        let hd = self.hd;
        let norms = self.qk_norm.then(|| (&aux[..hd], &aux[hd..2 * hd]));
        (norms.map(|n| n.0), norms.map(|n| n.1), &aux[2 * hd..])
    }
}

/// `[n, nh · hd]`: the query heads of the fused QKV rows, QK-normalized and rotated by their
/// tokens' positions. Arguments: the QKV rows `[n, width]`, the step's meta, and the layer's
/// `aux` (query norm, key norm, inverse frequencies).
#[derive(Debug, Clone, Copy)]
pub struct QPrep {
    pub heads: Heads,
    pub meta: StepMeta,
}

impl CustomOp3 for QPrep {
    fn name(&self) -> &'static str {
        "q_prep"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Heads { nh, hd, eps, .. } = self.heads;
        let (qkv, meta, aux) = (
            f32s(s1, l1, "qkv")?,
            u32s(s2, l2, "meta")?,
            f32s(s3, l3, "aux")?,
        );
        let (norm, _, inv_freq) = self.heads.parts(aux);
        let n = self.meta.n;
        let mut out = Vec::with_capacity(n * nh * hd);
        for (t, row) in qkv.chunks_exact(self.heads.width()).enumerate() {
            let start = out.len();
            out.extend_from_slice(&row[..nh * hd]);
            for head in out[start..].chunks_exact_mut(hd) {
                norm_rope(head, norm, inv_freq, self.meta.pos(meta, t), eps);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((n, nh * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::q_prep(self, s1, l1, s2, l2, s3, l3)
    }
}

/// Writes the key heads (QK-normalized, rotated) and value heads of the fused QKV rows into their
/// slots of a layer's cache (`[2, slots, nkv · hd]`: keys, then values; f16 or f32), in place.
/// Arguments: the QKV rows and the step's meta; the layer's `aux` rides along.
#[derive(Debug, Clone)]
pub struct KvWrite {
    pub heads: Heads,
    pub meta: StepMeta,
    pub aux: Tensor,
}

impl KvWrite {
    /// Each token's cache slot and its rotated key row and value row (`nkv · hd` each).
    fn rows(&self, qkv: &[f32], meta: &[u32], aux: &[f32]) -> Vec<(usize, Vec<f32>, Vec<f32>)> {
        let Heads {
            nh, nkv, hd, eps, ..
        } = self.heads;
        let (_, norm, inv_freq) = self.heads.parts(aux);
        qkv.chunks_exact(self.heads.width())
            .enumerate()
            .map(|(t, row)| {
                let pos = self.meta.pos(meta, t);
                let mut k = row[nh * hd..(nh + nkv) * hd].to_vec();
                for head in k.chunks_exact_mut(hd) {
                    norm_rope(head, norm, inv_freq, pos, eps);
                }
                let v = row[(nh + nkv) * hd..].to_vec();
                (self.meta.slot(meta, t, pos), k, v)
            })
            .collect()
    }
}

impl InplaceOp3 for KvWrite {
    fn name(&self) -> &'static str {
        "kv_write"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let (qkv, meta) = (f32s(s1, l1, "qkv")?, u32s(s2, l2, "meta")?);
        let aux = held_f32(&self.aux)?;
        let (_, slots, kv_dim) = dst_l.shape().dims3()?;
        let rows = self.rows(qkv, meta, &aux);
        fn put<T: Copy>(cache: &mut [T], at: usize, xs: &[f32], conv: impl Fn(f32) -> T) {
            for (c, &x) in cache[at..at + xs.len()].iter_mut().zip(xs) {
                *c = conv(x);
            }
        }
        let base = dst_l.start_offset();
        for (slot, k, v) in rows {
            let (ka, va) = (base + slot * kv_dim, base + (slots + slot) * kv_dim);
            match dst {
                CpuStorage::F32(c) => {
                    put(c, ka, &k, |x| x);
                    put(c, va, &v, |x| x);
                }
                CpuStorage::F16(c) => {
                    put(c, ka, &k, f16::from_f32);
                    put(c, va, &v, f16::from_f32);
                }
                other => candle_core::bail!("kv_write: a {:?} cache", other.dtype()),
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        super::cuda::kv_write(self, dst, dst_l, [(s1, l1), (s2, l2)])
    }
}

/// `[n, nh · hd]`: attention of every query row of a step over its own sequence's positions
/// (`pos + 1 - window ..= pos` on sliding layers), keys and values read by slot through the
/// block tables. Arguments: the queries `[n, nh · hd]`, the layer's cache and the step's meta.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention {
    pub heads: Heads,
    pub meta: StepMeta,
    /// Positions a sliding layer sees (itself included); `None` for global layers.
    pub window: Option<usize>,
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl PagedAttention {
    fn run<T: Copy>(
        &self,
        q: &[f32],
        cache: &[T],
        slots: usize,
        meta: &[u32],
        f: impl Fn(T) -> f32,
    ) -> Vec<f32> {
        let Heads { nh, nkv, hd, .. } = self.heads;
        let (group, kv_dim) = (nh / nkv, nkv * hd);
        let mut out = vec![0f32; q.len()];
        let mut scores = Vec::new();
        for t in 0..self.meta.n {
            let pos = self.meta.pos(meta, t);
            let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let at: Vec<usize> = (lo..=pos).map(|p| self.meta.slot(meta, t, p)).collect();
            for head in 0..nh {
                let kvh = head / group;
                let qh = &q[(t * nh + head) * hd..][..hd];
                scores.clear();
                for &slot in &at {
                    let k = &cache[slot * kv_dim + kvh * hd..][..hd];
                    let mut s = qh.iter().zip(k).map(|(a, &b)| a * f(b)).sum::<f32>() * self.scale;
                    if let Some(cap) = self.softcap {
                        s = (s / cap).tanh() * cap;
                    }
                    scores.push(s);
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0.0;
                for s in scores.iter_mut() {
                    *s = exp(*s - max);
                    total += *s;
                }
                let o = &mut out[(t * nh + head) * hd..][..hd];
                for (&slot, &p) in at.iter().zip(&scores) {
                    let v = &cache[(slots + slot) * kv_dim + kvh * hd..][..hd];
                    for (o, &x) in o.iter_mut().zip(v) {
                        *o += p / total * f(x);
                    }
                }
            }
        }
        out
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged_attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, meta) = (f32s(s1, l1, "queries")?, u32s(s3, l3, "meta")?);
        let (_, slots, _) = l2.shape().dims3()?;
        let (a, b) = l2
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("cache: not contiguous".into()))?;
        let out = match s2 {
            CpuStorage::F32(c) => self.run(q, &c[a..b], slots, meta, |x| x),
            CpuStorage::F16(c) => self.run(q, &c[a..b], slots, meta, f16::to_f32),
            other => candle_core::bail!("paged_attention: a {:?} cache", other.dtype()),
        };
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::paged_attention(self, s1, l1, s2, l2, s3, l3)
    }
}

/// `[n, f]`: GELU (tanh) of the first half of each row of the fused gate/up product `[n, 2f]`,
/// times its second half.
#[derive(Debug, Clone, Copy)]
pub struct GeluMul;

impl CustomOp1 for GeluMul {
    fn name(&self) -> &'static str {
        "gelu_mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, two_f) = l.shape().dims2()?;
        let f = two_f / 2;
        let gu = f32s(s, l, "gate/up")?;
        let mut out = Vec::with_capacity(n * f);
        for row in gu.chunks_exact(two_f) {
            let start = out.len();
            out.extend_from_slice(&row[..f]);
            crate::model::ops::gelu_mul(&mut out[start..], &row[f..]);
        }
        Ok((CpuStorage::F32(out), Shape::from((n, f))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::gelu_mul(s, l)
    }
}

/// `cap · tanh(x / cap)`, in place (Gemma 2's final logits).
#[derive(Debug, Clone, Copy)]
pub struct Softcap(pub f32);

impl InplaceOp1 for Softcap {
    fn name(&self) -> &'static str {
        "softcap"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("softcap: not contiguous".into()))?;
        match s {
            CpuStorage::F32(v) => crate::model::ops::softcap(&mut v[a..b], self.0),
            other => candle_core::bail!("softcap: {:?} values", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        super::cuda::softcap(self.0, s, l)
    }
}

/// `[rows, 3]`: each row's first argmax (as an f32, exact below 2^24), maximum and log-sum-exp,
/// so a greedy pick needs 12 bytes of the device instead of the whole row.
#[derive(Debug, Clone, Copy)]
pub struct Summarize;

impl CustomOp1 for Summarize {
    fn name(&self) -> &'static str {
        "logit_summary"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let logits = f32s(s, l, "logits")?;
        let mut out = Vec::with_capacity(rows * 3);
        for row in logits.chunks_exact(vocab) {
            let s = crate::sampling::LogitSummary::of(row);
            out.extend([s.argmax as f32, row[s.argmax as usize], s.lse]);
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::logit_summary(s, l)
    }
}
