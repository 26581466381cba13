//! Gemma architecture hyper-parameters, read from GGUF metadata or a HuggingFace `config.json`.

use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;

use super::ModelError;

/// Everything the forward pass needs to know about the architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaConfig {
    /// `gemma`, `gemma2` or `gemma3`.
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_size: usize,
    pub rms_eps: f32,
    pub context_length: usize,
    /// Rope base of full-attention layers.
    pub rope_base_global: f32,
    /// Rope base of sliding-window layers (Gemma 3 uses a smaller one).
    pub rope_base_local: f32,
    /// Linear rope scaling of global layers (positions divided by this).
    pub rope_scale_global: f32,
    /// Tokens a sliding-window layer attends to (itself included); `None` for full attention only.
    pub sliding_window: Option<usize>,
    /// Every `sliding_window_pattern`-th layer is global, the others slide (Gemma 3: 6, Gemma 2: 2).
    pub sliding_window_pattern: usize,
    /// Attention scores are scaled by `1 / sqrt(query_pre_attn_scalar)`.
    pub query_pre_attn_scalar: f32,
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
}

impl GemmaConfig {
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && !(layer + 1).is_multiple_of(self.sliding_window_pattern.max(1))
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of f32 K and V per token across all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.kv_dim() * self.num_layers * std::mem::size_of::<f32>()
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::BadConfig(what));
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "head_count {} must be a positive multiple of head_count_kv {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} must be even", self.head_dim));
        }
        if self.hidden_size == 0
            || self.num_layers == 0
            || self.vocab_size == 0
            || self.context_length == 0
        {
            return bad(
                "embedding_length, block_count, vocabulary and context_length must be positive"
                    .into(),
            );
        }
        Ok(())
    }

    /// From GGUF metadata; fails naming the first missing key.
    pub fn from_gguf(content: &Content) -> Result<Self, ModelError> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or(ModelError::MissingMetadata("general.architecture".into()))?;
        if !matches!(arch.as_str(), "gemma" | "gemma2" | "gemma3") {
            return Err(ModelError::Unsupported(format!(
                "architecture `{arch}` (expected gemma, gemma2 or gemma3)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let get_u = |k: &str| -> Result<usize, ModelError> {
            md.get(&key(k))
                .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::MissingMetadata(key(k)))
        };
        let get_f = |k: &str| md.get(&key(k)).and_then(|v| v.to_f32().ok());
        let hidden_size = get_u("embedding_length")?;
        let num_heads = get_u("attention.head_count")?;
        let head_dim = get_u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match (
            content.tensor_infos.get("token_embd.weight"),
            md.get("tokenizer.ggml.tokens"),
        ) {
            (Some(t), _) => t.shape.dims()[0],
            (None, Some(Value::Array(tokens))) => tokens.len(),
            _ => return Err(ModelError::MissingTensor("token_embd.weight".into())),
        };
        let (sliding_window, pattern) = match arch.as_str() {
            "gemma3" => (
                get_u("attention.sliding_window").ok(),
                get_u("attention.sliding_window_pattern").unwrap_or(6),
            ),
            "gemma2" => (get_u("attention.sliding_window").ok(), 2),
            _ => (None, 1),
        };
        let rope_scale = match md
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
        {
            Some(t) if t == "linear" => get_f("rope.scaling.factor").unwrap_or(1.0),
            _ => 1.0,
        };
        let cfg = Self {
            vocab_size,
            hidden_size,
            num_layers: get_u("block_count")?,
            num_heads,
            num_kv_heads: get_u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            ffn_size: get_u("feed_forward_length")?,
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            context_length: get_u("context_length")?,
            rope_base_global: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_base_local: if arch == "gemma3" {
                10_000.0
            } else {
                get_f("rope.freq_base").unwrap_or(10_000.0)
            },
            rope_scale_global: rope_scale,
            sliding_window,
            sliding_window_pattern: pattern,
            query_pre_attn_scalar: get_f("attention.query_pre_attn_scalar")
                .unwrap_or(head_dim as f32),
            attn_logit_softcap: get_f("attn_logit_softcapping").filter(|v| *v > 0.0),
            final_logit_softcap: get_f("final_logit_softcapping").filter(|v| *v > 0.0),
            architecture: arch,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// From a HuggingFace `config.json` (Gemma 3 text, Gemma 2 or Gemma).
    pub fn from_hf_json(json: &serde_json::Value) -> Result<Self, ModelError> {
        // Multimodal Gemma 3 checkpoints nest the language model's settings.
        let c = json.get("text_config").unwrap_or(json);
        let model_type = c
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("gemma3_text");
        let arch = match model_type {
            "gemma3_text" | "gemma3" => "gemma3",
            "gemma2" => "gemma2",
            "gemma" => "gemma",
            other => return Err(ModelError::Unsupported(format!("model_type `{other}`"))),
        };
        let u = |k: &str| -> Result<usize, ModelError> {
            c.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::MissingMetadata(format!("config.json: {k}")))
        };
        let f = |k: &str| c.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        let num_heads = u("num_attention_heads")?;
        let hidden_size = u("hidden_size")?;
        let head_dim = u("head_dim").unwrap_or(hidden_size / num_heads.max(1));
        let rope_scale = c
            .get("rope_scaling")
            .and_then(|r| r.get("factor"))
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .unwrap_or(1.0);
        let cfg = Self {
            architecture: arch.into(),
            vocab_size: u("vocab_size")?,
            hidden_size,
            num_layers: u("num_hidden_layers")?,
            num_heads,
            num_kv_heads: u("num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            ffn_size: u("intermediate_size")?,
            rms_eps: f("rms_norm_eps").unwrap_or(1e-6),
            context_length: u("max_position_embeddings")?,
            rope_base_global: f("rope_theta").unwrap_or(10_000.0),
            rope_base_local: f("rope_local_base_freq").unwrap_or(10_000.0),
            rope_scale_global: rope_scale,
            sliding_window: if arch == "gemma" {
                None
            } else {
                u("sliding_window").ok()
            },
            sliding_window_pattern: match arch {
                "gemma3" => u("sliding_window_pattern").unwrap_or(6),
                "gemma2" => 2,
                _ => 1,
            },
            query_pre_attn_scalar: f("query_pre_attn_scalar").unwrap_or(head_dim as f32),
            attn_logit_softcap: f("attn_logit_softcapping").filter(|v| *v > 0.0),
            final_logit_softcap: f("final_logit_softcapping").filter(|v| *v > 0.0),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Token ids the engine treats specially, from GGUF metadata.
pub fn special_tokens(md: &HashMap<String, Value>) -> (Option<u32>, Option<u32>, Option<u32>) {
    let id = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
    let end_of_turn = match md.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens
            .iter()
            .position(|t| matches!(t, Value::String(s) if s == "<end_of_turn>"))
            .map(|p| p as u32),
        _ => None,
    };
    (
        id("tokenizer.ggml.bos_token_id"),
        id("tokenizer.ggml.eos_token_id"),
        end_of_turn,
    )
}
