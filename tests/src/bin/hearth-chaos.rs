//! `hearth-chaos`: a seeded chaos run of the whole stack (`make chaos`). See
//! `hearth-chaos --help`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use hearth_e2e::chaos::client::Plan;
use hearth_e2e::chaos::cluster::{real_model, Model as Workers, Shape};
use hearth_e2e::chaos::faults::Storm;
use hearth_e2e::chaos::{run, seed_or, Config};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Model {
    /// The fetched Gemma 3 270M (`make fetch-model`), run for real.
    Real,
    /// No model: a token every `--token-ms`.
    Scripted,
}

/// Runs replicas, workers, PostgreSQL and Redis of its own; clients chat through random
/// replicas and resume what breaks, while `kill -9`, SIGSTOP, network cuts and restarts of
/// Redis and PostgreSQL strike every `--fault-every-secs`. Then it checks, for every turn, that
/// it was stored once, complete, with the text its client was shown, and prints the counts and
/// the time from each fault to the affected clients' next token. Exits 1 when a promise was
/// broken. `HEARTH_CHAOS_SEED` replays a run.
#[derive(Debug, Parser)]
#[command(name = "hearth-chaos")]
struct Args {
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value_t = 12)]
    clients: usize,
    /// Turns per client (each in the client's one session).
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Tokens per reply (greedy, to the end: `ignore_eos`).
    #[arg(long, default_value_t = 300)]
    tokens: u32,
    #[arg(long, default_value_t = 3)]
    fault_every_secs: u64,
    #[arg(long, default_value_t = 3)]
    orphan_after_secs: u64,
    #[arg(long, value_enum, default_value_t = Model::Real)]
    model: Model,
    /// With `--model scripted`: milliseconds per token.
    #[arg(long, default_value_t = 20)]
    token_ms: u64,
    /// Runs, one after another (seeds `seed`, `seed + 1`, …).
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Where each run's report (JSON) and the processes' logs go.
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let first = seed_or(u64::from(std::process::id()) << 16 ^ rand_bits());
    let mut clean = true;
    for r in 0..args.runs {
        let seed = first.wrapping_add(r);
        let out = args.out.join(format!("{seed:#x}"));
        let config = match config(&args, seed, &out) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("hearth-chaos: {e}");
                return ExitCode::from(2);
            }
        };
        eprintln!(
            "hearth-chaos: run {} of {}, seed {seed:#x}",
            r + 1,
            args.runs
        );
        let report = run(config).await;
        // The report is what the program prints.
        #[allow(clippy::print_stdout)]
        {
            print!("{report}");
        }
        let json = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default();
        if let Err(e) = std::fs::write(out.join("report.json"), json) {
            eprintln!("hearth-chaos: cannot write the report: {e}");
        }
        clean &= report.verdict.clean(Duration::from_secs(30));
    }
    if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Some bits from the clock, for a seed nobody named.
fn rand_bits() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos().into())
}

fn config(args: &Args, seed: u64, out: &std::path::Path) -> Result<Config, String> {
    let (workers, tokenizer) = match args.model {
        Model::Real => {
            let (model, tokenizer) = real_model()
                .ok_or("the real model is missing: run `make fetch-model` (or --model scripted)")?;
            (Workers::File(model), tokenizer)
        }
        Model::Scripted => {
            let assets = hearth_e2e::stack::assets("chaos");
            let w = Workers::Scripted {
                model: assets.model,
                token_ms: args.token_ms,
            };
            (w, assets.tokenizer)
        }
    };
    // About two faults in three are on processes; Redis and PostgreSQL restart once each.
    let faults = (args.turns as u64 * u64::from(args.tokens) / 20).max(12) as usize;
    Ok(Config {
        shape: Shape {
            replicas: args.replicas,
            workers: args.workers,
            model: workers,
            tokenizer,
            orphan_after_secs: args.orphan_after_secs,
            logs: out.to_path_buf(),
        },
        clients: args.clients,
        plan: Plan {
            turns: args.turns,
            tokens: args.tokens,
            turn_deadline: Duration::from_secs(300),
        },
        storm: Storm {
            every: Duration::from_secs(args.fault_every_secs),
            redis_restart_at: Some(faults / 3),
            pg_restart_at: Some(2 * faults / 3),
        },
        seed,
    })
}
