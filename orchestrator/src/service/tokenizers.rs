//! Each model's tokenizer. The orchestrator starts with one (`--tokenizer`), which serves every
//! model that has none of its own. A repository version that holds its own `tokenizer.json`
//! (Gemma 2's vocabulary beside Gemma 3's, say) is reported by its workers with the file's
//! SHA-256; the first request for it fetches the file from a worker that holds the model
//! (`GetTokenizer`), checks the digest, and keeps the tokenizer by it, so a file is fetched and
//! parsed once however many models and versions share it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_shared::tokenizer::{sha256_hex, Tokenizer, TokenizerError};

use super::ChatError;
use crate::workers::{ServedModel, WorkerPool};

/// Distinct tokenizers kept besides the default (each parsed one takes tens of MB); the map
/// starts over when full.
const MAX_KEPT: usize = 8;

/// How long fetching and parsing a model's tokenizer may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(120);

/// A model's tokenizer, named by its file's SHA-256.
#[derive(Debug, Clone)]
pub struct ModelTokenizer {
    pub sha256: Arc<str>,
    pub tok: Arc<Tokenizer>,
}

#[derive(Debug)]
pub struct Tokenizers {
    default: ModelTokenizer,
    kept: Mutex<HashMap<Arc<str>, Arc<Tokenizer>>>,
    /// One fetch at a time, so requests for a new model wait for one fetch of its tokenizer.
    fetching: tokio::sync::Mutex<()>,
}

impl Tokenizers {
    /// `default` is the `--tokenizer` file's tokenizer, `sha256` that file's digest.
    pub fn new(default: Tokenizer, sha256: String) -> Self {
        Self {
            default: ModelTokenizer {
                sha256: sha256.into(),
                tok: Arc::new(default),
            },
            kept: Mutex::default(),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    /// With the tokenizer file at `path` as the default.
    pub fn from_file(path: &std::path::Path) -> Result<Self, TokenizerError> {
        let (tok, bytes) = Tokenizer::from_file_with_bytes(path)?;
        Ok(Self::new(tok, sha256_hex(&bytes)))
    }

    pub fn default_tokenizer(&self) -> &ModelTokenizer {
        &self.default
    }

    /// Whether `t` is the default tokenizer (operators' shared prompts are rendered with it).
    pub fn is_default(&self, t: &ModelTokenizer) -> bool {
        t.sha256 == self.default.sha256
    }

    fn kept(&self, sha256: &str) -> Option<ModelTokenizer> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.get_key_value(sha256).map(|(k, t)| ModelTokenizer {
            sha256: k.clone(),
            tok: t.clone(),
        })
    }

    /// `model`'s tokenizer: the default one, unless its workers report one of its own, which
    /// is fetched from one of them the first time.
    pub async fn for_model(
        &self,
        pool: &WorkerPool,
        model: &ServedModel,
    ) -> Result<ModelTokenizer, ChatError> {
        let sha = model.tokenizer_sha256.as_str();
        if sha.is_empty() || *sha == *self.default.sha256 {
            return Ok(self.default.clone());
        }
        if let Some(t) = self.kept(sha) {
            return Ok(t);
        }
        let _one = self.fetching.lock().await;
        if let Some(t) = self.kept(sha) {
            return Ok(t);
        }
        let fetched = tokio::time::timeout(FETCH_TIMEOUT, fetch(pool, model)).await;
        let tok = fetched.map_err(|_| {
            ChatError::Unavailable(format!(
                "fetching the tokenizer of {} took longer than {}s",
                model.key,
                FETCH_TIMEOUT.as_secs()
            ))
        })??;
        tracing::info!(model = %model.key, sha256 = sha, vocab = tok.vocab_size(), "a model's own tokenizer fetched from its worker");
        let t = ModelTokenizer {
            sha256: sha.into(),
            tok: Arc::new(tok),
        };
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= MAX_KEPT {
            kept.clear();
        }
        kept.insert(t.sha256.clone(), t.tok.clone());
        Ok(t)
    }
}

/// Fetches `model`'s tokenizer file and parses it (on the blocking pool: a large vocabulary
/// takes a second).
async fn fetch(pool: &WorkerPool, model: &ServedModel) -> Result<Tokenizer, ChatError> {
    let bytes = pool
        .fetch_tokenizer(&model.key, &model.tokenizer_sha256)
        .await
        .map_err(|e| ChatError::Unavailable(e.to_string()))?;
    let origin = format!("the tokenizer of {}", model.key);
    tokio::task::spawn_blocking(move || Tokenizer::from_bytes(&bytes, &origin))
        .await
        .map_err(|e| ChatError::Internal(format!("parsing a tokenizer failed: {e}")))?
        .map_err(|e| ChatError::Unavailable(e.to_string()))
}
