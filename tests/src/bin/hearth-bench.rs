//! `hearth-bench`: load generator for Hearth and other OpenAI-compatible servers on this machine.
//! See `hearth-bench --help`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use hearth_e2e::bench::client::{Api, Target};
use hearth_e2e::bench::report::{table, Summary};
use hearth_e2e::bench::{concurrency_level, multi_turn, request_rate, Shape};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// Single-turn requests at each of `--concurrency` levels in turn.
    Sweep,
    /// `--sessions` conversations of `--turns` turns, all at once.
    MultiTurn,
    /// Poisson arrivals at `--rate` requests per second.
    Rate,
}

/// Load generator for chat serving: concurrency sweeps, multi-turn chat and Poisson request
/// rates against Hearth (native or OpenAI-compatible API) or any OpenAI-compatible server on
/// this machine. Prints a table and writes a JSON report.
#[derive(Debug, Parser)]
#[command(name = "hearth-bench", version)]
struct Args {
    /// Server base URL (loopback only), e.g. http://127.0.0.1:8080.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// API to speak: `openai` (`/v1/chat/completions`) or `native` (Hearth sessions).
    #[arg(long, value_enum, default_value = "openai")]
    api: Api,
    /// Bearer token, if the server needs one.
    #[arg(long, env = "HEARTH_API_KEY")]
    api_key: Option<String>,
    /// Model name to send [default: the first of `GET /v1/models`].
    #[arg(long)]
    model: Option<String>,
    /// Which workload to run.
    #[arg(long, value_enum, default_value = "sweep")]
    workload: Workload,
    /// Concurrency levels for `sweep`, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Requests per concurrency level [default: 4 × the level, at least 8].
    #[arg(long)]
    requests: Option<usize>,
    /// Prompt length in words (random words from the seed; about 1.3 tokens per word).
    #[arg(long, default_value_t = 128)]
    input_words: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    output_tokens: u32,
    /// Let replies end early at end-of-turn instead of generating exactly `--output-tokens`.
    #[arg(long)]
    allow_early_stop: bool,
    /// Sessions for `multi-turn`.
    #[arg(long, default_value_t = 32)]
    sessions: usize,
    /// Turns per session for `multi-turn`.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Requests in flight at once for `multi-turn` [default: one per session]; fewer clients
    /// than sessions serve the sessions' turns round-robin.
    #[arg(long)]
    clients: Option<usize>,
    /// New user words per turn for `multi-turn`.
    #[arg(long, default_value_t = 90)]
    turn_words: usize,
    /// Requests per second for `rate`.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Seed for prompts and sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop starting requests after this many seconds (the run is bounded even if the server
    /// is slow).
    #[arg(long, default_value_t = 1800)]
    max_duration_secs: u64,
    /// Give up on one request after this many seconds.
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
    /// Write the JSON report here [default: only print the table].
    #[arg(long)]
    out: Option<PathBuf>,
    /// A description of the machine and setup, stored in the report.
    #[arg(long, default_value = "")]
    label: String,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hearth-bench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hearth-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<u64>().ok());
    json!({
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(usize::from).ok(),
        "memory_gib": mem_kib.map(|k| (k as f64 / 1048576.0 * 10.0).round() / 10.0),
    })
}

async fn run(args: Args) -> anyhow::Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        anyhow::bail!("--concurrency: levels must be positive");
    }
    if !(args.rate.is_finite() && args.rate > 0.0) {
        anyhow::bail!("--rate: must be a positive number");
    }
    if args.output_tokens == 0 || args.sessions == 0 || args.turns == 0 || args.clients == Some(0) {
        anyhow::bail!("--output-tokens, --sessions, --turns and --clients must be positive");
    }
    let target = Target::parse(
        &args.url,
        args.api_key.clone(),
        Duration::from_secs(args.request_timeout_secs),
    )?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let models = target
                .json("GET", "/v1/models", None)
                .await
                .context("listing models (pass --model to skip)")?;
            models["data"][0]["id"]
                .as_str()
                .context("GET /v1/models listed no model; pass --model")?
                .to_string()
        }
    };
    let shape = Shape {
        api: args.api,
        model: model.clone(),
        input_words: args.input_words,
        output_tokens: args.output_tokens,
        fixed_length: !args.allow_early_stop,
        seed: args.seed,
    };
    let started_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let deadline = Instant::now() + Duration::from_secs(args.max_duration_secs);
    let show = !args.quiet;
    let mut rows: Vec<Summary> = Vec::new();
    match args.workload {
        Workload::Sweep => {
            for &c in &args.concurrency {
                let n = args.requests.unwrap_or((4 * c).max(8));
                rows.push(concurrency_level(&target, &shape, c, n, deadline, show).await);
            }
        }
        Workload::MultiTurn => {
            rows.push(
                multi_turn(
                    &target,
                    &shape,
                    args.sessions,
                    args.turns,
                    args.turn_words,
                    args.clients.unwrap_or(args.sessions),
                    deadline,
                    show,
                )
                .await,
            );
        }
        Workload::Rate => {
            let n = args.requests.unwrap_or(64);
            rows.push(request_rate(&target, &shape, args.rate, n, deadline, show).await);
        }
    }
    eprintln!(
        "hearth-bench: {} via {:?} API, model {model}",
        args.url, args.api
    );
    #[allow(clippy::print_stdout)]
    {
        print!("{}", table(&rows));
    }
    if let Some(path) = &args.out {
        let report = json!({
            "tool": "hearth-bench",
            "version": env!("CARGO_PKG_VERSION"),
            "started_at_unix": started_at,
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "label": args.label,
            "machine": machine(),
            "target": args.url,
            "api": args.api,
            "model": model,
            "workload": format!("{:?}", args.workload),
            "input_words": args.input_words,
            "output_tokens": args.output_tokens,
            "fixed_length": shape.fixed_length,
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("--out {}: cannot write", path.display()))?;
        eprintln!("hearth-bench: wrote {}", path.display());
    }
    let errors: usize = rows.iter().map(|r| r.errors).sum();
    if errors > 0 {
        eprintln!("hearth-bench: {errors} requests failed (see error_examples in the report)");
    }
    Ok(())
}
