//! Incremental detokenization: text for each new token as soon as it is complete.
//!
//! A token can carry part of a UTF-8 character (Gemma's byte-fallback tokens), and decoding a
//! token alone can lose a leading space that depends on its neighbours. So each step decodes a
//! short window — the tokens since the last emitted text plus a few before them — and emits only
//! what extends the previous decode of that window and does not end in an incomplete character.
//! Concatenating every piece gives exactly the decode of the whole sequence.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// What a decoder shows for bytes that do not (yet) form a character.
const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the context window: tokens before `read` that are decoded again only for context.
    prefix: usize,
    /// Tokens before this index have had their text emitted.
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the text it completes (empty while a character is incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with(REPLACEMENT) {
            return Ok(String::new());
        }
        match now.get(before.len()..) {
            Some(new) if now.starts_with(&before) => {
                let new = new.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                Ok(new)
            }
            // The window decoded differently with the new token (rare normalizer effects): wait
            // for more context rather than emit text that would later need retracting.
            _ => Ok(String::new()),
        }
    }

    /// Whatever is still held back (an incomplete character at the very end), as decoded.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }

    /// Every token pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
