//! A linear layer over whichever weight format the checkpoint has: our batch-reusing 8-bit kernel
//! for every block-quantized GGUF matrix whose width is a multiple of 32 (all of Gemma's), candle's
//! quantized matmul for any other, or dense f32 for safetensors checkpoints.

use std::cell::OnceCell;
use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};

use super::ModelError;
use crate::kernels::{self, ActQ8, Q8Matrix};

/// Activation rows fed to several linear layers; the 8-bit copy is made once, on first use.
#[derive(Debug)]
pub struct Input<'a> {
    pub x: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    quantized: OnceCell<ActQ8>,
}

impl<'a> Input<'a> {
    pub fn new(x: &'a [f32], rows: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), rows * cols);
        Self {
            x,
            rows,
            cols,
            quantized: OnceCell::new(),
        }
    }

    fn q8(&self) -> &ActQ8 {
        self.quantized
            .get_or_init(|| kernels::quantize_activations(self.x, self.rows, self.cols))
    }
}

pub enum Linear {
    /// 8-bit blocks: Q8_0 and Q5_0 as stored, other block formats re-quantized at load.
    Q8(Arc<Q8Matrix>),
    /// Block-quantized matrices our kernel cannot take (width not a multiple of 32), via candle.
    Candle {
        mm: QMatMul,
        rows: usize,
        cols: usize,
    },
    /// Dense f32 weights `[rows, cols]`.
    Dense(Tensor),
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rows, cols) = self.shape();
        let kind = match self {
            Self::Q8(_) => "q8",
            Self::Candle { .. } => "candle-quantized",
            Self::Dense(_) => "dense-f32",
        };
        write!(f, "Linear({kind}, {rows}x{cols})")
    }
}

impl Linear {
    /// `(output features, input features)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Q8(m) => (m.rows, m.cols),
            Self::Candle { rows, cols, .. } => (*rows, *cols),
            Self::Dense(t) => t.dims2().unwrap_or((0, 0)),
        }
    }

    /// `out` resized for `input`, once its width is checked.
    fn output_for(&self, input: &Input<'_>, out: &mut Vec<f32>) -> Result<(), ModelError> {
        let (rows, cols) = self.shape();
        if input.cols != cols {
            return Err(ModelError::Shape(format!(
                "linear expects width {cols}, got {}",
                input.cols
            )));
        }
        out.resize(input.rows * rows, 0.0);
        Ok(())
    }

    /// [`Linear::forward`], handing the outputs to `then` as they are made: for 8-bit weights a
    /// task's columns (whole `piece`s) at a time, while they are still in cache (see
    /// [`kernels::matmul_q8_then`]); for other weights every row whole, once all are done.
    pub fn forward_then(
        &self,
        input: &Input<'_>,
        out: &mut Vec<f32>,
        piece: usize,
        then: kernels::Then<'_>,
    ) -> Result<(), ModelError> {
        if let Self::Q8(m) = self {
            self.output_for(input, out)?;
            kernels::matmul_q8_then(m, input.q8(), out, piece, then);
            return Ok(());
        }
        self.forward(input, out)?;
        let rows = self.shape().0;
        let mut each: Vec<&mut [f32]> = out.chunks_exact_mut(rows.max(1)).collect();
        then(0..rows, &mut each);
        Ok(())
    }

    /// `out = input · Wᵀ`, `out` resized to `input.rows × rows`. Every value is overwritten, so a
    /// reused `out` is not cleared first (for the output projection that is 1 MiB a row).
    pub fn forward(&self, input: &Input<'_>, out: &mut Vec<f32>) -> Result<(), ModelError> {
        let (rows, cols) = self.shape();
        self.output_for(input, out)?;
        match self {
            Self::Q8(m) => kernels::matmul_q8(m, input.q8(), out),
            Self::Candle { mm, .. } => {
                // candle takes a different kernel for one row than for several (for Q6_K), which
                // would make a sequence's output depend on the batch it is in. A single row is
                // padded to two so every call takes the same path.
                let x = if input.rows == 1 {
                    let mut padded = input.x.to_vec();
                    padded.extend_from_slice(input.x);
                    Tensor::from_vec(padded, (2, cols), &Device::Cpu)?
                } else {
                    Tensor::from_slice(input.x, (input.rows, cols), &Device::Cpu)?
                };
                let y = mm.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&y[..input.rows * rows]);
            }
            Self::Dense(w) => {
                let x = Tensor::from_slice(input.x, (input.rows, cols), &Device::Cpu)?;
                let y = x.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&y);
            }
        }
        Ok(())
    }

    pub fn size_in_bytes(&self) -> usize {
        let (rows, cols) = self.shape();
        match self {
            Self::Q8(m) => m.size_in_bytes(),
            Self::Candle { mm, .. } => match mm {
                QMatMul::QTensor(t) => t.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            },
            Self::Dense(_) => rows * cols * 4,
        }
    }
}

