//! Paged K/V memory on the forward pass's device: one `[2, slots, kv_dim]` tensor per layer
//! (keys, then values), where slot `b · block_size + i` holds position `i` of block `b`. The block
//! tables, reference counts and prefix cache are the engine's [`crate::kv::BlockAllocator`], the
//! same as for the CPU store; only the storage differs. A step writes its new rows into their
//! slots with one [`super::ops::KvWrite`] per layer, and attention reads them by slot
//! ([`super::ops::PagedAttention`]).

use candle_core::{DType, Device, Tensor};

use super::graphs::StepGraphs;
use crate::kv::{BlockId, KvDtype};
use crate::model::ModelError;

#[derive(Debug)]
pub struct DeviceKv {
    layers: Vec<Tensor>,
    block_size: usize,
    kv_dim: usize,
    dtype: DType,
    /// Greedy decode steps in fixed shapes (captured in CUDA graphs on a GPU), which write into
    /// these tensors; `None`: every step runs eagerly.
    pub(super) graphs: Option<StepGraphs>,
}

impl DeviceKv {
    /// The tensor element type for `dtype`: the device-generic path stores f32 or f16 (int8 K/V
    /// is a CPU-kernel format).
    pub fn element(dtype: KvDtype) -> Result<DType, ModelError> {
        match dtype {
            KvDtype::F32 => Ok(DType::F32),
            KvDtype::F16 => Ok(DType::F16),
            KvDtype::Int8 => Err(ModelError::Unsupported(
                "--kv-dtype int8 is a CPU-kernel format; the device forward pass stores f16 or f32"
                    .into(),
            )),
        }
    }

    /// Bytes of one block (every layer's keys and values).
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<usize, ModelError> {
        Ok(2 * num_layers * block_size * kv_dim * Self::element(dtype)?.size_in_bytes())
    }

    /// Zeroed storage for `num_blocks` blocks of `block_size` positions on `device`, and one
    /// more, the scratch block ([`DeviceKv::scratch_block`]).
    pub fn new(
        device: &Device,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        let dtype = Self::element(dtype)?;
        let slots = (num_blocks + 1) * block_size;
        Ok(Self {
            layers: (0..num_layers)
                .map(|_| Tensor::zeros((2, slots, kv_dim), dtype, device))
                .collect::<Result<_, _>>()?,
            block_size,
            kv_dim,
            dtype,
            graphs: None,
        })
    }

    /// Runs greedy decode steps in fixed shapes, captured in CUDA graphs where `capture` (and the
    /// device is a GPU); on the CPU the shapes run eagerly, padded the same way. No step of the
    /// engine holds more than `max_step_tokens` tokens.
    pub fn with_step_graphs(mut self, capture: bool, max_step_tokens: usize) -> Self {
        self.graphs = Some(StepGraphs::new(capture, max_step_tokens));
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// A block past the budget's, which no sequence owns: padding rows of a fixed-shape step
    /// write their keys and values there.
    pub fn scratch_block(&self) -> BlockId {
        (self.layers[0].dim(1).unwrap_or(self.block_size) / self.block_size - 1) as BlockId
    }

    /// Layer `li`'s keys and values, `[2, slots, kv_dim]`.
    pub fn layer(&self, li: usize) -> &Tensor {
        &self.layers[li]
    }

    /// The slot of position `pos` in a sequence with block table `blocks`.
    pub fn slot(&self, blocks: &[BlockId], pos: usize) -> u32 {
        blocks[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }

    /// Keys and values (`[n, kv_dim]`, f32) of `layer` at `slots` (`[n]`, u32).
    pub fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let read = |half: usize| -> Result<Tensor, ModelError> {
            Ok(self.layers[layer]
                .get(half)?
                .index_select(slots, 0)?
                .to_dtype(DType::F32)?)
        };
        Ok((read(0)?, read(1)?))
    }

    fn rows(&self, b: BlockId, n: usize) -> (usize, usize) {
        (b as usize * self.block_size, n.min(self.block_size))
    }

    /// Copies the first `n` positions of block `src` into block `dst`, every layer.
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId, n: usize) -> Result<(), ModelError> {
        let ((from, n), (to, _)) = (self.rows(src, n), self.rows(dst, n));
        if n == 0 {
            return Ok(());
        }
        for (cache, half) in self.halves() {
            let half = cache.get(half)?;
            half.slice_set(&half.narrow(0, from, n)?.copy()?, 0, to)?;
        }
        Ok(())
    }

    /// Bytes [`DeviceKv::save_block`] writes for `n` positions.
    pub fn saved_bytes(&self, n: usize) -> usize {
        2 * self.layers.len() * n * self.kv_dim * self.dtype.size_in_bytes()
    }

    /// The caches' halves in saved order: every layer's keys, then every layer's values.
    fn halves(&self) -> impl Iterator<Item = (&Tensor, usize)> {
        (0..2).flat_map(move |half| self.layers.iter().map(move |c| (c, half)))
    }

