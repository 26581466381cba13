//! `hearth-stack`: the whole stack for the web UI's browser tests, on one command. See
//! `hearth-stack --help`.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use hearth_e2e::stack::{assets_with, slow_spec, Assets};
use hearth_orchestrator::auth::{issue_key, KeyOptions};
use hearth_orchestrator::storage::SqlStore;
use hearth_worker::fixtures::TinySpec;
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Auth {
    /// No keys: every request is the local user (what `make run` serves).
    None,
    /// `Authorization: Bearer hk_…`; the keys are created and printed.
    Keys,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Model {
    /// A tiny random-weight model: replies of a few hundred tokens take well under a second.
    Tiny,
    /// A bigger random-weight model: a reply of a few hundred tokens takes seconds, so a test
    /// can stop, reload or cut the network while it streams.
    Slow,
    /// Two tiny models of one repository, `tiny` and `tiny-b` (different weights), both loaded
    /// by the one worker: for choosing a chat's model.
    Two,
}

/// Starts the real `hearth` (debug build) and a real `hearth-worker` with a tiny generated
/// model and tokenizer, a database, and the statically exported web UI, for browser tests.
///
/// When the stack is ready it prints ONE JSON line on stdout, e.g.
/// `{"url":"http://127.0.0.1:40123","auth":"keys","keys":{"full":"hk_…","limited":"hk_…",
/// "other":"hk_…"},"database_url":"sqlite://…","web_dir":"/…/web/out"}`, then runs until
/// SIGTERM or SIGINT, until its stdin is closed (when stdin is a pipe), or until `hearth` or the
/// worker exits. On the way out it kills both; they are also set to die if it is killed
/// (SIGKILL included), so they never outlive it. The temporary directory (model, tokenizer,
/// SQLite database) is removed.
///
/// With `--auth keys` three keys are created: `full` (user `e2e`, no limits), `limited` (user
/// `e2e`, 2 generation requests a minute: the third gets 429 with Retry-After) and `other`
/// (user `e2e-other`, for isolation checks). Non-generation routes are not rate limited.
///
/// Recipes:
///   503 (no capacity): `--model slow --hearth-arg=--worker-capacity=1 --hearth-arg=--max-queue=0`
///     (while one reply streams, a turn in another session is refused with 503; in the same
///     session it is a 409).
///   Long deterministic reply (markdown rendering): `--scripted-token-ms 2`: the worker loads no
///     model and answers every request by echoing its prompt tokens, one every 2 ms, until
///     `max_tokens`. With the tiny tokenizer one ASCII character is one token, so posting a
///     4,000-character markdown message with `"max_tokens": 4000` streams back that markdown
///     (after the chat template's role word `user` and a newline) as 4,000 tokens.
///   Slow replies: `--model slow`, or `--scripted-token-ms 50` (20 tokens a second, exact).
#[derive(Debug, Parser)]
#[command(name = "hearth-stack", version, verbatim_doc_comment)]
struct Args {
    /// Statically exported UI that hearth serves at `/` (relative paths are taken from the
    /// current directory).
    #[arg(long, default_value = "web/out")]
    web_dir: PathBuf,
    /// Whether the API needs keys.
    #[arg(long, value_enum, default_value = "none")]
    auth: Auth,
    /// `postgres://…` or `sqlite:…` [default: SQLite in the temporary directory]. The database
    /// must exist; its tables are created if missing.
    #[arg(long)]
    database_url: Option<String>,
    /// Address for hearth; port 0 lets the OS choose (the URL printed says which).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Which generated model the worker runs (ignored with `--scripted-token-ms`).
    #[arg(long, value_enum, default_value = "tiny")]
    model: Model,
    /// Scripted worker: no model, one token every MS milliseconds per reply, echoing the
    /// prompt's tokens (deterministic text; see the recipes above).
    #[arg(long, value_name = "MS")]
    scripted_token_ms: Option<u64>,
    /// Tokenizer for hearth [default: the tiny generated one, one token per ASCII character].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Extra argument for `hearth` (repeat), e.g. `--hearth-arg=--max-queue=0`.
    #[arg(long = "hearth-arg", allow_hyphen_values = true, value_name = "ARG")]
    hearth_args: Vec<String>,
    /// Extra argument for `hearth-worker serve` (repeat).
    #[arg(long = "worker-arg", allow_hyphen_values = true, value_name = "ARG")]
    worker_args: Vec<String>,
    /// The `hearth` binary [default: next to this one, i.e. `target/debug/hearth`].
    #[arg(long)]
    hearth_bin: Option<PathBuf>,
    /// The `hearth-worker` binary [default: next to this one].
    #[arg(long)]
    worker_bin: Option<PathBuf>,
    /// Seconds to wait for the stack to become ready.
    #[arg(long, default_value_t = 120)]
    ready_timeout_secs: u64,
}

/// A child process that is killed (and reaped) when dropped, and that the kernel kills if this
/// process dies first.
#[derive(Debug)]
struct Guarded {
    name: &'static str,
    child: Child,
    /// Held so the child never writes into a closed pipe.
    _stdout: std::io::BufReader<ChildStdout>,
}

impl Guarded {
    /// Starts `cmd` and reads the JSON line it prints first (its listening addresses).
    fn spawn(name: &'static str, mut cmd: Command) -> anyhow::Result<(Self, serde_json::Value)> {
        use std::os::unix::process::CommandExt;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped());
        // SAFETY: the closure makes one async-signal-safe system call. PR_SET_PDEATHSIG fires
        // when the spawning *thread* exits; children are spawned from the main thread, which
        // lives as long as the process.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        let stdout = child.stdout.take().context("no stdout pipe")?;
        let mut guarded = Self {
            name,
            child,
            _stdout: std::io::BufReader::new(stdout),
        };
        let mut line = String::new();
        guarded._stdout.read_line(&mut line)?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|_| {
            let status = guarded.child.try_wait().ok().flatten();
            anyhow::anyhow!(
                "{name} did not start (printed `{}`, exit status {status:?}); its error is above",
                line.trim()
            )
        })?;
        Ok((guarded, v))
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The temporary directory, removed when dropped (after the children, which are declared
/// later and so dropped first).
#[derive(Debug)]
struct TempAssets(Assets);

impl Drop for TempAssets {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0.dir);
    }
}

