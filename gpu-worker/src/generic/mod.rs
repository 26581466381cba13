//! The device-generic Gemma forward pass: the same architecture as [`crate::model`], written on
//! candle tensors so one piece of code runs on `Device::Cuda(n)` and on candle's CPU device.
//!
//! A GPU runs a decode step far faster than the host can issue small kernels, so the pass is
//! built to issue few: about 14 device operations per layer and 260 per token for Gemma 3 270M,
//! the same whatever the batch (a plain candle pass issues about 99 per layer, and attention's
//! grow with the batch). Per layer:
//!
//! - the Q/K/V projections are one product (their weights concatenated at load when they share a
//!   format), as are gate and up; each product is candle's quantized kernel (two launches on
//!   CUDA: the activations' 8-bit quantization and the product);
//! - [`ops::QPrep`] and [`ops::KvWrite`] take the fused QKV rows: QK-norm and RoPE of the query
//!   heads, and of the key heads on their way into their paged K/V slots with the value heads;
//! - [`ops::PagedAttention`] attends every query row of the step, each over its own sequence's
//!   positions read through its block table, in one launch;
//! - [`ops::ResidualNorm`] is a block's post-norm, the residual add and the next pre-norm;
//!   [`ops::GeluMul`] is GELU of the gate times up.
//!
//! A step's token ids, positions and block tables travel in one u32 tensor uploaded once. Rows
//! that sample get the output projection, and [`ops::Summarize`] makes their argmax, maximum and
//! log-sum-exp on the device. [`DeviceOps`] counts what a step issues (kernel launches and
//! copies), by the same rules for CPU and CUDA runs, so the count is tested without a GPU.
//!
//! Weights come from the GGUF file as they are stored: block-quantized matrices stay quantized
//! ([`QMatMul`]), norm vectors become f32 tensors, and the token embedding is one quantized table
//! shared with the tied output projection. With [`LoadOptions::dense_gemm_tokens`], the layers'
//! products also get a dequantized f16 copy, and steps of at least that many tokens multiply
//! through it (cuBLAS on CUDA).
//!
//! The CPU engine keeps its own kernels ([`crate::model`]): they are several times faster on the
//! CPU. This path exists for accelerators, and is tested on candle's CPU device against them.

#[cfg(feature = "cuda")]
mod cuda;
mod graphs;
mod kv;
mod load;
pub mod ops;
mod step;

pub use kv::DeviceKv;
pub use step::{DeviceOps, OpCount};

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::model::{GemmaConfig, ModelError};

/// How [`GenericModel::load_gguf`] lays the weights out on the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Steps of at least this many tokens multiply the layers' matrices through dequantized f16
    /// copies (kept beside the stored blocks) instead of the quantized kernels; `None`: never.
    pub dense_gemm_tokens: Option<usize>,
    /// Run greedy decode steps in fixed shapes: replayed from CUDA graphs on a GPU, padded and
    /// eager on the CPU (for tests).
    pub step_graphs: bool,
}

/// One product of a layer: its stored blocks, and under [`LoadOptions::dense_gemm_tokens`] a
/// dequantized f16 copy.
#[derive(Debug)]
struct Linear {
    blocks: QMatMul,
    /// [`QMatMul::TensorF16`]: activations go to f16 for the product and back.
    dense: Option<QMatMul>,
}

impl Linear {
    /// The matrix used for a step: the f16 copy when `dense` and there is one.
    fn pick(&self, dense: bool) -> &QMatMul {
        match &self.dense {
            Some(copy) if dense => copy,
            _ => &self.blocks,
        }
    }

    /// Values each row of `x` must have (the matrix's columns).
    fn cols(&self) -> usize {
        match &self.blocks {
            QMatMul::QTensor(t) => t.shape().dims().last().copied().unwrap_or(0),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dims().last().copied().unwrap_or(0),
        }
    }

