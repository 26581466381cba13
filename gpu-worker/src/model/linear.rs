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

    /// `out = input · Wᵀ`, `out` resized to `input.rows × rows`. Every value is overwritten, so a
    /// reused `out` is not cleared first (for the output projection that is 1 MiB a row).
    pub fn forward(&self, input: &Input<'_>, out: &mut Vec<f32>) -> Result<(), ModelError> {
        let (rows, cols) = self.shape();
        if input.cols != cols {
            return Err(ModelError::Shape(format!(
                "linear expects width {cols}, got {}",
                input.cols
            )));
        }
        out.resize(input.rows * rows, 0.0);
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

/// Linear layers that read the same input (Q/K/V, gate/up). When all are 8-bit they are stacked
/// into one matrix at load, so a step makes one parallel product instead of several.
#[derive(Debug)]
pub struct LinearGroup {
    fused: Option<Linear>,
    parts: Vec<Linear>,
    shapes: Vec<(usize, usize)>,
}

impl LinearGroup {
    pub fn new(parts: Vec<Linear>) -> Self {
        let shapes = parts.iter().map(Linear::shape).collect();
        let q8: Vec<&Q8Matrix> = parts
            .iter()
            .filter_map(|p| {
                if let Linear::Q8(m) = p {
                    Some(&**m)
                } else {
                    None
                }
            })
            .collect();
        if q8.len() == parts.len() {
            if let Some(m) = Q8Matrix::concat_rows(&q8) {
                return Self {
                    fused: Some(Linear::Q8(Arc::new(m))),
                    parts: Vec::new(),
                    shapes,
                };
            }
        }
        Self {
            fused: None,
            parts,
            shapes,
        }
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
        let Some(fused) = &self.fused else {
            for (p, o) in self.parts.iter().zip(outs.iter_mut()) {
                p.forward(input, o)?;
            }
            return Ok(());
        };
        fused.forward(input, scratch)?;
        let total: usize = self.shapes.iter().map(|s| s.0).sum();
        let mut at = 0;
        for (&(width, _), o) in self.shapes.iter().zip(outs.iter_mut()) {
            o.clear();
            for row in scratch.chunks_exact(total) {
                o.extend_from_slice(&row[at..at + width]);
            }
            at += width;
        }
        Ok(())
    }

    /// The group's layers (one when fused), for packing at load.
    pub fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        self.fused.iter_mut().chain(self.parts.iter_mut())
    }

    pub fn size_in_bytes(&self) -> usize {
        self.fused
            .iter()
            .chain(&self.parts)
            .map(Linear::size_in_bytes)
            .sum()
    }
}