/// `name` next to this executable (`target/<profile>/`), or the explicit path.
fn binary(explicit: &Option<PathBuf>, name: &str, package: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("{} is missing", p.display());
        }
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().context("cannot find this executable's path")?;
    let dir = exe.parent().context("this executable has no directory")?;
    // `target/debug/hearth-stack` or, under `cargo test`, `target/debug/deps/…`.
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "{} is missing: run `cargo build -p {package}` (or `cargo build -p hearth-orchestrator -p hearth-worker -p hearth-e2e`)",
        dir.join(name).display()
    )
}

fn absolute(p: &Path) -> anyhow::Result<PathBuf> {
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    Ok(std::env::current_dir()
        .context("cannot read the current directory")?
        .join(p))
}

/// `GET /readyz` answers 200 (the database is reachable and a worker is ready).
fn ready(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    // The address as Host, as any client sends it (without keys, hearth answers only to
    // loopback names).
    let probe = format!("GET /readyz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if c.write_all(probe.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    c.read_exact(&mut head).is_ok() && &head[9..12] == b"200"
}

/// Whether stdin is a pipe or socket (so its closing means "the parent is gone"). A terminal
/// or `/dev/null` (a background job) is not watched.
fn stdin_is_pipe() -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata("/dev/stdin")
        .map(|m| m.file_type().is_fifo() || m.file_type().is_socket())
        .unwrap_or(false)
}

async fn create_keys(db_url: &str) -> anyhow::Result<serde_json::Value> {
    let store = SqlStore::connect(db_url)
        .await
        .with_context(|| format!("--database-url {db_url}: cannot open"))?;
    let full = issue_key(&store, "e2e", KeyOptions::default()).await?.key;
    let limited = issue_key(
        &store,
        "e2e",
        KeyOptions {
            requests_per_minute: Some(2),
            ..KeyOptions::default()
        },
    )
    .await?
    .key;
    let other = issue_key(&store, "e2e-other", KeyOptions::default())
        .await?
        .key;
    store.close().await;
    Ok(json!({"full": full, "limited": limited, "other": other}))
}

/// What ended the run.
enum End {
    Signal,
    StdinClosed,
    Exited(&'static str, std::process::ExitStatus),
}

async fn wait_for_end(hearth: &mut Guarded, worker: &mut Guarded) -> End {
    let (eof_tx, mut eof_rx) = tokio::sync::mpsc::channel::<()>(1);
    if stdin_is_pipe() {
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            let _ = eof_tx.blocking_send(());
        });
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("hearth-stack: cannot watch SIGTERM ({e}); use SIGINT");
            None
        }
    };
    let sigterm = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sigterm);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return End::Signal,
            () = &mut sigterm => return End::Signal,
            Some(()) = eof_rx.recv() => return End::StdinClosed,
            _ = tick.tick() => {
                for p in [&mut *hearth, &mut *worker] {
                    if let Some(status) = p.exited() {
                        return End::Exited(p.name, status);
                    }
                }
            }
        }
    }
}