    /// `x · wᵀ` for `x` of `[tokens, in]`, counting what it issues.
    fn forward(&self, x: &Tensor, dense: bool, ops: &DeviceOps) -> Result<Tensor, ModelError> {
        let m = self.pick(dense);
        ops.kernels(step::matmul_launches(m));
        Ok(m.forward(x)?)
    }
}

/// Projections of one input (Q, K and V; or gate and up) whose outputs form one row: a single
/// product when their weights could be concatenated, else one per format and a concatenation.
#[derive(Debug)]
struct Fused(Vec<Linear>);

impl Fused {
    fn forward(&self, x: &Tensor, dense: bool, ops: &DeviceOps) -> Result<Tensor, ModelError> {
        if let [one] = self.0.as_slice() {
            return one.forward(x, dense, ops);
        }
        let parts = self
            .0
            .iter()
            .map(|l| l.forward(x, dense, ops))
            .collect::<Result<Vec<_>, _>>()?;
        ops.kernels(1);
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// Products a step runs for it.
    fn products(&self) -> usize {
        self.0.len()
    }
}

/// One layer's weights on the device (GGUF tensors `blk.N.<name>`).
#[derive(Debug)]
struct Layer {
    /// `attn_q`, `attn_k`, `attn_v`: one `[tokens, (heads + 2 kv heads) · head_dim]` row.
    qkv: Fused,
    /// `attn_output`
    o: Linear,
    /// `ffn_gate`, `ffn_up`: one `[tokens, 2 ffn]` row.
    gate_up: Fused,
    /// `ffn_down`
    down: Linear,
    /// `[2, hidden]`: `post_attention_norm` (zeros where the model has none) and `ffn_norm`.
    attn_norms: Tensor,
    /// `[2, hidden]`: `post_ffw_norm` (or zeros) and the next layer's `attn_norm`, or
    /// `output_norm` after the last layer.
    ffn_norms: Tensor,
    /// `attn_q_norm` and `attn_k_norm` (`head_dim` each; ones where the model has none) and the
    /// layer kind's RoPE inverse frequencies (`head_dim / 2`).
    aux: Tensor,
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
    /// The first layer's `attn_norm` (the others' ride in the previous layer's `ffn_norms`).
    first_norm: Tensor,
    layers: Vec<Layer>,
    /// `output.weight`, or the embedding when the file ties them.
    output: QMatMul,
    /// Whether blocks' outputs are normalized before the residual add (Gemma 2 and 3).
    post_norms: bool,
    /// Whether query and key heads are normalized (Gemma 3).
    qk_norm: bool,
    weights_bytes: usize,
    /// [`LoadOptions::dense_gemm_tokens`]
    dense_gemm_tokens: Option<usize>,
    /// [`LoadOptions::step_graphs`]
    step_graphs: bool,
    /// What steps have issued to the device so far.
    ops: DeviceOps,
}

impl GenericModel {
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of weights held on the device.
    pub fn weights_bytes(&self) -> usize {
        self.weights_bytes
    }

    /// Whether the engine's K/V store should run greedy decode steps in fixed shapes
    /// ([`DeviceKv::with_step_graphs`]).
    pub fn step_graphs(&self) -> bool {
        self.step_graphs
    }

    /// The layer product with the most columns (its scratch needs are the largest).
    fn widest_product(&self) -> Option<&Linear> {
        self.layers
            .iter()
            .flat_map(|l| l.qkv.0.iter().chain(&l.gate_up.0).chain([&l.o, &l.down]))
            .max_by_key(|l| l.cols())
    }

    /// Device operations issued by the steps run so far.
    pub fn device_ops(&self) -> &DeviceOps {
        &self.ops
    }

    /// Products (quantized matrix multiplications) of one layer's step: 4 where Q/K/V and
    /// gate/up each fused into one, more where their formats differ.
    pub fn products_per_layer(&self, layer: usize) -> usize {
        let l = &self.layers[layer];
        l.qkv.products() + l.gate_up.products() + 2
    }
}
