//! The model a request is for ([`Target`]), and what a request that leaves a sampling field
//! out gets for it from that model ([`ModelDefaults`]).

use hearth_shared::SamplingParams;

use super::tokenizers::ModelTokenizer;
use super::ChatError;
use crate::workers::{ModelKey, ServedModel, UnknownModel};

/// The model a request is for, resolved against what the workers serve (see
/// [`crate::workers::WorkerPool::resolve`]).
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// None while no worker has reported its model: any worker serves the request.
    pub model: Option<ServedModel>,
    /// The model's own tokenizer, once found; none: the orchestrator's default one.
    pub tokenizer: Option<ModelTokenizer>,
}

impl Target {
    /// The exact version every worker of the request must serve.
    pub fn key(&self) -> Option<&ModelKey> {
        self.model.as_ref().map(|m| &m.key)
    }

    /// The model's name as replies report it: its id (`id@version` is what pins it).
    pub fn name(&self) -> String {
        self.model
            .as_ref()
            .map_or_else(|| "hearth".to_string(), |m| m.key.id.clone())
    }

    /// The model's context in tokens, once a worker serving it has reported it.
    pub fn context_length(&self) -> Option<usize> {
        self.model.as_ref().and_then(|m| m.context_length)
    }

    /// Its manifest's default sampling parameters.
    pub fn defaults(&self) -> ModelDefaults {
        self.model
            .as_ref()
            .map(|m| ModelDefaults::from_json(&m.default_params_json))
            .unwrap_or_default()
    }
}

impl From<UnknownModel> for ChatError {
    fn from(u: UnknownModel) -> Self {
        let served = u
            .served
            .iter()
            .map(|m| format!("`{m}`"))
            .collect::<Vec<_>>()
            .join(", ");
        ChatError::ModelNotFound {
            asked: u.asked,
            served,
        }
    }
}

/// What a request that leaves a sampling field out gets for it: the served model's defaults
/// (its manifest's `params`), else the built-in ones.
#[derive(Debug, Clone, Default)]
pub struct ModelDefaults {
    /// The manifest's fields, as it gives them.
    fields: serde_json::Map<String, serde_json::Value>,
    params: SamplingParams,
    /// The manifest's temperature, when it sets one.
    temperature: Option<f32>,
}

impl ModelDefaults {
    /// From a worker's `default_params_json` (empty, or not a valid object: the built-in
    /// defaults; the worker checked it already).
    pub fn from_json(json: &str) -> Self {
        let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(json) else {
            return Self::default();
        };
        let temperature = fields
            .get("temperature")
            .and_then(serde_json::Value::as_f64)
            .map(|t| t as f32);
        match serde_json::from_value(serde_json::Value::Object(fields.clone())) {
            Ok(params) => Self {
                fields,
                params,
                temperature,
            },
            Err(_) => Self::default(),
        }
    }

    /// A native turn's parameters in a session whose stored `params` (the fields its client
    /// gave) lie over these defaults, field by field.
    pub fn with_session(&self, stored: Option<&serde_json::Value>) -> SamplingParams {
        let Some(serde_json::Value::Object(session)) = stored else {
            return self.params.clone();
        };
        let mut fields = self.fields.clone();
        fields.extend(session.iter().map(|(k, v)| (k.clone(), v.clone())));
        serde_json::from_value(serde_json::Value::Object(fields)).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "a session's stored params do not parse; built-in defaults used");
            SamplingParams::default()
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The temperature of an OpenAI request that sets none: the model's, else OpenAI's 1.
    pub fn openai_temperature(&self) -> f32 {
        self.temperature.unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::ModelDefaults;

    #[test]
    fn a_session_s_fields_lie_over_the_model_s_defaults() {
        let d = ModelDefaults::from_json(r#"{"temperature": 0.5, "top_k": 5}"#);
        let p = d.with_session(Some(&serde_json::json!({"top_k": 9})));
        assert_eq!((p.temperature, p.top_k), (0.5, 9));
        let p = d.with_session(None);
        assert_eq!((p.temperature, p.top_k), (0.5, 5));
        assert_eq!(d.openai_temperature(), 0.5);
        let none = ModelDefaults::from_json("");
        assert_eq!(
            none.with_session(None),
            hearth_shared::SamplingParams::default()
        );
        assert_eq!(none.openai_temperature(), 1.0);
    }
}