    /// Appends the stored bytes of block `b`'s first `n` positions, every layer, to `out`.
    pub fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) -> Result<(), ModelError> {
        let (at, n) = self.rows(b, n);
        for (cache, half) in self.halves() {
            let rows = cache.get(half)?.narrow(0, at, n)?.flatten_all()?;
            match self.dtype {
                DType::F16 => {
                    for x in rows.to_vec1::<half::f16>()? {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
                _ => {
                    for x in rows.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        Ok(())
    }

    /// Restores block `b`'s first `n` positions from bytes written by [`DeviceKv::save_block`].
    pub fn load_block(&mut self, b: BlockId, n: usize, src: &[u8]) -> Result<(), ModelError> {
        let (at, n) = self.rows(b, n);
        let (per, width) = (n * self.kv_dim, self.dtype.size_in_bytes());
        if src.len() < self.saved_bytes(n) {
            return Err(ModelError::Shape(format!(
                "a saved KV block of {n} positions needs {} bytes, found {}",
                self.saved_bytes(n),
                src.len()
            )));
        }
        let device = self.layers[0].device().clone();
        for (i, (cache, half)) in self.halves().enumerate() {
            let bytes = &src[i * per * width..(i + 1) * per * width];
            let rows = match self.dtype {
                DType::F16 => Tensor::from_vec(
                    bytes
                        .chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                        .collect::<Vec<_>>(),
                    (n, self.kv_dim),
                    &device,
                )?,
                _ => Tensor::from_vec(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect::<Vec<_>>(),
                    (n, self.kv_dim),
                    &device,
                )?
                .to_dtype(self.dtype)?,
            };
            cache.get(half)?.slice_set(&rows, 0, at)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generic::ops::{Heads, KvWrite, StepMeta};

    #[test]
    fn rows_written_by_slot_read_back_copy_save_and_load() {
        // One head of 4 values, no QK-norm, zero frequencies (RoPE leaves keys as they are).
        let heads = Heads {
            nh: 1,
            nkv: 1,
            hd: 4,
            eps: 1e-6,
            qk_norm: false,
        };
        let aux = Tensor::new(&[1f32, 1., 1., 1., 1., 1., 1., 1., 0., 0.], &Device::Cpu).unwrap();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = DeviceKv::new(&Device::Cpu, 2, 4, 2, 4, dtype).unwrap();
            // Block table [3, 1]: positions 0, 1 in block 3, positions 2, 3 in block 1.
            let table = [3u32, 1];
            let slots: Vec<u32> = (0..4).map(|p| kv.slot(&table, p)).collect();
            assert_eq!(slots, [6, 7, 2, 3]);
            // Rows of q | k | v for positions 0..4: k = 10 t + i, v = 100 + 10 t + i.
            let mut qkv = Vec::new();
            for t in 0..4 {
                for part in [0f32, 0., 100.] {
                    qkv.extend((0..4).map(|i| part + (10 * t + i) as f32));
                }
            }
            let qkv = Tensor::from_vec(qkv, (4, 12), &Device::Cpu).unwrap();
            let mut meta = vec![0u32; 4];
            meta.extend(0..4u32);
            meta.extend([0u32; 4]);
            meta.extend(table);
            let meta = Tensor::from_vec(meta, 14, &Device::Cpu).unwrap();
            let step = StepMeta {
                n: 4,
                max_blocks: 2,
                block_size: 2,
            };
            kv.layer(1)
                .inplace_op3(
                    &qkv,
                    &meta,
                    &KvWrite {
                        heads,
                        meta: step,
                        aux: aux.clone(),
                    },
                )
                .unwrap();
            let s = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
            let rows = |base: f32| -> Vec<Vec<f32>> {
                (0..4)
                    .map(|t| (0..4).map(|i| base + (10 * t + i) as f32).collect())
                    .collect()
            };
            let (k, v) = kv.gather(1, &s).unwrap();
            assert_eq!(k.to_vec2::<f32>().unwrap(), rows(0.0));
            assert_eq!(v.to_vec2::<f32>().unwrap(), rows(100.0));
            // Layer 0 was not written.
            let (k0, _) = kv.gather(0, &s).unwrap();
            assert!(k0
                .to_vec2::<f32>()
                .unwrap()
                .iter()
                .flatten()
                .all(|&x| x == 0.0));

            // Copy-on-write of block 1's first position into block 0.
            kv.copy_block(1, 0, 1).unwrap();
            let zero = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
            let (k, v) = kv.gather(1, &zero).unwrap();
            assert_eq!(
                k.to_vec2::<f32>().unwrap(),
                [[20.0, 21.0, 22.0, 23.0], [0.0; 4]]
            );
            assert_eq!(v.to_vec2::<f32>().unwrap()[0], [120.0, 121.0, 122.0, 123.0]);

            // Save block 3 (both positions) and restore it into block 2.
            let mut saved = Vec::new();
            kv.save_block(3, 2, &mut saved).unwrap();
            assert_eq!(saved.len(), kv.saved_bytes(2));
            kv.load_block(2, 2, &saved).unwrap();
            let two = Tensor::new(&[4u32, 5], &Device::Cpu).unwrap();
            let (k, v) = kv.gather(1, &two).unwrap();
            assert_eq!(k.to_vec2::<f32>().unwrap(), rows(0.0)[..2]);
            assert_eq!(v.to_vec2::<f32>().unwrap(), rows(100.0)[..2]);
            let err = kv.load_block(2, 2, &saved[..5]).unwrap_err().to_string();
            assert!(err.contains("needs"), "{err}");
        }
        let err = DeviceKv::new(&Device::Cpu, 1, 1, 1, 1, KvDtype::Int8).unwrap_err();
        assert!(err.to_string().contains("int8"), "{err}");
    }
}
