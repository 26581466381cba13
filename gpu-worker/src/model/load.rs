//! Loading weights from GGUF (quantized, the primary format) and from safetensors checkpoints.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

use super::config::{special_tokens, GemmaConfig};
use super::{Embedding, Layer, Linear, LinearGroup, Model, ModelError};
use crate::kernels::{self, pack_into_arena, Q8Matrix, QK};

fn io_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// A GGUF file mapped into memory: its tensors are read where they lie in the page cache, with
/// no staging copy, and each one's pages leave the process's resident set once it is converted.
struct Gguf<'a> {
    path: &'a Path,
    map: memmap2::Mmap,
    content: Content,
}

impl<'a> Gguf<'a> {
    fn open(path: &'a Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| io_err(path, e))?;
        // SAFETY: the map is read-only and private, and lives as long as the slices read from
        // it. A model file is written once (the repository's versions, the fetch's atomic
        // rename) and never changed in place while a worker loads it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(path, e))?;
        // Read ahead: the tensors are read front to back, each layer's on its own thread.
        let _ = map.advise(memmap2::Advice::Sequential);
        let content = Content::read(&mut std::io::Cursor::new(&map[..]))
            .map_err(|e| io_err(path, format!("not a GGUF file: {e}")))?;
        Ok(Self { path, map, content })
    }

