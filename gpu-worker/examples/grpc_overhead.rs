//! What the gRPC service adds to single-stream decode: the same greedy request run on an
//! in-process engine and through a `hearth-worker serve` child process, alternately, on the same
//! model. Decode speed is measured from the first token to the last as each side sees it.
//!
//! `cargo build --release -p hearth-worker && cargo run --release -p hearth-worker --example
//! grpc_overhead [-- MODEL [REPS [TOKENS]]]`
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_shared::proto::{self, worker_client::WorkerClient, worker_event::Kind};
use hearth_worker::engine::{Engine, EngineConfig, EngineEvent, GenerateRequest};
use hearth_worker::fixtures::WorkerProcess;
use tokio_stream::wrappers::ReceiverStream;

const PROMPT: usize = 16;

fn prompt() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| 1000 + i * 7).collect()
}

/// (time to first token, time from first to last token, tokens)
type Sample = (Duration, Duration, usize);

fn engine_run(h: &hearth_worker::engine::EngineHandle, id: u64, n: u32) -> Sample {
    let mut r = GenerateRequest::new(id, prompt(), n);
    r.ignore_eos = true;
    let start = Instant::now();
    let mut rx = h.submit(r).unwrap();
    let (mut first, mut last, mut count) = (None, start, 0);
    while let Some(e) = rx.blocking_recv() {
        match e {
            EngineEvent::Token { .. } => {
                last = Instant::now();
                first.get_or_insert(last);
                count += 1;
            }
            EngineEvent::Finished { .. } | EngineEvent::Error(_) => break,
            EngineEvent::Started { .. } => {}
        }
    }
    let first = first.unwrap();
    (first - start, last - first, count)
}

async fn grpc_run(c: &mut WorkerClient<tonic::transport::Channel>, id: u64, n: u32) -> Sample {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let start = Instant::now();
    tx.send(proto::WorkerRequest {
        kind: Some(proto::worker_request::Kind::Batch(proto::GenerateBatch {
            requests: vec![proto::GenerateRequest {
                request_id: id,
                prompt_token_ids: prompt(),
                max_new_tokens: n,
                ignore_eos: true,
                ..Default::default()
            }],
        })),
    })
    .await
    .unwrap();
    let mut events = c
        .generate(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let (mut first, mut last, mut count) = (None, start, 0);
    while let Some(e) = events.message().await.unwrap() {
        match e.kind.unwrap() {
            Kind::Tokens(t) => {
                last = Instant::now();
                first.get_or_insert(last);
                count += t.ids.len();
            }
            Kind::Finished(_) | Kind::Error(_) => break,
            Kind::Started(_) => {}
        }
    }
    drop(tx);
    let first = first.unwrap();
    (first - start, last - first, count)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let model = args.next().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap())
            .join(".cache/hearth/models/gemma-3-270m-q4_k_m.gguf")
    });
    let reps: usize = args.next().map_or(7, |s| s.parse().unwrap());
    let tokens: u32 = args.next().map_or(128, |s| s.parse().unwrap());

    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .join("../hearth-worker");
    let worker = WorkerProcess::spawn(&bin, &model, &["--kv-budget", "512MiB"])
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let addr = format!("http://{}", worker.grpc);
    let mut client = WorkerClient::connect(addr).await.unwrap();
    while !client
        .health(proto::HealthRequest {})
        .await
        .unwrap()
        .into_inner()
        .ready
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let engine = Engine::start(
        Arc::new(hearth_worker::model::load_gguf(&model).unwrap()),
        EngineConfig {
            kv_budget_bytes: 512 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let h = engine.handle();
    // Warm both sides up.
    tokio::task::block_in_place(|| engine_run(&h, 0, 8));
    grpc_run(&mut client, 0, 8).await;

    let (mut e_tok, mut g_tok, mut e_ttft, mut g_ttft) = (vec![], vec![], vec![], vec![]);
    for rep in 0..reps {
        let id = rep as u64 + 1;
        let e = tokio::task::block_in_place(|| engine_run(&h, id, tokens));
        let g = grpc_run(&mut client, id, tokens).await;
        let ms_per_token = |s: &Sample| s.1.as_secs_f64() * 1e3 / (s.2 - 1) as f64;
        eprintln!(
            "rep {rep}: engine {:.2} ms/token, grpc {:.2} ms/token",
            ms_per_token(&e),
            ms_per_token(&g)
        );
        e_tok.push(ms_per_token(&e));
        g_tok.push(ms_per_token(&g));
        e_ttft.push(e.0.as_secs_f64() * 1e3);
        g_ttft.push(g.0.as_secs_f64() * 1e3);
    }
    let (e, g) = (median(e_tok), median(g_tok));
    let report = serde_json::json!({
        "model": model.display().to_string(),
        "reps": reps,
        "decode_tokens": tokens,
        "prompt_tokens": PROMPT,
        "engine": { "ms_per_token_p50": e, "decode_tok_s": 1e3 / e, "ttft_ms_p50": median(e_ttft) },
        "grpc": { "ms_per_token_p50": g, "decode_tok_s": 1e3 / g, "ttft_ms_p50": median(g_ttft) },
        "grpc_overhead_pct": (g / e - 1.0) * 100.0,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}
