//! Gemma (1, 2 and 3) as a batched forward pass over paged KV memory.
//!
//! Architecture, per layer: RMS norm → Q/K/V projections → (Gemma 3) per-head RMS norm of Q and K
//! → rotary embedding (a smaller base on sliding-window layers) → attention over the sequence's
//! own cached tokens (only the last `sliding_window` on local layers; scores soft-capped on
//! Gemma 2) → output projection → (Gemma 2/3) post-attention norm → residual; then RMS norm →
//! GELU(gate) × up → down → (Gemma 2/3) post-FFN norm → residual. The token embedding is scaled by
//! √hidden and, when there is no separate output matrix, tied to the output projection.
//!
//! A step's input is a list of [`SeqChunk`]s: each sequence contributes the tokens it feeds this
//! step (one when decoding, a prompt chunk when prefilling) at its own positions and with its own
//! block table. Linear layers see all of them as one `[tokens, hidden]` matrix; attention is per
//! sequence. Logits are computed only for chunks that ask for them.

mod attention;
mod config;
mod linear;
mod load;
pub(crate) mod ops;

pub(crate) use config::special_tokens;
pub use config::GemmaConfig;
pub use linear::{Input, Linear, LinearGroup};
pub use load::{load_gguf, load_safetensors};

use std::sync::{Arc, Mutex};

use crate::kernels::Q8Matrix;
use crate::kv::{BlockId, KvStore};
use crate::sampling::{LogitSummary, Piece, PIECE};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read model file {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("model metadata is missing `{0}`")]
    MissingMetadata(String),
    #[error("model is missing tensor `{0}`")]
    MissingTensor(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("invalid model configuration: {0}")]
    BadConfig(String),
    #[error("tensor shape mismatch: {0}")]
    Shape(String),
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
}

/// The token embedding, kept in its stored format (the 262k-row table is never expanded to f32).
#[derive(Debug)]
pub enum Embedding {
    Q8(Arc<Q8Matrix>),
    Dense {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
}

impl Embedding {
    fn row(&self, id: usize, out: &mut [f32]) {
        match self {
            Self::Q8(m) => m.dequantize_row(id, out),
            Self::Dense { cols, data, .. } => {
                out.copy_from_slice(&data[id * cols..(id + 1) * cols])
            }
        }
    }
}

#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V projections.
    pub qkv: LinearGroup,
    pub o: Linear,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections of the FFN.
    pub gate_up: LinearGroup,
    pub down: Linear,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Immutable weights; shared by reference with the engine thread.
#[derive(Debug)]
pub struct Model {
    pub config: GemmaConfig,
    pub embedding: Embedding,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    pub output: Linear,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub end_of_turn_id: Option<u32>,
    inv_freq_global: Vec<f32>,
    inv_freq_local: Vec<f32>,
}

/// The tokens one sequence feeds in one step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; the sequence's cache holds positions `0..start_pos`.
    pub start_pos: usize,
    /// Must cover `start_pos + tokens.len()` positions; leading entries may be
    /// [`crate::kv::NO_BLOCK`], their global layers held by `packed`.
    pub blocks: &'a [BlockId],
    /// Packed global-layer blocks of the table's leading positions (see [`crate::kv::Packing`]).
    pub packed: &'a [BlockId],
    /// Logits wanted for this many of the chunk's last positions: 0 for a prompt chunk that is
    /// not the prompt's end, 1 to sample the next token, more to verify a speculative draft.
    pub logit_rows: usize,
    /// The sampler reads only the rows' summaries (greedy, no penalty, no draft): a pass that
    /// summarizes on the device leaves such rows there, and their place in the step's logits
    /// unwritten. Passes that make every row on the host ignore it.
    pub summary_only: bool,
}

