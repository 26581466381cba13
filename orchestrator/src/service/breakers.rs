//! DRY's sequence breakers as token ids. A request names breakers as text (llama.cpp's
//! `dry_sequence_breakers`); the worker needs the tokens that contain them. Resolving a set scans
//! the whole vocabulary, so each set's ids are kept: almost every request uses the defaults.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hearth_shared::tokenizer::Tokenizer;

/// Breaker sets remembered at most; the map starts over when full.
const MAX_SETS: usize = 64;

#[derive(Debug, Default)]
pub struct Breakers {
    known: Mutex<HashMap<Vec<String>, Arc<[u32]>>>,
}

impl Breakers {
    /// The ids of the tokens that contain one of `breakers`. Blocking (the first call decodes
    /// the vocabulary): run it on the blocking pool.
    pub fn ids(&self, tok: &Tokenizer, breakers: &[String]) -> Arc<[u32]> {
        if let Some(ids) = self.lock().get(breakers) {
            return ids.clone();
        }
        let ids: Arc<[u32]> = tok.ids_containing(breakers).into();
        let mut known = self.lock();
        if known.len() >= MAX_SETS {
            known.clear();
        }
        known.insert(breakers.to_vec(), ids.clone());
        ids
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<String>, Arc<[u32]>>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }
}
