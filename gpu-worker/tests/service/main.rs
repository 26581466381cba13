//! The worker service end to end: the real `hearth-worker` binary on loopback ports with a tiny
//! generated model, driven through the generated gRPC client.
//!
//! [`streams`] holds generation over the stream (health and info, concurrent requests, cancels,
//! session caches, request ids); [`refusals`] the requests and configurations the worker refuses;
//! [`shutdown`] SIGTERM and the drain, loaded or still loading; [`auth`] the worker token. Here: the reference every
//! streamed result is compared with.

mod auth;
#[path = "../common/mod.rs"]
mod common;
mod refusals;
mod shutdown;
mod streams;

use std::path::{Path, PathBuf};

use common::{collect, greedy, temp_dir};
use hearth_worker::engine::{Engine, EngineConfig};
use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};
use hearth_worker::model::load_gguf;

pub(crate) fn tiny_model_file() -> PathBuf {
    let path = temp_dir("svc").join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::default()).expect("write tiny gguf");
    path
}

/// What the engine produces in-process for each prompt on its own: the reference every streamed
/// result must match token for token.
pub(crate) fn expected(model: &Path, prompts: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    // On its own thread: the engine's blocking receive must not run on the test's runtime.
    let (model, prompts) = (model.to_path_buf(), prompts.to_vec());
    std::thread::spawn(move || expected_blocking(&model, &prompts))
        .join()
        .expect("reference run")
}

fn expected_blocking(model: &Path, prompts: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    let engine = Engine::start(
        std::sync::Arc::new(load_gguf(model).expect("load")),
        EngineConfig::default(),
    )
    .expect("engine");
    let h = engine.handle();
    prompts
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            collect(h.submit(greedy(i as u64, p.clone(), *n)).expect("submit")).tokens
        })
        .collect()
}