/// Linear layers that read the same input (Q/K/V, gate/up). Consecutive 8-bit members in the same
/// layout are stacked into one matrix at load, so a step makes one parallel product instead of
/// several; members in another layout (a Q8_0 value matrix beside five-bit query and key ones)
/// keep their own, so each is read in its own format.
#[derive(Debug)]
pub struct LinearGroup {
    /// The stacked runs, each with how many members it holds.
    runs: Vec<(Linear, usize)>,
    shapes: Vec<(usize, usize)>,
}

impl LinearGroup {
    pub fn new(parts: Vec<Linear>) -> Self {
        let shapes = parts.iter().map(Linear::shape).collect();
        let mut runs: Vec<(Vec<Linear>, usize)> = Vec::new();
        for part in parts {
            let joins = match (runs.last(), &part) {
                (Some((run, _)), Linear::Q8(m)) => {
                    matches!(&run[0], Linear::Q8(first) if first.layout == m.layout)
                }
                _ => false,
            };
            match runs.last_mut() {
                Some((run, n)) if joins => {
                    run.push(part);
                    *n += 1;
                }
                _ => runs.push((vec![part], 1)),
            }
        }
        let runs = runs
            .into_iter()
            .flat_map(|(mut run, n)| {
                if n == 1 {
                    return vec![(run.remove(0), 1)];
                }
                let q8: Vec<&Q8Matrix> = run
                    .iter()
                    .filter_map(|p| match p {
                        Linear::Q8(m) => Some(&**m),
                        _ => None,
                    })
                    .collect();
                match Q8Matrix::concat_rows(&q8) {
                    Some(m) => vec![(Linear::Q8(Arc::new(m)), n)],
                    None => run.into_iter().map(|p| (p, 1)).collect(),
                }
            })
            .collect();
        Self { runs, shapes }
    }

    /// `(output features, input features)` of each member.
    pub fn shapes(&self) -> &[(usize, usize)] {
        &self.shapes
    }

    /// Runs every member on `input`; `outs[i]` receives member `i`'s output (`rows × features`).
    pub fn forward(
        &self,
        input: &Input<'_>,
        scratch: &mut Vec<f32>,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), ModelError> {
        let (mut member, mut outs) = (0, outs.iter_mut());
        for (linear, n) in &self.runs {
            let shapes = &self.shapes[member..member + n];
            member += n;
            if *n == 1 {
                if let Some(o) = outs.next() {
                    linear.forward(input, o)?;
                }
                continue;
            }
            linear.forward(input, scratch)?;
            let total: usize = shapes.iter().map(|s| s.0).sum();
            let mut at = 0;
            for (&(width, _), o) in shapes.iter().zip(outs.by_ref()) {
                o.clear();
                for row in scratch.chunks_exact(total) {
                    o.extend_from_slice(&row[at..at + width]);
                }
                at += width;
            }
        }
        Ok(())
    }

