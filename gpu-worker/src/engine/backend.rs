//! Which forward pass and K/V storage a scheduler runs: Hearth's CPU kernels over the host
//! [`KvStore`], or the device-generic candle pass over [`DeviceKv`] (CUDA, or candle's CPU device).
//! The scheduler's block tables, prefix cache, eviction and disk tier are the same for both; only
//! the arithmetic and where the K/V rows live differ.

use std::sync::Arc;

use super::scheduler::kv::BlockStore;
use super::{EngineConfig, EngineError};
use crate::generic::{DeviceKv, GenericModel};
use crate::kv::{BlockId, KvStore, Packing};
use crate::model::{GemmaConfig, Model, ModelError, SeqChunk};
use crate::sampling::LogitSummary;

/// Loaded weights, for either forward pass.
#[derive(Debug, Clone)]
pub enum Weights {
    /// Hearth's CPU kernels.
    Native(Arc<Model>),
    /// The device-generic candle forward pass.
    Generic(Arc<GenericModel>),
}

impl From<Arc<Model>> for Weights {
    fn from(m: Arc<Model>) -> Self {
        Self::Native(m)
    }
}

impl From<Arc<GenericModel>> for Weights {
    fn from(m: Arc<GenericModel>) -> Self {
        Self::Generic(m)
    }
}

impl Weights {
    pub fn config(&self) -> &GemmaConfig {
        match self {
            Self::Native(m) => &m.config,
            Self::Generic(m) => &m.config,
        }
    }

    /// BOS, EOS and `<end_of_turn>` ids.
    pub fn special(&self) -> (Option<u32>, Option<u32>, Option<u32>) {
        match self {
            Self::Native(m) => (m.bos_id, m.eos_id, m.end_of_turn_id),
            Self::Generic(m) => (m.bos_id, m.eos_id, m.end_of_turn_id),
        }
    }

    /// `--forward`'s name for the pass these weights run on.
    pub fn forward_pass(&self) -> &'static str {
        match self {
            Self::Native(_) => "kernels",
            Self::Generic(_) => "candle",
        }
    }

    /// Device operations the generic pass has issued so far (`None` for the CPU kernels).
    pub fn device_ops(&self) -> Option<crate::generic::OpCount> {
        match self {
            Self::Native(_) => None,
            Self::Generic(m) => Some(m.device_ops().count()),
        }
    }

    /// Bytes of weights held (on the device for the generic pass).
    pub fn weights_bytes(&self) -> usize {
        match self {
            Self::Native(m) => m.weights_bytes(),
            Self::Generic(m) => m.weights_bytes(),
        }
    }

    /// Bytes of one KV block under `config`.
    pub fn block_bytes(&self, config: &EngineConfig) -> Result<usize, EngineError> {
        let c = self.config();
        match self {
            Self::Native(_) => Ok(KvStore::block_bytes(
                c.num_layers,
                config.block_size,
                c.kv_dim(),
                c.head_dim,
                config.kv_dtype,
            )),
            Self::Generic(_) => {
                DeviceKv::block_bytes(c.num_layers, config.block_size, c.kv_dim(), config.kv_dtype)
                    .map_err(|e| EngineError::Internal(e.to_string()))
            }
        }
    }
}

/// A forward pass with its K/V storage.
#[derive(Debug)]
pub(super) enum Backend {
    Native {
        model: Arc<Model>,
        kv: KvStore,
    },
    Generic {
        model: Arc<GenericModel>,
        kv: DeviceKv,
    },
}

impl Backend {
    /// Storage for `num_blocks` blocks. Packing old positions down to their global layers is a
    /// host-store layout; the device store keeps every layer.
    pub(super) fn new(
        weights: &Weights,
        num_blocks: usize,
        config: &EngineConfig,
        packing: Option<Packing>,
    ) -> Result<Self, EngineError> {
        let c = weights.config();
        Ok(match weights {
            Weights::Native(model) => Self::Native {
                kv: KvStore::new(
                    c.num_layers,
                    num_blocks,
                    config.block_size,
                    c.kv_dim(),
                    c.head_dim,
                    config.kv_dtype,
                )
                .with_packing(packing)
                .with_key_balance(model.key_balance()),
                model: model.clone(),
            },
            Weights::Generic(model) => {
                let kv = DeviceKv::new(
                    model.device(),
                    c.num_layers,
                    num_blocks,
                    config.block_size,
                    c.kv_dim(),
                    config.kv_dtype,
                )
                .map_err(|e| EngineError::Internal(format!("K/V memory on the device: {e}")))?;
                // Fixed-shape decode steps where the model asks for them, captured on a GPU.
                let kv = if model.step_graphs() {
                    let most = config.prefill_chunk + config.max_batch * (1 + config.spec_tokens);
                    kv.with_step_graphs(model.device().is_cuda(), most)
                } else {
                    kv
                };
                Self::Generic {
                    kv,
                    model: model.clone(),
                }
            }
        })
    }

    /// One step's logits, and their rows' summaries (both passes make them: the CPU kernels
    /// while the output projection's results are in cache, the device pass on the device).
    pub(super) fn forward(
        &mut self,
        chunks: &[SeqChunk<'_>],
        logits: &mut Vec<f32>,
        summaries: &mut Vec<LogitSummary>,
    ) -> Result<(), ModelError> {
        match self {
            Self::Native { model, kv } => model.forward(chunks, kv, logits, summaries),
            Self::Generic { model, kv } => model.forward(chunks, kv, logits, summaries),
        }
    }

    /// The host store, for tests that read what the scheduler stored.
    #[cfg(test)]
    pub(super) fn host_store(&self) -> Option<&KvStore> {
        match self {
            Self::Native { kv, .. } => Some(kv),
            Self::Generic { .. } => None,
        }
    }

    pub(super) fn packing(&self) -> Option<&Packing> {
        match self {
            Self::Native { kv, .. } => kv.packing(),
            Self::Generic { .. } => None,
        }
    }

    pub(super) fn saved_bytes(&self, n: usize) -> usize {
        match self {
            Self::Native { kv, .. } => kv.saved_bytes(n),
            Self::Generic { kv, .. } => kv.saved_bytes(n),
        }
    }
}

/// Block contents move in the backend's storage: the host store, or the device's.
impl BlockStore for Backend {
    /// Packs blocks `src` into `dst` (host store only: [`Backend::packing`] is `None` otherwise).
    fn pack(&mut self, src: &[BlockId], dst: BlockId) {
        if let Self::Native { kv, .. } = self {
            kv.pack(src, dst);
        }
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId, n: usize) -> Result<(), ModelError> {
        match self {
            Self::Native { kv, .. } => {
                kv.copy_block(src, dst, n);
                Ok(())
            }
            Self::Generic { kv, .. } => kv.copy_block(src, dst, n),
        }
    }

    fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) -> Result<(), ModelError> {
        match self {
            Self::Native { kv, .. } => {
                kv.save_block(b, n, out);
                Ok(())
            }
            Self::Generic { kv, .. } => kv.save_block(b, n, out),
        }
    }

    fn load_block(&mut self, b: BlockId, n: usize, src: &[u8]) -> Result<(), ModelError> {
        match self {
            Self::Native { kv, .. } => {
                kv.load_block(b, n, src);
                Ok(())
            }
            Self::Generic { kv, .. } => kv.load_block(b, n, src),
        }
    }
}
