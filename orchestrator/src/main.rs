//! `hearth`, the orchestrator binary: the HTTP server (the default command) and API key
//! administration (`hearth keys …`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use hearth_orchestrator::auth::{hash_key, issue_key, KeyOptions, PREFIX_LEN};
use hearth_orchestrator::server::{patiently, serve, Config, ServeArgs};
use hearth_orchestrator::storage::{now_ms, Accounts, KeyRole, SqlStore, StoreError};
use hearth_shared::tracing_export::{self, TraceExport};

#[derive(Parser, Debug)]
#[command(
    name = "hearth",
    version,
    about = "Hearth orchestrator: serves the chat API (the default command) and manages API keys"
)]
struct Cli {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    serve: ServeArgs,
    #[command(subcommand)]
    command: Option<Command>,
    /// Where to send traces, over OTLP/gRPC (`http://collector:4317`) [default: not sent].
    /// `OTEL_SERVICE_NAME` names the service (`hearth`), `OTEL_TRACES_SAMPLER_ARG` is the
    /// share of new traces kept (1).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", global = true)]
    otlp_endpoint: Option<String>,
    /// Put each reply's prompt and text into its span (`gen_ai.prompt`, `gen_ai.completion`).
    /// Off by default: traces then hold no conversation text.
    #[arg(long, env = "HEARTH_OTLP_INCLUDE_CONTENT", global = true)]
    otlp_include_content: bool,
}

#[derive(Args, Debug)]
struct DbArgs {
    /// `postgres://…` or `sqlite:…` [default: SQLite at <data dir>/hearth.db].
    #[arg(long, env = "HEARTH_DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// Where the embedded SQLite database lives.
    #[arg(long, env = "HEARTH_DATA_DIR", default_value = "data", global = true)]
    data_dir: PathBuf,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create and revoke API keys.
    Keys {
        #[command(subcommand)]
        action: KeysCommand,
    },
    /// Print the API's OpenAPI 3.1 document (what `/openapi.json` serves) and exit.
    Openapi,
}

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// Create a key for a user (created if new) and print it; it is shown only this once.
    Create {
        #[arg(long)]
        user: String,
        /// Days until the key expires [default: never].
        #[arg(long)]
        expires_in_days: Option<u32>,
        /// Requests per minute allowed with this key [default: the server's limit].
        #[arg(long)]
        requests_per_minute: Option<u32>,
        /// Generated tokens per day allowed with this key [default: the server's limit].
        #[arg(long)]
        tokens_per_day: Option<u32>,
        /// An admin key: it may also load and unload models on the workers
        /// (`/v1/admin/...`).
        #[arg(long)]
        admin: bool,
    },
    /// Revoke the key that starts with PREFIX (the `hk_…` shown at creation), or the whole key.
    Revoke {
        #[arg(long)]
        prefix: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(endpoint) = &cli.otlp_endpoint {
        // A local worker (started without --worker) inherits it, and traces with this process.
        // Set before any other thread exists.
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hearth: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    tracing_export::set_include_content(cli.otlp_include_content);
    let export = TraceExport::from_env(cli.otlp_endpoint.clone(), "hearth");
    let exporting = export.and_then(|e| {
        let _inside = runtime.enter();
        tracing_export::init("warn", &e)
    });
    let _exporting = match exporting {
        Ok(e) => e,
        Err(e) => {
            eprintln!("hearth: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hearth: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    if let Some(Command::Openapi) = cli.command {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", hearth_orchestrator::api::openapi_json())?;
        return Ok(());
    }
    let Some(Command::Keys { action }) = cli.command else {
        // Every setting is checked before anything is opened or started.
        let config = Config::from_args(cli.serve)?;
        let store = std::sync::Arc::new(open_store(&cli.db).await?);
        let result = serve(config, store.clone()).await;
        store.close().await;
        return result;
    };
    let store = open_store(&cli.db).await?;
    match action {
        KeysCommand::Create {
            user,
            expires_in_days,
            requests_per_minute,
            tokens_per_day,
            admin,
        } => {
            if user.trim().is_empty() || user.len() > 128 {
                anyhow::bail!("--user: must be 1 to 128 characters");
            }
            let options = KeyOptions {
                requests_per_minute: requests_per_minute.map(i64::from),
                tokens_per_day: tokens_per_day.map(i64::from),
                expires_at: expires_in_days.map(|d| now_ms() + i64::from(d) * 86_400_000),
                role: if admin { KeyRole::Admin } else { KeyRole::User },
            };
            let issued = issue_key(&store, &user, options).await?;
            let kind = if admin { "admin key" } else { "API key" };
            eprintln!(
                "created {kind} {}… for user {user}; it is shown only now:",
                issued.record.prefix
            );
            #[allow(clippy::print_stdout)]
            {
                println!("{}", issued.key);
            }
        }
        KeysCommand::Revoke { prefix } => revoke_key(&store, &prefix).await?,
    }
    store.close().await;
    Ok(())
}

/// Revokes the one key `prefix` starts (or is): refused when none or several match.
async fn revoke_key(store: &SqlStore, prefix: &str) -> anyhow::Result<()> {
    let keys = if prefix.len() > PREFIX_LEN {
        // A whole key: only the one whose hash matches.
        let lookup: String = prefix.chars().take(PREFIX_LEN).collect();
        let hash = hash_key(prefix);
        let mut keys = store.api_keys_by_prefix(&lookup).await?;
        keys.retain(|(k, _)| k.key_hash == hash);
        keys
    } else {
        store.api_keys_by_prefix(prefix).await?
    };
    match keys.as_slice() {
        [] => anyhow::bail!("--prefix: no API key starts with `{prefix}`"),
        [(key, user)] => {
            store.revoke_api_key(&key.id, now_ms()).await?;
            eprintln!("revoked API key {}… of user {}", key.prefix, user.name);
        }
        _ => anyhow::bail!(
            "--prefix: {} keys start with `{prefix}`; none revoked",
            keys.len()
        ),
    }
    Ok(())
}

async fn open_store(db: &DbArgs) -> anyhow::Result<SqlStore> {
    let url = match &db.database_url {
        Some(u) => u.clone(),
        None => {
            std::fs::create_dir_all(&db.data_dir).map_err(|e| {
                anyhow::anyhow!("--data-dir: cannot create {}: {e}", db.data_dir.display())
            })?;
            format!(
                "sqlite://{}?mode=rwc",
                db.data_dir.join("hearth.db").display()
            )
        }
    };
    // PostgreSQL restarting or not up yet is waited for; a wrong URL or password is not.
    let transient = |e: &StoreError| matches!(e, StoreError::Unavailable(_));
    Ok(patiently("the database", transient, || SqlStore::connect(&url)).await?)
}