impl Model {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        config: GemmaConfig,
        embedding: Embedding,
        layers: Vec<Layer>,
        output_norm: Vec<f32>,
        output: Linear,
        special: (Option<u32>, Option<u32>, Option<u32>),
    ) -> Self {
        let hd = config.head_dim;
        Self {
            inv_freq_global: ops::rope_inv_freq(
                hd,
                config.rope_base_global,
                config.rope_scale_global,
            ),
            inv_freq_local: ops::rope_inv_freq(hd, config.rope_base_local, 1.0),
            config,
            embedding,
            layers,
            output_norm,
            output,
            bos_id: special.0,
            eos_id: special.1,
            end_of_turn_id: special.2,
        }
    }

    /// [`key_balance`] for every layer, when every layer has query and key norms.
    pub fn key_balance(&self) -> Option<Vec<Vec<f32>>> {
        self.layers
            .iter()
            .map(|l| key_balance(l.q_norm.as_ref()?, l.k_norm.as_ref()?))
            .collect()
    }

    /// Bytes of weights held.
    pub fn weights_bytes(&self) -> usize {
        let emb = match &self.embedding {
            Embedding::Q8(m) => m.size_in_bytes(),
            Embedding::Dense { data, .. } => data.len() * 4,
        };
        let tied = matches!((&self.embedding, &self.output), (Embedding::Q8(a), Linear::Q8(b)) if Arc::ptr_eq(a, b));
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_in_bytes()
                    + l.gate_up.size_in_bytes()
                    + l.o.size_in_bytes()
                    + l.down.size_in_bytes()
            })
            .sum();
        emb + layers + if tied { 0 } else { self.output.size_in_bytes() }
    }

    /// Runs one step; writes `vocab_size` logits for each of every chunk's last `logit_rows`
    /// positions, in order, to `logits` (resized to fit), and each such row's [`LogitSummary`] to
    /// `summaries`. The caller keeps `logits` between steps: at 64 rows it is 64 MiB, which a
    /// fresh allocation would fault in and zero on every step.
    pub fn forward(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut KvStore,
        logits: &mut Vec<f32>,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        let x = self.hidden(chunks, kv)?;
        // Only the rows that sample need the (expensive) output projection.
        let mut last = Vec::new();
        let mut end = 0;
        for ch in chunks {
            end += ch.tokens.len();
            let rows = ch.logit_rows.min(ch.tokens.len());
            last.extend_from_slice(&x[(end - rows) * h..end * h]);
        }
        self.logits(last, logits, Some(summaries))
    }

    /// The `k` most likely next tokens (id, logit; best first) after every position of one
    /// chunk (teacher forcing). For accuracy tests over many positions.
    pub fn forward_top_k(
        &self,
        chunk: SeqChunk<'_>,
        kv: &mut KvStore,
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, ModelError> {
        let h = self.config.hidden_size;
        let vocab = self.config.vocab_size;
        let x = self.hidden(&[chunk], kv)?;
        let mut out = Vec::with_capacity(chunk.tokens.len());
        // 64 rows of logits at a time: all of them at once would be rows × 262k floats.
        let mut logits = Vec::new();
        for rows in x.chunks(64 * h) {
            self.logits(rows.to_vec(), &mut logits, None)?;
            out.extend(logits.chunks_exact(vocab).map(|l| {
                let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
                for (i, &v) in l.iter().enumerate() {
                    if top.len() < k || v > top[top.len() - 1].1 {
                        let at = top.partition_point(|&(_, t)| t >= v);
                        top.insert(at, (i as u32, v));
                        top.truncate(k);
                    }
                }
                top
            }));
        }
        Ok(out)
    }

    /// Logits of hidden-state rows (final norm, output projection, soft-cap), and with
    /// `summaries` each row's [`LogitSummary`]: the projection's tasks soft-cap and summarize
    /// their outputs as they finish.
    fn logits(
        &self,
        mut rows: Vec<f32>,
        logits: &mut Vec<f32>,
        mut summaries: Option<&mut Vec<LogitSummary>>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let n = rows.len() / h;
        // Cleared first: an error below leaves no stale summaries.
        if let Some(s) = summaries.as_deref_mut() {
            s.clear();
        }
        if n == 0 {
            logits.clear();
            return Ok(());
        }
        ops::rms_norm_rows(&mut rows, &self.output_norm, c.rms_eps);
        let (cap, summarize) = (c.final_logit_softcap, summaries.is_some());
        // (row, piece) of every task, in whatever order the tasks finish.
        let pieces = Mutex::new(Vec::new());
        self.output
            .forward_then(&Input::new(&rows, n, h), logits, PIECE, &|cols, rows| {
                let mut mine = Vec::new();
                for (r, row) in rows.iter_mut().enumerate() {
                    if let Some(cap) = cap {
                        ops::softcap(row, cap);
                    }
                    if summarize {
                        mine.extend(Piece::all_of(cols.start, row).map(|p| (r, p)));
                    }
                }
                pieces
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(mine);
            })?;
        if let Some(summaries) = summaries {
            let pieces = pieces.into_inner().unwrap_or_else(|e| e.into_inner());
            *summaries = LogitSummary::of_pieces(pieces, logits, vocab);
        }
        Ok(())
    }

    /// The final hidden state of every token row of `chunks` (writing their K/V).
    fn hidden(&self, chunks: &[SeqChunk<'_>], kv: &mut KvStore) -> Result<Vec<f32>, ModelError> {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let n_tok: usize = chunks.iter().map(|s| s.tokens.len()).sum();
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        // Token rows: which chunk and position each belongs to.
        let mut pos = Vec::with_capacity(n_tok);
        for ch in chunks {
            pos.extend((0..ch.tokens.len()).map(|i| ch.start_pos + i));
        }
        let mut x = vec![0f32; n_tok * h];
        let scale = (h as f32).sqrt();
        for (row, &t) in x
            .chunks_exact_mut(h)
            .zip(chunks.iter().flat_map(|ch| ch.tokens))
        {
            if t as usize >= c.vocab_size {
                return Err(ModelError::Shape(format!(
                    "token id {t} outside vocabulary of {}",
                    c.vocab_size
                )));
            }
            self.embedding.row(t as usize, row);
            row.iter_mut().for_each(|v| *v *= scale);
        }

        let (mut hbuf, mut q, mut k, mut v, mut o, mut g, mut u, mut d) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let mut attn = vec![0f32; n_tok * c.num_heads * hd];
        let mut scratch = Vec::new();
        // Every layer rotates by one of two sets of frequencies: their angles, once a step.
        let angles_global = ops::RopeAngles::new(&pos, &self.inv_freq_global);
        let angles_local = ops::RopeAngles::new(&pos, &self.inv_freq_local);
        for (li, layer) in self.layers.iter().enumerate() {
            let local = c.is_sliding(li);
            ops::rms_norm_into(&x, &layer.attn_norm, c.rms_eps, &mut hbuf);
            let input = Input::new(&hbuf, n_tok, h);
            layer
                .qkv
                .forward(&input, &mut scratch, &mut [&mut q, &mut k, &mut v])?;
            if let Some(w) = &layer.q_norm {
                ops::rms_norm_rows(&mut q, w, c.rms_eps);
            }
            if let Some(w) = &layer.k_norm {
                ops::rms_norm_rows(&mut k, w, c.rms_eps);
            }
            let angles = if local { &angles_local } else { &angles_global };
            let (qd, kd) = (c.num_heads * hd, c.kv_dim());
            for t in 0..n_tok {
                angles.rotate(t, &mut q[t * qd..(t + 1) * qd]);
                angles.rotate(t, &mut k[t * kd..(t + 1) * kd]);
            }
            // Write this step's K/V first, so attention reads every position from one place.
            let mut t = 0;
            for ch in chunks {
                for i in 0..ch.tokens.len() {
                    kv.write(
                        li,
                        ch.blocks,
                        ch.start_pos + i,
                        &k[t * kd..(t + 1) * kd],
                        &v[t * kd..(t + 1) * kd],
                    );
                    t += 1;
                }
            }
            attention::attention(c, li, local, chunks, &q, kv, &mut attn);
            let input = Input::new(&attn, n_tok, qd);
            layer.o.forward(&input, &mut o)?;
            if let Some(w) = &layer.post_attn_norm {
                ops::rms_norm_rows(&mut o, w, c.rms_eps);
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            ops::rms_norm_into(&x, &layer.ffn_norm, c.rms_eps, &mut hbuf);
            let input = Input::new(&hbuf, n_tok, h);
            layer
                .gate_up
                .forward(&input, &mut scratch, &mut [&mut g, &mut u])?;
            gelu_mul(&mut g, &u);
            let input = Input::new(&g, n_tok, c.ffn_size);
            layer.down.forward(&input, &mut d)?;
            if let Some(w) = &layer.post_ffn_norm {
                ops::rms_norm_rows(&mut d, w, c.rms_eps);
            }
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }

        Ok(x)
    }
}

/// [`ops::gelu_mul`], split across the kernel pool when there is enough of it (a prefill's or a
/// large batch's FFN activations): each value is its own, so the split changes nothing.
fn gelu_mul(g: &mut [f32], u: &[f32]) {
    const PER_TASK: usize = 1 << 15;
    if g.len() < 2 * PER_TASK {
        ops::gelu_mul(g, u);
        return;
    }
    let parts: Vec<Mutex<(&mut [f32], &[f32])>> = g
        .chunks_mut(PER_TASK)
        .zip(u.chunks(PER_TASK))
        .map(Mutex::new)
        .collect();
    crate::kernels::SpinPool::global().run(parts.len(), &|i| {
        if let Ok(mut part) = parts[i].lock() {
            let (g, u) = &mut *part;
            ops::gelu_mul(g, u);
        }
    });
}

/// Per-channel factors for int8 keys, one per channel of a head: the store quantizes `k * a` and
/// divides by `a` when it reads the key back. The norms make some key channels large where queries
/// are small, and the reverse; one group scale must cover the largest key, while the error a key
/// channel adds to a score grows with its query. `a = sqrt(|w_q| / |w_k|)`, from the layer's query
/// and key norm weights, gives the channels where queries are large the finer steps. The two
/// halves of a head that RoPE rotates together share a factor. `None` without usable norms.
pub fn key_balance(q: &[f32], k: &[f32]) -> Option<Vec<f32>> {
    let n = q.len();
    if n != k.len() || !n.is_multiple_of(2) {
        return None;
    }
    let half = n / 2;
    // Channels whose weight is (near) zero are zero on that side whatever the factor.
    let floor = |w: &[f32]| w.iter().fold(0f32, |m, x| m.max(x.abs())) * 1e-3;
    let (fq, fk) = (floor(q), floor(k));
    if fq == 0.0 || fk == 0.0 {
        return None;
    }
    let mut a = vec![1f32; n];
    for i in 0..half {
        let pair = |w: &[f32], f: f32| w[i].abs().max(w[i + half].abs()).max(f);
        let f = (pair(q, fq) / pair(k, fk)).sqrt();
        a[i] = f;
        a[i + half] = f;
    }
    Some(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_balance_brings_both_sides_of_each_rope_pair_to_one_magnitude() {
        let hd = 8;
        let q_w: Vec<f32> = vec![0.5, 4.0, 1.0, 0.0, 2.0, 0.25, 1.0, 3.0];
        let k_w: Vec<f32> = vec![8.0, 0.5, 1.0, 2.0, 0.1, 1.0, 0.0, 2.0];
        let a = key_balance(&q_w, &k_w).unwrap();
        // Each RoPE pair's largest weight is now the same on both sides.
        for i in 0..hd / 2 {
            let m = |w: &[f32], d: bool| {
                let f = |j: usize| if d { w[j] / a[j] } else { w[j] * a[j] };
                f(i).abs().max(f(i + hd / 2).abs())
            };
            assert!((m(&q_w, true) - m(&k_w, false)).abs() < 1e-5, "pair {i}");
        }
        assert_eq!(key_balance(&q_w, &k_w[..4]), None, "lengths differ");
    }
}
