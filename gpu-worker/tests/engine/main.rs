//! Engine behaviour over a tiny generated Gemma-3-shaped model: batching equivalence, session
//! caches, errors, cancellation, memory pressure.
//!
//! [`batching`] holds how requests share the engine (batches, seeded sampling, cancels, memory
//! pressure, fairness between users); [`caches`] the session and prefix caches and the disk tier;
//! [`models`] bad requests and model files. Here: waiting for the engine's counters.

#![allow(clippy::unwrap_used)]

mod batching;
mod caches;
#[path = "../common/mod.rs"]
mod common;
mod models;

use std::time::Duration;

use hearth_worker::engine::{EngineHandle, EngineStats};

/// The engine's counters once `ok` holds (they are published after each step).
pub(crate) fn settled(h: &EngineHandle, ok: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.stats();
        if ok(&s) {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "{s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