/// A repository in `dir` of two tiny models: `tiny/1` (the stack's `model`) and `tiny-b/1`.
fn two_models(dir: &Path, model: &Path) -> anyhow::Result<PathBuf> {
    let root = dir.join("repository");
    let a = root.join("tiny/1");
    let b = root.join("tiny-b/1");
    std::fs::create_dir_all(&a)?;
    std::fs::create_dir_all(&b)?;
    std::fs::copy(model, a.join("model.gguf"))?;
    let other = TinySpec {
        seed: 99,
        ..TinySpec::default()
    };
    hearth_worker::fixtures::write_tiny_gguf(&b.join("model.gguf"), &other)?;
    Ok(root)
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let hearth_bin = binary(&args.hearth_bin, "hearth", "hearth-orchestrator")?;
    let worker_bin = binary(&args.worker_bin, "hearth-worker", "hearth-worker")?;
    let web_dir = absolute(&args.web_dir)?;
    if !web_dir.join("index.html").is_file() {
        eprintln!(
            "hearth-stack: warning: {} has no index.html (build the UI: `cd web && npm run build`); \
             the API works, `/` says the UI is not built",
            web_dir.display()
        );
    }
    let spec = match args.model {
        Model::Tiny | Model::Two => TinySpec::default(),
        Model::Slow => slow_spec(),
    };
    let assets = TempAssets(assets_with("stack", &spec));
    let repository = match args.model {
        Model::Two => Some(two_models(&assets.0.dir, &assets.0.model)?),
        _ => None,
    };
    let db_url = args.database_url.clone().unwrap_or_else(|| {
        format!(
            "sqlite://{}?mode=rwc",
            assets.0.dir.join("hearth.db").display()
        )
    });
    let keys = match args.auth {
        Auth::Keys => create_keys(&db_url).await?,
        Auth::None => json!({}),
    };

    // The worker takes calls only from this stack's hearth.
    let worker_token = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let mut worker_cmd = Command::new(&worker_bin);
    worker_cmd
        .env("HEARTH_WORKER_TOKEN", &worker_token)
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--kv-budget", "64MiB"]);
    match &repository {
        Some(root) => worker_cmd
            .arg("--repository")
            .arg(root)
            .args(["--model", "tiny", "--load", "tiny-b"]),
        None => worker_cmd.arg("--model").arg(&assets.0.model),
    };
    if let Some(ms) = args.scripted_token_ms {
        worker_cmd.arg(format!("--scripted-token-ms={ms}"));
    }
    worker_cmd.args(&args.worker_args).env(
        "RUST_LOG",
        std::env::var("RUST_LOG").unwrap_or("warn".into()),
    );
    let (mut worker, line) = Guarded::spawn("hearth-worker", worker_cmd)?;
    let grpc = line["listening"]["grpc"]
        .as_str()
        .context("hearth-worker printed no gRPC address")?
        .to_string();

    let tokenizer = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| assets.0.tokenizer.clone());
    let mut hearth_cmd = Command::new(&hearth_bin);
    hearth_cmd
        .env("HEARTH_WORKER_TOKEN", &worker_token)
        .arg("--listen")
        .arg(args.listen.to_string())
        .arg("--worker")
        .arg(&grpc)
        .arg("--database-url")
        .arg(&db_url)
        .arg("--tokenizer")
        .arg(&tokenizer)
        .arg("--auth")
        .arg(match args.auth {
            Auth::None => "none",
            Auth::Keys => "keys",
        })
        .arg("--web-dir")
        .arg(&web_dir)
        .args(["--health-interval-ms", "100"])
        .args(&args.hearth_args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or("warn".into()),
        );
    let (mut hearth, line) = Guarded::spawn("hearth", hearth_cmd)?;
    let addr: SocketAddr = line["listening"]["http"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .context("hearth printed no HTTP address")?;

    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_secs);
    while !ready(addr) {
        for p in [&mut hearth, &mut worker] {
            if let Some(status) = p.exited() {
                bail!("{} exited ({status}) before the stack was ready", p.name);
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the stack at {addr} was not ready after {} s",
                args.ready_timeout_secs
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = json!({
        "url": format!("http://{addr}"),
        "auth": match args.auth { Auth::None => "none", Auth::Keys => "keys" },
        "keys": keys,
        "database_url": db_url,
        "web_dir": web_dir,
    });
    {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{out}")?;
        stdout.flush()?;
    }
    eprintln!("hearth-stack: ready at http://{addr}");

    let end = wait_for_end(&mut hearth, &mut worker).await;
    drop(hearth);
    drop(worker);
    drop(assets);
    Ok(match end {
        End::Signal | End::StdinClosed => ExitCode::SUCCESS,
        End::Exited(name, status) => {
            eprintln!("hearth-stack: {name} exited ({status}); stopping");
            ExitCode::FAILURE
        }
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    // One thread: children are spawned from the main thread, so their parent-death signal
    // fires only when this process ends.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hearth-stack: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hearth-stack: {e:#}");
            ExitCode::FAILURE
        }
    }
}
