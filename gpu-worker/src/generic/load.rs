//! Loading a Gemma GGUF file onto a candle device for the device-generic pass: matrices in their
//! stored formats (Q/K/V and gate/up concatenated where they share one), norm vectors as f32,
//! and per layer the small tensors the fused ops read (norm pairs, QK-norms and frequencies).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::{DeviceOps, Fused, GenericModel, Layer, Linear, LoadOptions};
use crate::model::{special_tokens, GemmaConfig, ModelError};

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
            QMatMul::from_qtensor(f.tensor("output.weight")?)?
        } else {
            QMatMul::from_arc(embedding.clone())?
        };
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let post_norms = f.has("blk.0.post_attention_norm.weight");
        let qk_norm = f.has("blk.0.attn_q_norm.weight");
        let inv_freq = [
            crate::model::ops::rope_inv_freq(hd, c.rope_base_global, c.rope_scale_global),
            crate::model::ops::rope_inv_freq(hd, c.rope_base_local, 1.0),
        ];
        let n = |i: usize, s: &str| format!("blk.{i}.{s}.weight");
        let first_norm = f.vector(&n(0, "attn_norm"))?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let post = |f: &mut GgufReader, s: &str| -> Result<Vec<f32>, ModelError> {
                if post_norms {
                    f.values(&n(i, s))
                } else {
                    Ok(vec![0.0; h])
                }
            };
            let next = if i + 1 < c.num_layers {
                n(i + 1, "attn_norm")
            } else {
                "output_norm.weight".into()
            };
            let attn_norms = [
                post(&mut f, "post_attention_norm")?,
                f.values(&n(i, "ffn_norm"))?,
            ];
            let ffn_norms = [post(&mut f, "post_ffw_norm")?, f.values(&next)?];
            let (qn, kn) = if qk_norm {
                (
                    f.values(&n(i, "attn_q_norm"))?,
                    f.values(&n(i, "attn_k_norm"))?,
                )
            } else {
                (vec![1.0; hd], vec![1.0; hd])
            };
            let aux = [qn, kn, inv_freq[usize::from(c.is_sliding(i))].clone()].concat();
            layers.push(Layer {
                qkv: f.fused(&[n(i, "attn_q"), n(i, "attn_k"), n(i, "attn_v")])?,
                o: f.linear(&n(i, "attn_output"))?,
                gate_up: f.fused(&[n(i, "ffn_gate"), n(i, "ffn_up")])?,
                down: f.linear(&n(i, "ffn_down"))?,
                attn_norms: f.upload(attn_norms.concat(), &[2, h])?,
                ffn_norms: f.upload(ffn_norms.concat(), &[2, h])?,
                aux: f.upload(aux, &[2 * hd + hd / 2])?,
            });
        }
        Ok(Self {
            bos_id,
            eos_id,
            end_of_turn_id,
            device: device.clone(),
            embedding,
            first_norm,
            layers,
            output,
            post_norms,
            qk_norm,
            weights_bytes: f.bytes,
            dense_gemm_tokens: options.dense_gemm_tokens,
            step_graphs: options.step_graphs,
            ops: DeviceOps::default(),
            config,
        })
    }
}

/// Reads a GGUF file's tensors onto a device, counting the bytes they take there.
struct GgufReader {
    content: Content,
    reader: BufReader<File>,
    path: String,
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
            path: path.display().to_string(),
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

