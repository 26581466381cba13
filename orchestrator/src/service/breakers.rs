//! DRY's sequence breakers as token ids. A request names breakers as text (llama.cpp's
//! `dry_sequence_breakers`); the worker needs the tokens that contain them. Resolving a set scans
//! the whole vocabulary, so each set's ids are kept: almost every request uses the defaults.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::tokenizers::ModelTokenizer;

/// Breaker sets remembered at most; the map starts over when full.
const MAX_SETS: usize = 64;

/// Each tokenizer's (by its SHA-256) breaker sets and their ids.
type Known = HashMap<(Arc<str>, Vec<String>), Arc<[u32]>>;

#[derive(Debug, Default)]
pub struct Breakers {
    known: Mutex<Known>,
}

impl Breakers {
    /// The ids of the tokens that contain one of `breakers`. Blocking (the first call decodes
    /// the vocabulary): run it on the blocking pool.
    pub fn ids(&self, tok: &ModelTokenizer, breakers: &[String]) -> Arc<[u32]> {
        let key = (tok.sha256.clone(), breakers.to_vec());
        if let Some(ids) = self.lock().get(&key) {
            return ids.clone();
        }
        let ids: Arc<[u32]> = tok.tok.ids_containing(breakers).into();
        let mut known = self.lock();
        if known.len() >= MAX_SETS {
            known.clear();
        }
        known.insert(key, ids.clone());
        ids
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }
}
