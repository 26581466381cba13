//! Fixture builders shared by the engine tests: tiny models and engines on them, greedy requests
//! and deterministic prompts, and what a request produced; [`worker`] runs the worker binary.
#![allow(dead_code)]

pub mod worker;

use std::path::PathBuf;
use std::sync::Arc;

use hearth_worker::engine::{Engine, EngineConfig, EngineEvent, EventStream, GenerateRequest};
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use hearth_worker::model::{load_gguf, Model};

/// The tiny models' vocabulary (`TinySpec::default().vocab`).
pub const VOCAB: u32 = 512;

/// A fresh directory under the system temp dir, unique per test.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("hearth-test-{}-{tag}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

pub fn tiny_model_with(spec: &TinySpec) -> Arc<Model> {
    let path = temp_dir("model").join("tiny.gguf");
    write_tiny_gguf(&path, spec).expect("write tiny gguf");
    Arc::new(load_gguf(&path).expect("load tiny gguf"))
}

pub fn tiny_model() -> Arc<Model> {
    tiny_model_with(&TinySpec::default())
}

pub fn engine(model: Arc<Model>, config: EngineConfig) -> Engine {
    Engine::start(model, config).expect("start engine")
}

/// Everything a request produced.
#[derive(Debug, Default)]
pub struct Outcome {
    pub cached_tokens: Option<usize>,
    /// How long after it reached the engine it was admitted (its `Started` event).
    pub queue_ms: Option<f64>,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: Option<EngineEvent>,
    pub error: Option<hearth_worker::engine::EngineError>,
}

pub fn collect(mut rx: EventStream) -> Outcome {
    let mut o = Outcome::default();
    while let Some(e) = rx.blocking_recv() {
        match e {
            EngineEvent::Started {
                cached_tokens,
                queue_ms,
            } => {
                o.cached_tokens = Some(cached_tokens);
                o.queue_ms = Some(queue_ms);
            }
            EngineEvent::Token { id, logprob, .. } => {
                o.tokens.push(id);
                o.logprobs.push(logprob);
            }
            f @ EngineEvent::Finished { .. } => {
                o.finish = Some(f);
                break;
            }
            EngineEvent::Error(e) => {
                o.error = Some(e);
                break;
            }
        }
    }
    o
}

/// Deterministic prompt of `len` ordinary tokens (no special ids).
pub fn prompt(len: usize, seed: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 200 + (i * 37 + seed * 101) % (vocab - 200))
        .collect()
}

/// A request for exactly `n` tokens (the end of a turn does not stop it), greedy by default.
pub fn greedy(id: u64, prompt: Vec<u32>, n: u32) -> GenerateRequest {
    let mut r = GenerateRequest::new(id, prompt, n);
    r.ignore_eos = true;
    r
}