    /// The group's layers (one per stacked run), for packing at load.
    pub fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        self.runs.iter_mut().map(|(linear, _)| linear)
    }

    pub fn size_in_bytes(&self) -> usize {
        self.runs.iter().map(|(l, _)| l.size_in_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    /// A `rows × cols` matrix from GGUF blocks of `dtype`, loaded as the model loader does.
    fn matrix(rows: usize, cols: usize, dtype: GgmlDType, seed: u64) -> Linear {
        let mut s = seed;
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let data = QTensor::quantize(&t, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec();
        let m = match dtype {
            GgmlDType::Q5_0 => Q8Matrix::from_q5_0(rows, cols, &data),
            _ => Q8Matrix::from_q8_0(rows, cols, &data),
        };
        let m = kernels::for_this_cpu(m.unwrap());
        Linear::Q8(Arc::new(kernels::to_five_bit(&m).unwrap_or(m)))
    }

    #[test]
    fn forward_then_hands_every_output_once_in_whole_pieces_while_giving_forwards_values() {
        use crate::sampling::{LogitSummary, Piece, PIECE};
        use std::sync::Mutex;
        // Outputs not a multiple of a piece; 1 row makes tasks of several pieces, 64 of one.
        let (features, cols) = (9 * PIECE + 48, 64);
        let w = matrix(features, cols, GgmlDType::Q8_0, 7);
        for n in [1, 3, 64] {
            let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.61).cos()).collect();
            let input = Input::new(&x, n, cols);
            let mut want = vec![];
            w.forward(&input, &mut want).unwrap();
            let seen = Mutex::new(vec![0u8; n * features]);
            let pieces = Mutex::new(Vec::new());
            let mut got = vec![];
            w.forward_then(&input, &mut got, PIECE, &|c, rows| {
                assert_eq!(c.start % PIECE, 0, "a task starts at a piece");
                assert_eq!(rows.len(), n);
                let mut seen = seen.lock().unwrap();
                for (r, row) in rows.iter().enumerate() {
                    let at = r * features + c.start;
                    assert_eq!(&**row, &want[at..at + c.len()], "row {r}, columns {c:?}");
                    seen[at..at + c.len()].iter_mut().for_each(|s| *s += 1);
                    pieces
                        .lock()
                        .unwrap()
                        .extend(Piece::all_of(c.start, row).map(|p| (r, p)));
                }
            })
            .unwrap();
            assert_eq!(got, want);
            assert!(
                seen.into_inner().unwrap().iter().all(|&s| s == 1),
                "{n} rows"
            );
            let summaries = LogitSummary::of_pieces(pieces.into_inner().unwrap(), &got, features);
            let whole: Vec<LogitSummary> =
                got.chunks_exact(features).map(LogitSummary::of).collect();
            assert_eq!(summaries, whole);
        }
    }

    #[test]
    fn a_group_stacks_runs_of_one_layout_and_gives_each_member_its_own_output() {
        // Query and key fit in 5 bits, value does not: where panels are used, q and k stack and v
        // stays apart; elsewhere all three stack. Either way each output is the member's own.
        let (cols, rows) = (64, [32, 16, 16]);
        let members = || {
            vec![
                matrix(rows[0], cols, GgmlDType::Q5_0, 1),
                matrix(rows[1], cols, GgmlDType::Q5_0, 2),
                matrix(rows[2], cols, GgmlDType::Q8_0, 3),
            ]
        };
        let group = LinearGroup::new(members());
        let layouts: Vec<_> = members()
            .iter()
            .map(|m| match m {
                Linear::Q8(m) => m.layout,
                _ => unreachable!("8-bit members"),
            })
            .collect();
        let runs: Vec<usize> = group.runs.iter().map(|(_, n)| *n).collect();
        if layouts[0] == layouts[2] {
            assert_eq!(runs, [3]);
        } else {
            assert_eq!(runs, [2, 1], "{layouts:?}");
        }
        let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let input = Input::new(&x, 3, cols);
        let (mut a, mut b, mut c, mut scratch) = (vec![], vec![], vec![], vec![]);
        group
            .forward(&input, &mut scratch, &mut [&mut a, &mut b, &mut c])
            .unwrap();
        for (member, got) in members().iter().zip([&a, &b, &c]) {
            let mut want = vec![];
            member.forward(&input, &mut want).unwrap();
            assert_eq!(got, &want);
        }
    }
}
