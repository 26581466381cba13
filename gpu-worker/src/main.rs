//! `hearth-worker`: the GPU worker binary. `serve` runs the gRPC service the orchestrator talks
//! to; `bench` measures the engine (JSON); `chat` is a terminal chat over the engine (one session,
//! Gemma chat template).

mod repl;

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use hearth_shared::tracing_export::{self, TraceExport};
use hearth_worker::bench::{run_bench, BenchOptions};
use hearth_worker::check::{check_golden, check_greedy, CheckOptions, GoldenOptions};
use hearth_worker::gen_model::GenModelOptions;
use hearth_worker::server::config::{default_models_dir, DEFAULT_MODEL, DEFAULT_TOKENIZER};
use hearth_worker::server::{ServeConfig, Worker};

#[derive(Parser, Debug)]
#[command(
    name = "hearth-worker",
    version,
    about = "Hearth GPU worker: Gemma inference engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where to send traces, over OTLP/gRPC (`http://collector:4317`) [default: not sent].
    /// `OTEL_SERVICE_NAME` names the service (`hearth-worker`), `OTEL_TRACES_SAMPLER_ARG` is
    /// the share of new traces kept (1; a request's trace is followed whenever it is sampled).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", global = true)]
    otlp_endpoint: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the model over gRPC (the orchestrator's workers run this).
    Serve(Box<ServeConfig>),
    /// Measure the engine on a GGUF model and print JSON.
    Bench(BenchOptions),
    /// Write a random-weight GGUF file with the shapes, quantization mix and metadata of a real
    /// Gemma 3 model, and a vocabulary llama.cpp loads (for measuring model sizes whose weights
    /// cannot be brought).
    GenModel(GenModelOptions),
    /// Generate greedily on a device and check each token against Hearth's CPU kernels on the
    /// same file (JSON; exits 1 when a pick is further than the tolerance from the CPU's).
    CheckGreedy(CheckOptions),
    /// Check the model's picks against llama.cpp's greedy tokens on the real Gemma 3 270M
    /// (teacher-forced; JSON; exits 1 below 99 % within a tie or 96 % exact).
    CheckGolden(GoldenOptions),
    /// Fetch a model file from an http(s) URL into the models cache (resuming a cut download,
    /// checking its sha256) and print its path.
    Fetch {
        url: String,
        /// The sha256 (64 hex digits) the file must have.
        #[arg(long)]
        sha256: Option<String>,
        /// The models directory (the file goes to its `fetched/`), as `serve` takes it
        /// [default: ~/.cache/hearth/models].
        #[arg(long, env = "HEARTH_MODELS_DIR")]
        models_dir: Option<PathBuf>,
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
    let cli = Cli::parse();
    let export = TraceExport::from_env(cli.otlp_endpoint.clone(), "hearth-worker")
        .map_err(anyhow::Error::msg)?;
    let _exporting = tracing_export::init("info", &export).map_err(anyhow::Error::msg)?;
    let models = std::env::var_os("HEARTH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(default_models_dir);
    match cli.command {
        Command::Serve(config) => serve(*config),
        Command::Bench(options) => {
            print_report(options.model.clone(), &models, |m| run_bench(m, &options))?;
            Ok(())
        }
        Command::CheckGreedy(o) => passed(&print_report(o.model.clone(), &models, |m| {
            check_greedy(m, &o)
        })?),
        Command::CheckGolden(o) => passed(&print_report(o.model.clone(), &models, |m| {
            check_golden(m, &o)
        })?),
        Command::GenModel(o) => {
            let t = std::time::Instant::now();
            let bytes = hearth_worker::gen_model::write(o.like, &o.out, o.seed)?;
            let shape = o.like.shape();
            tracing::info!(
                path = %o.out.display(),
                model = shape.name,
                parameters = shape.parameters(),
                mb = bytes >> 20,
                seconds = t.elapsed().as_secs_f64(),
                "wrote a random-weight model"
            );
            Ok(())
        }
        Command::Fetch {
            url,
            sha256,
            models_dir,
        } => {
            let models = models_dir.unwrap_or(models);
            let path = fetch_model(&models, &url, sha256.as_deref())?;
            #[allow(clippy::print_stdout)]
            {
                println!("{}", path.display());
            }
            Ok(())
        }
        Command::Chat {
            model,
            tokenizer,
            max_new_tokens,
            temperature,
        } => repl::chat(
            &model.unwrap_or_else(|| models.join(DEFAULT_MODEL)),
            &tokenizer.unwrap_or_else(|| models.join(DEFAULT_TOKENIZER)),
            max_new_tokens,
            temperature,
        ),
    }
}

/// Runs `f` on `model` (default: the fetched model in `models`) and prints its JSON report.
fn print_report(
    model: Option<PathBuf>,
    models: &Path,
    f: impl FnOnce(&Path) -> anyhow::Result<serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let model = model.unwrap_or_else(|| models.join(DEFAULT_MODEL));
    repl::require_file(&model)?;
    let report = f(&model)?;
    #[allow(clippy::print_stdout)]
    {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(report)
}

/// A check's ending: exit status 1 where its report says it did not pass.
fn passed(report: &serde_json::Value) -> anyhow::Result<()> {
    if report["pass"] != true {
        std::process::exit(1);
    }
    Ok(())
}

/// `url`'s file in `<models>/fetched/`, fetched unless it is there already.
fn fetch_model(models: &Path, url: &str, sha256: Option<&str>) -> anyhow::Result<PathBuf> {
    use hearth_worker::fetch::{Fetcher, Progress, Source};
    let src = Source::parse(url, sha256)?;
    let fetcher = Fetcher::new(&models.join("fetched"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(runtime.block_on(fetcher.fetch(&src, &Progress::default()))?)
}

/// `--model` as the repository's `name[@version]` (its one model when absent): the weights,
/// the tokenizer (unless `--tokenizer` names one) and the version for `Info`.
fn resolve_in_repository(config: &mut ServeConfig, root: &Path) -> anyhow::Result<()> {
    let repo = hearth_worker::repository::Repository::open(root)?;
    let spec = match config.model.as_deref() {
        Some(m) => m.to_string_lossy().into_owned(),
        None => match repo.models()?.as_slice() {
            [one] => one.clone(),
            names => anyhow::bail!(
                "--model: name a model of the repository {} ({})",
                root.display(),
                names.join(", ")
            ),
        },
    };
    if hearth_worker::fetch::is_url(&spec) {
        anyhow::bail!("--model: a URL is not a model of --repository; name one, as name[@version]");
    }
    let entry = repo.resolve(&spec)?;
    tracing::info!(model = %entry.name, version = %entry.version, weights = %entry.weights.display(), "model from the repository");
    config.model = Some(entry.weights.clone());
    if config.tokenizer.is_none() {
        config.tokenizer = entry.tokenizer.clone();
    }
    config.entry = Some(entry);
    Ok(())
}

fn serve(mut config: ServeConfig) -> anyhow::Result<()> {
    if let Some(root) = config.repository.clone() {
        resolve_in_repository(&mut config, &root)?;
    }
    let url = config
        .model
        .as_deref()
        .and_then(|m| m.to_str())
        .filter(|m| hearth_worker::fetch::is_url(m))
        .map(str::to_string);
    match url {
        Some(url) => {
            // Fetched once the worker listens, so its progress shows in `Info` (and /v1/models).
            let models = config.models_dir.clone().unwrap_or_else(default_models_dir);
            let source = hearth_worker::fetch::Source::parse(&url, config.model_sha256.as_deref())?;
            let cache = models.join("fetched");
            let fetcher = hearth_worker::fetch::Fetcher::new(&cache)?;
            config.model = Some(fetcher.cached_path(&source));
            config.fetch = Some(hearth_worker::server::config::FetchPlan { source, cache });
        }
        None if config.model_sha256.is_some() => {
            anyhow::bail!("--model-sha256: only with a --model URL (http:// or https://)")
        }
        None => {}
    }
    let config = config.validate()?;
    tracing::info!("configuration: {config}");
    tracing::debug!(?config, "full configuration");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("hearth-rpc")
        .build()?;
    let result = runtime.block_on(async {
        // Listen for SIGTERM before announcing the addresses: a supervisor may send it at once.
        let shutdown = shutdown_signal()?;
        let metrics = hearth_worker::telemetry::install()?;
        let worker = Worker::bind(config).await?;
        // One machine-readable line, so whoever started us (the orchestrator, tests) learns the
        // ports when port 0 was asked for.
        let line = serde_json::json!({
            "listening": {
                "grpc": worker.grpc_addr()?.to_string(),
                "metrics": worker.metrics_addr()?.to_string(),
            }
        });
        #[allow(clippy::print_stdout)]
        {
            use std::io::Write;
            println!("{line}");
            std::io::stdout().flush()?;
        }
        worker.run(metrics, shutdown).await?;
        Ok(())
    });
    // A model load interrupted by shutdown may still be blocked in a read; do not wait for it.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// SIGTERM (how orchestration systems stop us) or Ctrl-C. The handlers are installed now; the
/// returned future resolves at the first signal.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutdown signal received");
    })
}
