//! Paged K/V memory on the forward pass's device: one `[slots, kv_dim]` tensor of keys and one of
//! values per layer, where slot `b · block_size + i` holds position `i` of block `b`. The block
//! tables, reference counts and prefix cache are the engine's [`crate::kv::BlockAllocator`], the
//! same as for the CPU store; only the storage differs. Writes scatter a step's new rows into
//! their slots in one operation per layer; attention gathers a sequence's rows by slot.

use candle_core::{DType, Device, Tensor};

use crate::kv::{BlockId, KvDtype};
use crate::model::ModelError;

#[derive(Debug)]
pub struct DeviceKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_size: usize,
    kv_dim: usize,
    dtype: DType,
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

    /// Zeroed storage for `num_blocks` blocks of `block_size` positions on `device`.
    pub fn new(
        device: &Device,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        let dtype = Self::element(dtype)?;
        let slots = num_blocks * block_size;
        let zeros = || Tensor::zeros((slots, kv_dim), dtype, device);
        Ok(Self {
            k: (0..num_layers).map(|_| zeros()).collect::<Result<_, _>>()?,
            v: (0..num_layers).map(|_| zeros()).collect::<Result<_, _>>()?,
            block_size,
            kv_dim,
            dtype,
        })
    }

    /// The slot of position `pos` in a sequence with block table `blocks`.
    pub fn slot(&self, blocks: &[BlockId], pos: usize) -> u32 {
        blocks[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }

    /// Writes rows of keys and values (`[n, kv_dim]`, f32) into `slots` (`[n]`, u32) of `layer`.
    pub fn write(
        &self,
        layer: usize,
        slots: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), ModelError> {
        let idx = slots
            .unsqueeze(1)?
            .broadcast_as((slots.dim(0)?, self.kv_dim))?
            .contiguous()?;
        for (cache, rows) in [(&self.k[layer], k), (&self.v[layer], v)] {
            cache.scatter_set(&idx, &rows.to_dtype(self.dtype)?.contiguous()?, 0)?;
        }
        Ok(())
    }

    /// Keys and values (`[n, kv_dim]`, f32) of `layer` at `slots` (`[n]`, u32).
    pub fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let read = |cache: &Tensor| cache.index_select(slots, 0)?.to_dtype(DType::F32);
        Ok((read(&self.k[layer])?, read(&self.v[layer])?))
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
        for cache in self.k.iter().chain(&self.v) {
            cache.slice_set(&cache.narrow(0, from, n)?.copy()?, 0, to)?;
        }
        Ok(())
    }

    /// Bytes [`DeviceKv::save_block`] writes for `n` positions.
    pub fn saved_bytes(&self, n: usize) -> usize {
        2 * self.k.len() * n * self.kv_dim * self.dtype.size_in_bytes()
    }

    /// Appends the stored bytes of block `b`'s first `n` positions, every layer, to `out`.
    pub fn save_block(&self, b: BlockId, n: usize, out: &mut Vec<u8>) -> Result<(), ModelError> {
        let (at, n) = self.rows(b, n);
        for cache in self.k.iter().chain(&self.v) {
            let rows = cache.narrow(0, at, n)?.flatten_all()?;
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
        let device = self.k[0].device().clone();
        for (i, cache) in self.k.iter().chain(&self.v).enumerate() {
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
            cache.slice_set(&rows, 0, at)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, d: usize, base: f32) -> Tensor {
        let v: Vec<f32> = (0..n * d).map(|i| base + i as f32).collect();
        Tensor::from_vec(v, (n, d), &Device::Cpu).unwrap()
    }

    #[test]
    fn rows_written_by_slot_read_back_copy_save_and_load() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = DeviceKv::new(&Device::Cpu, 2, 4, 2, 3, dtype).unwrap();
            // Block table [3, 1]: positions 0, 1 in block 3, positions 2, 3 in block 1.
            let table = [3, 1];
            let slots: Vec<u32> = (0..4).map(|p| kv.slot(&table, p)).collect();
            assert_eq!(slots, [6, 7, 2, 3]);
            let s = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
            kv.write(1, &s, &rows(4, 3, 0.0), &rows(4, 3, 100.0))
                .unwrap();
            let (k, v) = kv.gather(1, &s).unwrap();
            assert_eq!(
                k.to_vec2::<f32>().unwrap(),
                rows(4, 3, 0.0).to_vec2::<f32>().unwrap()
            );
            assert_eq!(
                v.to_vec2::<f32>().unwrap(),
                rows(4, 3, 100.0).to_vec2::<f32>().unwrap()
            );
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
            let (k, _) = kv.gather(1, &zero).unwrap();
            assert_eq!(
                k.to_vec2::<f32>().unwrap(),
                [[6.0, 7.0, 8.0], [0.0, 0.0, 0.0]]
            );

            // Save block 3 (both positions) and restore it into block 2.
            let mut saved = Vec::new();
            kv.save_block(3, 2, &mut saved).unwrap();
            assert_eq!(saved.len(), kv.saved_bytes(2));
            kv.load_block(2, 2, &saved).unwrap();
            let two = Tensor::new(&[4u32, 5], &Device::Cpu).unwrap();
            let (k, v) = kv.gather(1, &two).unwrap();
            assert_eq!(
                k.to_vec2::<f32>().unwrap(),
                rows(2, 3, 0.0).to_vec2::<f32>().unwrap()
            );
            assert_eq!(
                v.to_vec2::<f32>().unwrap(),
                rows(2, 3, 100.0).to_vec2::<f32>().unwrap()
            );
            let err = kv.load_block(2, 2, &saved[..5]).unwrap_err().to_string();
            assert!(err.contains("needs"), "{err}");
        }
        let err = DeviceKv::new(&Device::Cpu, 1, 1, 1, 1, KvDtype::Int8).unwrap_err();
        assert!(err.to_string().contains("int8"), "{err}");
    }
}