    /// Drops `data`'s pages (a range of the map) from the process's resident set once it is
    /// converted; they stay in the page cache, and a read would fault them back in.
    fn release(&self, data: &[u8]) {
        let offset = data.as_ptr() as usize - self.map.as_ptr() as usize;
        // SAFETY: the map is private and read-only: dropping its pages loses nothing, and any
        // later read of the range (a neighbour sharing a page) reads the file again.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, data.len())
        };
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor's type, shape and bytes, in place in the map.
    fn raw(&self, name: &str) -> Result<(GgmlDType, usize, usize, &[u8]), ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        let dims = info.shape.dims();
        let (rows, cols) = match dims {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => {
                return Err(ModelError::Shape(format!(
                    "{name}: unexpected rank {}",
                    dims.len()
                )))
            }
        };
        let bytes = rows * cols / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let start = (self.content.tensor_data_offset + info.offset) as usize;
        let data = start
            .checked_add(bytes)
            .and_then(|end| self.map.get(start..end))
            .ok_or_else(|| {
                io_err(
                    self.path,
                    format!(
                        "tensor {name}: its {bytes} bytes lie past the file's end (truncated?)"
                    ),
                )
            })?;
        Ok((info.ggml_dtype, rows, cols, data))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (dtype, _, _, data) = self.raw(name)?;
        let qt = candle_core::quantized::QTensor::new(
            // A copy: candle reads its blocks as typed (aligned) values.
            candle_core::quantized::QStorage::from_data(
                std::borrow::Cow::Owned(data.to_vec()),
                &Device::Cpu,
                dtype,
            )?,
            (self.content.tensor_infos[name].shape.elem_count(),),
        )?;
        Ok(qt.dequantize(&Device::Cpu)?.to_vec1()?)
    }

    fn opt_vector(&self, name: &str) -> Result<Option<Vec<f32>>, ModelError> {
        if self.has(name) {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn q8(&self, name: &str) -> Result<Option<Q8Matrix>, ModelError> {
        let (dtype, rows, cols, data) = self.raw(name)?;
        let converted = self.q8_of(name, dtype, rows, cols, data);
        if matches!(converted, Ok(Some(_))) {
            self.release(data);
        }
        converted
    }

    /// [`Self::q8`] of a tensor's bytes.
    fn q8_of(
        &self,
        name: &str,
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Option<Q8Matrix>, ModelError> {
        // Q8_0 and Q5_0 go from the file's bytes straight into the kernel's layout; Q5_0's values
        // fit in 5 bits, and where the panel kernels run they are read so, as the file holds
        // them (before any stacking, so a Q8_0 neighbour does not widen them).
        if let Some(m) = kernels::blocks_for_this_cpu(dtype, rows, cols, data) {
            return m
                .map(Some)
                .map_err(|e| ModelError::Shape(format!("{name}: {e}")));
        }
        match dtype {
            GgmlDType::Q4K | GgmlDType::Q6K => {
                match kernels::k_quant_for_this_cpu(dtype, rows, cols, data) {
                    Some(m) => m.map(Some).map_err(|e| {
                        ModelError::Shape(format!(
                            "{name}: {dtype:?} data for a {rows}x{cols} matrix: {e}"
                        ))
                    }),
                    None => Ok(None),
                }
            }
            _ => Ok(None),
        }
    }

    fn linear(&self, name: &str) -> Result<Linear, ModelError> {
        if let Some(m) = self.q8(name)? {
            return Ok(Linear::Q8(Arc::new(m)));
        }
        let (dtype, rows, cols, data) = self.raw(name)?;
        let qt = QTensor::new(
            QStorage::from_data(Cow::Owned(data.to_vec()), &Device::Cpu, dtype)?,
            (rows, cols),
        )?;
        self.release(data);
        let dense = matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if !dense && cols % QK == 0 {
            // Other block formats (Q4_K and Q6_K where no kernel takes them as they are, Q2_K,
            // Q3_K, Q5_K, ...) are re-quantized to 8-bit blocks so every matrix runs through a
            // batch-reusing kernel. The extra rounding is at most 1/254 of a
            // block's largest weight, far below the 4- and 6-bit formats' own quantization step.
            let w = qt
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let m = kernels::for_this_cpu(Q8Matrix::quantize(rows, cols, &w));
            return Ok(Linear::Q8(Arc::new(m)));
        }
        Ok(Linear::Candle {
            mm: QMatMul::from_qtensor(qt)?,
            rows,
            cols,
        })
    }
}

/// Loads a Gemma GGUF file. The embedding stays in its 8-bit form (tied to the output projection
/// when the file has no `output.weight`).
pub fn load_gguf(path: &Path) -> Result<Model, ModelError> {
    let g = Gguf::open(path)?;
    let config = GemmaConfig::from_gguf(&g.content)?;
    let special = special_tokens(&g.content.metadata);

    let (embedding, tied) = match g.q8("token_embd.weight")? {
        Some(m) => {
            let m = Arc::new(m);
            (Embedding::Q8(m.clone()), Some(Linear::Q8(m)))
        }
        None => {
            let (dtype, rows, cols, _) = g.raw("token_embd.weight")?;
            if !matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
                return Err(ModelError::Unsupported(format!(
                    "token_embd.weight in {dtype:?} (supported: Q8_0, Q5_0, F32, F16, BF16)"
                )));
            }
            let data = g.vector("token_embd.weight")?;
            let t = Tensor::from_vec(data.clone(), (rows, cols), &Device::Cpu)?;
            (
                Embedding::Dense { rows, cols, data },
                Some(Linear::Dense(t)),
            )
        }
    };
    let output = if g.has("output.weight") {
        g.linear("output.weight")?
    } else {
        tied.ok_or_else(|| ModelError::MissingTensor("output.weight".into()))?
    };

    // Layers convert in parallel: widening Q5_0 and re-quantizing k-quants is most of the load.
    let mut layers = (0..config.num_layers)
        .into_par_iter()
        .map(|i| {
            let n = |s: &str| format!("blk.{i}.{s}");
            Ok(Layer {
                attn_norm: g.vector(&n("attn_norm.weight"))?,
                qkv: LinearGroup::new(vec![
                    g.linear(&n("attn_q.weight"))?,
                    g.linear(&n("attn_k.weight"))?,
                    g.linear(&n("attn_v.weight"))?,
                ]),
                o: g.linear(&n("attn_output.weight"))?,
                q_norm: g.opt_vector(&n("attn_q_norm.weight"))?,
                k_norm: g.opt_vector(&n("attn_k_norm.weight"))?,
                post_attn_norm: g.opt_vector(&n("post_attention_norm.weight"))?,
                ffn_norm: g.vector(&n("ffn_norm.weight"))?,
                gate_up: LinearGroup::new(vec![
                    g.linear(&n("ffn_gate.weight"))?,
                    g.linear(&n("ffn_up.weight"))?,
                ]),
                down: g.linear(&n("ffn_down.weight"))?,
                post_ffn_norm: g.opt_vector(&n("post_ffw_norm.weight"))?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let output_norm = g.vector("output_norm.weight")?;
    // Every layer's 8-bit values in one huge-page-backed arena (the embedding already is one).
    let mut matrices: Vec<&mut Q8Matrix> = Vec::new();
    for l in &mut layers {
        let linears = l
            .qkv
            .linears_mut()
            .chain(l.gate_up.linears_mut())
            .chain([&mut l.o, &mut l.down]);
        matrices.extend(linears.filter_map(|lin| match lin {
            Linear::Q8(m) => Arc::get_mut(m),
            _ => None,
        }));
    }
    pack_into_arena(&mut matrices);
    let model = Model::assemble(config, embedding, layers, output_norm, output, special);
    check_shapes(&model)?;
    Ok(model)
}

/// Loads a HuggingFace Gemma checkpoint directory (`config.json` and `*.safetensors`) as dense
/// f32 weights. Norm weights are stored as `w` with the model using `1 + w`; that is folded here.
pub fn load_safetensors(dir: &Path) -> Result<Model, ModelError> {
    let cfg_path = dir.join("config.json");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).map_err(|e| io_err(&cfg_path, e))?)
            .map_err(|e| io_err(&cfg_path, e))?;
    let config = GemmaConfig::from_hf_json(&json)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| io_err(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(io_err(dir, "no .safetensors files"));
    }
    for f in files {
        for (name, t) in
            candle_core::safetensors::load(&f, &Device::Cpu).map_err(|e| io_err(&f, e))?
        {
            // Multimodal checkpoints prefix the text model.
            let name = name
                .strip_prefix("language_model.")
                .unwrap_or(&name)
                .to_string();
            tensors.insert(name, t.to_dtype(DType::F32)?);
        }
    }
    let get = |name: &str| {
        tensors
            .get(name)
            .cloned()
            .ok_or_else(|| ModelError::MissingTensor(name.into()))
    };
    let norm = |name: &str| -> Result<Vec<f32>, ModelError> {
        Ok(get(name)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|w| 1.0 + w)
            .collect())
    };
    let opt_norm = |name: &str| {
        if tensors.contains_key(name) {
            norm(name).map(Some)
        } else {
            Ok(None)
        }
    };
    let dense = |name: &str| get(name).map(Linear::Dense);

    let gemma1 = config.architecture == "gemma";
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let (post_attn, ffn_norm) = if gemma1 {
            (None, norm(&n("post_attention_layernorm.weight"))?)
        } else {
            (
                opt_norm(&n("post_attention_layernorm.weight"))?,
                norm(&n("pre_feedforward_layernorm.weight"))?,
            )
        };
        layers.push(Layer {
            attn_norm: norm(&n("input_layernorm.weight"))?,
            qkv: LinearGroup::new(vec![
                dense(&n("self_attn.q_proj.weight"))?,
                dense(&n("self_attn.k_proj.weight"))?,
                dense(&n("self_attn.v_proj.weight"))?,
            ]),
            o: dense(&n("self_attn.o_proj.weight"))?,
            q_norm: opt_norm(&n("self_attn.q_norm.weight"))?,
            k_norm: opt_norm(&n("self_attn.k_norm.weight"))?,
            post_attn_norm: post_attn,
            ffn_norm,
            gate_up: LinearGroup::new(vec![
                dense(&n("mlp.gate_proj.weight"))?,
                dense(&n("mlp.up_proj.weight"))?,
            ]),
            down: dense(&n("mlp.down_proj.weight"))?,
            post_ffn_norm: opt_norm(&n("post_feedforward_layernorm.weight"))?,
        });
    }
    let emb = get("model.embed_tokens.weight")?;
    let (rows, cols) = emb.dims2()?;
    let output = match tensors.get("lm_head.weight") {
        Some(t) => Linear::Dense(t.clone()),
        None => Linear::Dense(emb.clone()),
    };
    let embedding = Embedding::Dense {
        rows,
        cols,
        data: emb.flatten_all()?.to_vec1()?,
    };
    let special = (
        json.get("bos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32),
        json.get("eos_token_id")
            .and_then(|v| v.as_u64().or_else(|| v.get(0).and_then(|x| x.as_u64())))
            .map(|v| v as u32),
        None,
    );
    let model = Model::assemble(
        config,
        embedding,
        layers,
        norm("model.norm.weight")?,
        output,
        special,
    );
    check_shapes(&model)?;
    Ok(model)
}

/// Every matrix must agree with the configuration, so a malformed file fails at load, not mid-step.
fn check_shapes(m: &Model) -> Result<(), ModelError> {
    let c = &m.config;
    let (h, qd, kd, f) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.kv_dim(),
        c.ffn_size,
    );
    let expect = |what: String, got: (usize, usize), want: (usize, usize)| {
        if got == want {
            Ok(())
        } else {
            Err(ModelError::Shape(format!(
                "{what}: expected {want:?}, found {got:?}"
            )))
        }
    };
    for (i, l) in m.layers.iter().enumerate() {
        let qkv = l.qkv.shapes();
        let gu = l.gate_up.shapes();
        expect(format!("layer {i} q"), qkv[0], (qd, h))?;
        expect(format!("layer {i} k"), qkv[1], (kd, h))?;
        expect(format!("layer {i} v"), qkv[2], (kd, h))?;
        expect(format!("layer {i} o"), l.o.shape(), (h, qd))?;
        expect(format!("layer {i} gate"), gu[0], (f, h))?;
        expect(format!("layer {i} up"), gu[1], (f, h))?;
        expect(format!("layer {i} down"), l.down.shape(), (h, f))?;
        for (name, v, len) in [
            ("attn_norm", Some(&l.attn_norm), h),
            ("ffn_norm", Some(&l.ffn_norm), h),
            ("q_norm", l.q_norm.as_ref(), c.head_dim),
            ("k_norm", l.k_norm.as_ref(), c.head_dim),
        ] {
            if let Some(v) = v {
                if v.len() != len {
                    return Err(ModelError::Shape(format!(
                        "layer {i} {name}: expected {len} values, found {}",
                        v.len()
                    )));
                }
            }
        }
    }
    expect("output".into(), m.output.shape(), (c.vocab_size, h))?;
    if m.output_norm.len() != h {
        return Err(ModelError::Shape(format!(
            "output_norm: expected {h} values, found {}",
            m.output_norm.len()
        )));
    }
    Ok(())
}
