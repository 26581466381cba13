//! A thin wrapper over a HuggingFace `tokenizer.json` that knows Gemma's special tokens.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {reason} (run scripts/fetch-model.sh to fetch the default one)")]
    Load { path: String, reason: String },
    #[error("tokenizer has no token {0:?}")]
    MissingToken(&'static str),
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// Gemma's tokenizer with the ids of the tokens the engine must know.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Each token's text, decoded alone; made on first use (see [`Tokenizer::ids_containing`]).
    texts: std::sync::OnceLock<Vec<String>>,
    pub bos_id: u32,
    pub eos_id: u32,
    pub start_of_turn_id: u32,
    pub end_of_turn_id: u32,
    pub pad_id: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("start_of_turn_id", &self.start_of_turn_id)
            .field("end_of_turn_id", &self.end_of_turn_id)
            .finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        Self::from_file_with_bytes(path).map(|(tok, _)| tok)
    }

    /// [`Self::from_file`], and the file's bytes (to send it on, or name it by its digest).
    pub fn from_file_with_bytes(path: &Path) -> Result<(Self, Vec<u8>), TokenizerError> {
        let load_err = |reason: String| TokenizerError::Load {
            path: path.display().to_string(),
            reason,
        };
        if !path.is_file() {
            return Err(load_err("file not found".into()));
        }
        let bytes = std::fs::read(path).map_err(|e| load_err(e.to_string()))?;
        let tok = Self::from_bytes(&bytes, &path.display().to_string())?;
        Ok((tok, bytes))
    }

    /// From a `tokenizer.json`'s bytes; `origin` names where they came from in errors.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self, TokenizerError> {
        let load_err = |reason: String| TokenizerError::Load {
            path: origin.to_string(),
            reason,
        };
        let mut inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| load_err(e.to_string()))?;
        // Text is text: a message containing `<end_of_turn>` must not become the control token.
        // The chat template inserts control tokens by id.
        inner.set_encode_special_tokens(true);
        let id = |tok: &'static str| {
            inner
                .token_to_id(tok)
                .ok_or(TokenizerError::MissingToken(tok))
        };
        Ok(Self {
            bos_id: id("<bos>")?,
            eos_id: id("<eos>")?,
            start_of_turn_id: id("<start_of_turn>")?,
            end_of_turn_id: id("<end_of_turn>")?,
            pad_id: inner.token_to_id("<pad>"),
            inner,
            texts: std::sync::OnceLock::new(),
        })
    }

    /// Token ids for `text`, without adding BOS (the chat template adds it once). Special-token
    /// names in `text` are tokenized as plain text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Like [`Self::decode`], but control tokens (`<bos>`, `<start_of_turn>`, …) are shown.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids of the tokens whose text, decoded alone, contains one of `needles` (control
    /// tokens have none). The first call decodes the whole vocabulary once (a fraction of a
    /// second for Gemma's 262k tokens): call it off the async runtime.
    pub fn ids_containing(&self, needles: &[String]) -> Vec<u32> {
        let texts = self.texts.get_or_init(|| {
            (0..self.vocab_size() as u32)
                .map(|id| self.inner.decode(&[id], true).unwrap_or_default())
                .collect()
        });
        texts
            .iter()
            .enumerate()
            .filter(|(_, t)| needles.iter().any(|n| t.contains(n.as_str())))
            .map(|(id, _)| id as u32)
            .collect()
    }
}

/// The SHA-256 of `bytes` in lowercase hex: how workers and orchestrators name a tokenizer file,
/// so a tokenizer both hold is never sent.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
