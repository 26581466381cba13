//! `hearth-worker`: the GPU worker binary. The gRPC service arrives with the worker-service
//! issue; today it offers `bench` (engine benchmark, JSON) and `chat` (a terminal chat over the
//! engine, one session, Gemma chat template).

mod repl;

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use hearth_worker::bench::{run_bench, BenchOptions};

#[derive(Parser, Debug)]
#[command(
    name = "hearth-worker",
    version,
    about = "Hearth GPU worker: Gemma inference engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn default_models_dir() -> PathBuf {
    std::env::var_os("HEARTH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/hearth/models")
        })
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure the engine on a GGUF model and print JSON.
    Bench {
        /// GGUF model file (default: the fetched Gemma 3 270M in the models directory).
        #[arg(long, env = "HEARTH_MODEL")]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 512)]
        prefill_tokens: usize,
        #[arg(long, default_value_t = 128)]
        decode_tokens: u32,
        /// Concurrent sequences for the batched decode runs.
        #[arg(long, default_value = "1,4,16,64", value_delimiter = ',')]
        concurrency: Vec<usize>,
        /// Tokens generated per sequence in the batched runs.
        #[arg(long, default_value_t = 64)]
        batch_tokens: u32,
        /// Interleaved session counts for the multi-turn runs.
        #[arg(long, default_value = "1,32", value_delimiter = ',')]
        sessions: Vec<usize>,
        #[arg(long, default_value_t = 8)]
        turns: usize,
        /// New user tokens per turn.
        #[arg(long, default_value_t = 120)]
        turn_tokens: usize,
        /// Reply tokens per turn.
        #[arg(long, default_value_t = 32)]
        reply_tokens: u32,
        /// KV budget in MiB.
        #[arg(long, env = "HEARTH_KV_BUDGET_MB", default_value_t = 4096)]
        kv_budget_mb: usize,
    },
    /// Chat in the terminal with the model (one session; each line is a user turn).
    Chat {
        #[arg(long, env = "HEARTH_MODEL")]
        model: Option<PathBuf>,
        #[arg(long, env = "HEARTH_TOKENIZER")]
        tokenizer: Option<PathBuf>,
        #[arg(long, default_value_t = 128)]
        max_new_tokens: u32,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let models = default_models_dir();
    match cli.command {
        Command::Bench {
            model,
            prefill_tokens,
            decode_tokens,
            concurrency,
            batch_tokens,
            sessions,
            turns,
            turn_tokens,
            reply_tokens,
            kv_budget_mb,
        } => {
            let model = model.unwrap_or_else(|| models.join(repl::DEFAULT_MODEL));
            repl::require_file(&model)?;
            let report = run_bench(&BenchOptions {
                model,
                prefill_tokens,
                decode_tokens,
                concurrency,
                batch_tokens,
                sessions,
                turns: turns.max(1),
                turn_tokens,
                reply_tokens,
                kv_budget_bytes: kv_budget_mb << 20,
            })?;
            #[allow(clippy::print_stdout)]
            {
                println!("{}", serde_json::to_string_pretty(&report)?);
            }
            Ok(())
        }
        Command::Chat {
            model,
            tokenizer,
            max_new_tokens,
            temperature,
        } => repl::chat(
            &model.unwrap_or_else(|| models.join(repl::DEFAULT_MODEL)),
            &tokenizer.unwrap_or_else(|| models.join(repl::DEFAULT_TOKENIZER)),
            max_new_tokens,
            temperature,
        ),
    }
}
