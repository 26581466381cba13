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
    Bench(BenchOptions),
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
        Command::Bench(options) => {
            let model = options
                .model
                .clone()
                .unwrap_or_else(|| models.join(repl::DEFAULT_MODEL));
            repl::require_file(&model)?;
            let report = run_bench(&model, &options)?;
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