    /// A matrix's stored bytes, its format and its dimensions, without loading it.
    fn raw(&mut self, name: &str) -> Result<(Vec<u8>, GgmlDType, Vec<usize>), ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        let dims = info.shape.dims().to_vec();
        let dtype = info.ggml_dtype;
        let len = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
        let at = self.content.tensor_data_offset + info.offset;
        let mut bytes = vec![0u8; len];
        let io = |e: std::io::Error| ModelError::Io {
            path: self.path.clone(),
            reason: format!("reading {name}: {e}"),
        };
        self.reader.seek(SeekFrom::Start(at)).map_err(io)?;
        self.reader.read_exact(&mut bytes).map_err(io)?;
        Ok((bytes, dtype, dims))
    }

    /// A product: its stored blocks, and a dequantized f16 copy when asked for.
    fn product(&mut self, t: QTensor) -> Result<Linear, ModelError> {
        self.bytes += t.storage_size_in_bytes();
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

    fn linear(&mut self, name: &str) -> Result<Linear, ModelError> {
        let (bytes, dtype, dims) = self.raw(name)?;
        let t = qtensor_from_ggml(dtype, &bytes, dims, &self.device)?;
        self.product(t)
    }

    /// Matrices over the same input, in order: each run of neighbours in one format is stacked
    /// into one matrix (rows are whole blocks, so the stored bytes simply follow each other).
    /// Where 32-value formats without minimums (Q4_0, Q5_0, Q8_0) meet, all become Q8_0, which
    /// holds each of their values exactly: one product instead of several.
    fn fused(&mut self, names: &[String]) -> Result<Fused, ModelError> {
        let mut mats = Vec::with_capacity(names.len());
        for name in names {
            let (bytes, dtype, dims) = self.raw(name)?;
            match dims.as_slice() {
                [r, c] => mats.push((dtype, bytes, *r, *c)),
                _ => {
                    return Err(ModelError::Shape(format!(
                        "{name}: {dims:?} is not a matrix"
                    )))
                }
            }
        }
        if mats.iter().any(|m| m.0 != mats[0].0)
            && mats.iter().all(|m| upcast_q8_0(m.0, &[]).is_some())
        {
            for m in &mut mats {
                if let Some(b) = upcast_q8_0(m.0, &m.1) {
                    *m = (GgmlDType::Q8_0, b, m.2, m.3);
                }
            }
        }
        let mut runs: Vec<(GgmlDType, Vec<u8>, usize, usize)> = Vec::new();
        for (dtype, bytes, rows, cols) in mats {
            match runs.last_mut() {
                Some((t, b, r, c)) if *t == dtype && *c == cols => {
                    b.extend_from_slice(&bytes);
                    *r += rows;
                }
                _ => runs.push((dtype, bytes, rows, cols)),
            }
        }
        let parts = runs
            .into_iter()
            .map(|(dtype, bytes, rows, cols)| {
                let t = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &self.device)?;
                self.product(t)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Fused(parts))
    }

    /// A norm's weights, as f32 values on the host.
    fn values(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        if !self.has(name) {
            return Err(ModelError::MissingTensor(name.into()));
        }
        let t = self.content.tensor(&mut self.reader, name, &Device::Cpu)?;
        Ok(t.dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// f32 values as a tensor of `shape` on the device, counted.
    fn upload(&mut self, v: Vec<f32>, shape: &[usize]) -> Result<Tensor, ModelError> {
        self.bytes += v.len() * 4;
        Ok(Tensor::from_vec(v, shape, &self.device)?)
    }

    /// A norm's weights, as an f32 tensor on the device.
    fn vector(&mut self, name: &str) -> Result<Tensor, ModelError> {
        let v = self.values(name)?;
        let n = v.len();
        self.upload(v, &[n])
    }
}

/// `bytes` of `dtype` blocks rewritten as Q8_0 blocks holding the same values exactly, for the
/// formats where that is possible (32 values scaled by one f16, no minimum): Q4_0 (`d · (q - 8)`),
/// Q5_0 (`d · (q - 16)`) and Q8_0 itself; `None` for others.
fn upcast_q8_0(dtype: GgmlDType, bytes: &[u8]) -> Option<Vec<u8>> {
    let (size, offset) = match dtype {
        GgmlDType::Q8_0 => return Some(bytes.to_vec()),
        GgmlDType::Q4_0 => (18, 8),
        GgmlDType::Q5_0 => (22, 16),
        _ => return None,
    };
    let mut out = Vec::with_capacity(bytes.len() / size * 34);
    for b in bytes.chunks_exact(size) {
        out.extend_from_slice(&b[..2]);
        let (high, qs) = match dtype {
            GgmlDType::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
            _ => (0, &b[2..18]),
        };
        // Elements 0..16 are the low nibbles, 16..32 the high ones; Q5_0's fifth bits are in
        // `high`, bit j for element j.
        for j in 0..32 {
            let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
            let q = nibble as i32 | (((high >> j) & 1) as i32) << 4;
            out.push((q - offset) as i8 as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_and_q5_0_become_q8_0_with_the_same_values() {
        let x: Vec<f32> = crate::fixtures::noise(64 * 32, 5, 1.0);
        let x = Tensor::from_vec(x, (64, 32), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q5_0, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&x, dtype).unwrap();
            let want = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let up = upcast_q8_0(dtype, &q.data().unwrap()).unwrap();
            let got = qtensor_from_ggml(GgmlDType::Q8_0, &up, vec![64, 32], &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(got, want, "{dtype:?}");
        }
        assert!(upcast_q8_0(GgmlDType::Q4K, &[]).is_none());
    }
}
