//! The orchestrator's configuration: the command line and environment ([`ServeArgs`], parsed by
//! clap) and the checked value the server is built from ([`Config`]). [`Config::from_args`] is
//! the one place a setting is judged; a value it refuses is named by its flag, and nothing is
//! quietly raised to a minimum.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use hearth_shared::worker_auth::WorkerToken;

use crate::api::ApiOptions;
use crate::http_server::HttpLimits;
use crate::service::{ChatLimits, SharedPromptText};
use crate::workers::{BatchConfig, Discovery, DnsWorkers, PoolConfig};

const DEFAULT_TOKENIZER: &str = "gemma-3-tokenizer.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthArg {
    /// No keys: every request is the local user. Loopback addresses only.
    None,
    /// `Authorization: Bearer hk_…` on every request (`hearth keys create`).
    Keys,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// HTTP address to listen on.
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve `/metrics` on this address of its own, and not on `--listen` [default: on
    /// `--listen`, beside the API].
    #[arg(long, env = "HEARTH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// A worker's gRPC address (repeat for several), or `dns:NAME:PORT` for a worker at PORT
    /// on every address (A and AAAA) that NAME resolves to, looked up again while serving.
    /// None: start a local worker.
    #[arg(long = "worker", env = "HEARTH_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// How often `--worker dns:` names are looked up again (and at once when a worker stops
    /// answering).
    #[arg(long, env = "HEARTH_DNS_REFRESH_SECS", default_value_t = 10)]
    pub dns_refresh_secs: u64,
    /// Ask this DNS server (`IP:PORT`, UDP and TCP) for `--worker dns:` names instead of the
    /// system's resolvers (`/etc/resolv.conf`): for tests and special setups.
    #[arg(long, env = "HEARTH_DNS_SERVER")]
    pub dns_server: Option<SocketAddr>,
    /// Whether requests need an API key.
    #[arg(long, env = "HEARTH_AUTH", value_enum, default_value = "none")]
    pub auth: AuthArg,
    /// Gemma tokenizer.json [default: <models dir>/gemma-3-tokenizer.json].
    #[arg(long, env = "HEARTH_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Where `scripts/fetch-model.sh` puts models [default: ~/.cache/hearth/models].
    #[arg(long, env = "HEARTH_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// GGUF model for the local worker [default: the worker's default in the models dir].
    #[arg(long, env = "HEARTH_MODEL")]
    pub model: Option<PathBuf>,
    /// The `hearth-worker` binary for the local worker [default: next to `hearth`].
    #[arg(long, env = "HEARTH_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// Extra argument for the local worker (repeat), e.g. `--worker-arg=--kv-budget=1GiB`.
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Shared secret sent on every call to the workers (their `--worker-token`). Without it a
    /// started local worker gets a random one.
    #[arg(long, env = "HEARTH_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
    /// Reach the workers over TLS, their certificates checked against this authority (PEM
    /// file; the workers' `--tls-cert`). None: plain TCP.
    #[arg(long, env = "HEARTH_WORKER_CA")]
    pub worker_ca: Option<PathBuf>,
    /// An operator's system prompt whose prefix cache every user shares, as `NAME=FILE` (repeat
    /// for several). Prompts are otherwise cached per user, so that no user learns what another
    /// sent; a request whose prompt begins with this system prompt shares the operator's text
    /// (and only that) with everyone's.
    #[arg(
        long = "shared-prompt",
        env = "HEARTH_SHARED_PROMPTS",
        value_delimiter = ','
    )]
    pub shared_prompts: Vec<String>,
    /// Redis for what replicas share (rate limits, session affinity). None: in process.
    #[arg(long, env = "HEARTH_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Send queued requests to a worker when this many are waiting…
    #[arg(long, env = "HEARTH_BATCH_SIZE", default_value_t = 32)]
    pub batch_size: usize,
    /// …or this many milliseconds after the first.
    #[arg(long, env = "HEARTH_BATCH_DELAY_MS", default_value_t = 2)]
    pub batch_delay_ms: u64,
    /// Requests one worker may have in flight from here [default 0: its max batch + queue].
    #[arg(long, env = "HEARTH_WORKER_CAPACITY", default_value_t = 0)]
    pub worker_capacity: usize,
    /// Requests that may wait when every worker is full; more get 503.
    #[arg(long, env = "HEARTH_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// How long a queued request waits before it gets 503.
    #[arg(long, env = "HEARTH_QUEUE_TIMEOUT_SECS", default_value_t = 10)]
    pub queue_timeout_secs: u64,
    /// A worker that fails health checks this long with replies open on it is given up on, and
    /// its replies continue on other workers (a stopped process, a frozen VM, a lost network).
    #[arg(long, env = "HEARTH_STALL_TIMEOUT_SECS", default_value_t = 10)]
    pub stall_timeout_secs: u64,
    /// How often workers' health is checked.
    #[arg(long, env = "HEARTH_HEALTH_INTERVAL_MS", default_value_t = 500)]
    pub health_interval_ms: u64,
    /// Reply length when a request does not say.
    #[arg(long, env = "HEARTH_DEFAULT_MAX_TOKENS", default_value_t = 1024)]
    pub default_max_tokens: u32,
    /// Requests per minute for keys without their own limit [default: unlimited].
    #[arg(long, env = "HEARTH_REQUESTS_PER_MINUTE")]
    pub requests_per_minute: Option<u32>,
    /// Generated tokens per day for keys without their own limit [default: unlimited].
    #[arg(long, env = "HEARTH_TOKENS_PER_DAY")]
    pub tokens_per_day: Option<u32>,
    /// Stop a native-API reply when its client disconnects (default: finish and store it).
    #[arg(long, env = "HEARTH_CANCEL_ON_DISCONNECT")]
    pub cancel_on_disconnect: bool,
    /// A `streaming` reply whose lease was not renewed for this long belongs to an orchestrator
    /// that died or stalled: with Redis one replica takes it over and continues it, else it is
    /// marked `error` (checked from start-up on, periodically). Measured on this process's own
    /// clock, so replicas' clocks need not agree. The owner renews every third of it; a
    /// taken-over owner that was alive after all writes nothing more (the lease is fenced).
    #[arg(long, env = "HEARTH_ORPHAN_AFTER_SECS", default_value_t = 5)]
    pub orphan_after_secs: u64,
    /// The statically exported web UI (`make run` builds it) served at `/`.
    #[arg(long, env = "HEARTH_WEB_DIR", default_value = crate::api::DEFAULT_WEB_DIR)]
    pub web_dir: PathBuf,
    /// Sessions one user may keep; creating more answers 422 `too_many_sessions`.
    #[arg(long, env = "HEARTH_MAX_SESSIONS_PER_USER", default_value_t = 10_000)]
    pub max_sessions_per_user: u64,
    /// Messages one session may hold; a turn beyond answers 422 `session_full`.
    #[arg(
        long,
        env = "HEARTH_MAX_MESSAGES_PER_SESSION",
        default_value_t = 10_000
    )]
    pub max_messages_per_session: usize,
    /// Bytes of text one session may hold, its messages together; a turn beyond answers 422
    /// `session_full`.
    #[arg(long, env = "HEARTH_MAX_SESSION_BYTES", default_value_t = 16 << 20)]
    pub max_session_bytes: usize,
    /// Longest stay an ordinary key's `keep_alive` may give a model once idle; it may never
    /// shorten one or unload it (admin keys may). Negative `keep_alive` means this long.
    #[arg(long, env = "HEARTH_MAX_KEEP_ALIVE_SECS", default_value_t = 3600)]
    pub max_keep_alive_secs: u32,
    /// Loads on demand one ordinary key may start in an hour (a request for a repository model
    /// no worker holds); one more is answered 429 with `Retry-After`. Each also counts as a
    /// request of the key's rate limit. Admin keys' loads are not counted.
    #[arg(long, env = "HEARTH_MAX_LOADS_PER_HOUR", default_value_t = 20)]
    pub max_loads_per_hour: u32,
    /// A client has this long from opening a connection (or from the last reply on a kept-alive
    /// one) to the end of a request's header.
    #[arg(long, env = "HEARTH_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// WebSockets one API key may hold open at once; one more is answered 429.
    #[arg(long, env = "HEARTH_MAX_SOCKETS_PER_KEY", default_value_t = 32)]
    pub max_sockets_per_key: usize,
    /// A WebSocket message not written within this long (its client stopped reading) closes
    /// the socket with 1008 and frees its place.
    #[arg(long, env = "HEARTH_SOCKET_WRITE_TIMEOUT_SECS", default_value_t = 30)]
    pub socket_write_timeout_secs: u64,
    /// A WebSocket whose client has sent nothing (not even a pong) for this long is closed
    /// (1001); the time the server spends on the client's last command does not count.
    #[arg(long, env = "HEARTH_SOCKET_IDLE_SECS", default_value_t = 60)]
    pub socket_idle_secs: u64,
    /// A request's body must arrive within this long of its header, or it is answered 408.
    #[arg(long, env = "HEARTH_BODY_TIMEOUT_SECS", default_value_t = 30)]
    pub body_timeout_secs: u64,
    /// Open HTTP connections at most; more wait in the listen backlog [default: the open-files
    /// limit less 512].
    #[arg(long, env = "HEARTH_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// On SIGTERM, how long running replies may take to finish before they are handed over to
    /// another replica (with Redis) or stopped.
    #[arg(long, env = "HEARTH_SHUTDOWN_TIMEOUT_SECS", default_value_t = 30)]
    pub shutdown_timeout_secs: u64,
}

/// Where the workers come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workers {
    /// Workers already running: by gRPC address (`host:port`), and found by DNS.
    Remote {
        addrs: Vec<String>,
        /// The `--worker dns:NAME:PORT` names, if any, and how they are looked up.
        dns: Option<Discovery>,
    },
    /// The quick start: one worker this process starts and stops.
    Local(LocalWorker),
}

/// How to start the quick start's local worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalWorker {
    /// The `hearth-worker` binary.
    pub bin: PathBuf,
    pub models_dir: PathBuf,
    pub model: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub args: Vec<String>,
    /// Given to the worker (`HEARTH_WORKER_TOKEN`): `--worker-token`, else a random one.
    pub token: WorkerToken,
}

/// The orchestrator's checked configuration: what [`crate::server::App::bind`] takes.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// `/metrics` on a listener of its own, off the API's port.
    pub metrics_listen: Option<SocketAddr>,
    pub auth: AuthArg,
    pub workers: Workers,
    pub tokenizer: PathBuf,
    /// `--shared-prompt`s, read.
    pub shared_prompts: Vec<SharedPromptText>,
    pub redis_url: Option<String>,
    pub pool: PoolConfig,
    pub limits: ChatLimits,
    pub api: ApiOptions,
    pub http: HttpLimits,
    /// A `streaming` reply not saved for this long is marked `error`.
    pub orphan_after: Duration,
    /// After SIGTERM, how long running replies may take to finish.
    pub shutdown_timeout: Duration,
}

/// A setting that cannot be served with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {value}: {reason}")]
pub struct ConfigError {
    /// The flag, as the command line spells it.
    pub flag: &'static str,
    pub value: String,
    pub reason: String,
}

fn refuse(flag: &'static str, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// `value` if it is at least `min`, else an error naming `flag`.
fn at_least<T: PartialOrd + ToString>(
    flag: &'static str,
    value: T,
    min: T,
) -> Result<T, ConfigError> {
    if value < min {
        let reason = format!("must be at least {}", min.to_string());
        return Err(refuse(flag, value, reason));
    }
    Ok(value)
}

impl Config {
    /// Checks every setting and resolves the defaults that depend on others (the models
    /// directory, the tokenizer, the local worker's binary).
    pub fn from_args(a: ServeArgs) -> Result<Self, ConfigError> {
        if a.auth == AuthArg::None && !a.listen.ip().is_loopback() {
            return Err(refuse(
                "--listen",
                a.listen,
                "refusing to serve without auth on a non-loopback address; use --auth keys \
                 (and `hearth keys create --user NAME`) or a 127.0.0.1 address",
            ));
        }
        if let Some(url) = &a.redis_url {
            check_redis_url(url)?;
        }
        let models_dir = a.models_dir.clone().unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default()
                .join(".cache/hearth/models")
        });
        let tokenizer = a
            .tokenizer
            .clone()
            .unwrap_or_else(|| models_dir.join(DEFAULT_TOKENIZER));
        let (workers, token) = workers(&a, models_dir)?;
        let (mut pool, limits) = (pool_config(&a)?, chat_limits(&a)?);
        pool.token = token;
        let secs = Duration::from_secs;
        if a.metrics_listen == Some(a.listen) && a.listen.port() != 0 {
            return Err(refuse(
                "--metrics-listen",
                a.listen,
                "is also the API's --listen address; give metrics a port of their own",
            ));
        }
        let shared_prompts = shared_prompts(&a.shared_prompts)?;
        let (api, http) = (api_options(&a)?, http_limits(&a)?);
        Ok(Self {
            listen: a.listen,
            metrics_listen: a.metrics_listen,
            auth: a.auth,
            workers,
            tokenizer,
            shared_prompts,
            redis_url: a.redis_url,
            pool,
            limits,
            api,
            http,
            orphan_after: secs(at_least("--orphan-after-secs", a.orphan_after_secs, 1)?),
            shutdown_timeout: secs(a.shutdown_timeout_secs),
        })
    }
}

/// What the HTTP API does with its requests and sockets.
fn api_options(a: &ServeArgs) -> Result<ApiOptions, ConfigError> {
    let secs = Duration::from_secs;
    Ok(ApiOptions {
        metrics_on_api: a.metrics_listen.is_none(),
        cancel_on_disconnect: a.cancel_on_disconnect,
        web_dir: a.web_dir.clone(),
        body_timeout: secs(at_least("--body-timeout-secs", a.body_timeout_secs, 1)?),
        max_sockets_per_key: at_least("--max-sockets-per-key", a.max_sockets_per_key, 1)?,
        socket_write_timeout: secs(at_least(
            "--socket-write-timeout-secs",
            a.socket_write_timeout_secs,
            1,
        )?),
        socket_idle: secs(at_least("--socket-idle-secs", a.socket_idle_secs, 1)?),
    })
}

/// The HTTP server's limits on connections.
fn http_limits(a: &ServeArgs) -> Result<HttpLimits, ConfigError> {
    let header_timeout = at_least("--header-timeout-secs", a.header_timeout_secs, 1)?;
    Ok(HttpLimits {
        header_timeout: Duration::from_secs(header_timeout),
        max_connections: match a.max_connections {
            Some(n) => at_least("--max-connections", n, 1)?,
            None => crate::http_server::default_max_connections(),
        },
    })
}

/// Most bytes of one shared prompt.
const MAX_SHARED_PROMPT_BYTES: u64 = 256 << 10;

/// Reads each `--shared-prompt NAME=FILE`: a name of letters, digits, `-` and `_`, used once,
/// and a non-empty UTF-8 file of at most 256 KiB.
fn shared_prompts(args: &[String]) -> Result<Vec<SharedPromptText>, ConfigError> {
    const FLAG: &str = "--shared-prompt";
    let mut out: Vec<SharedPromptText> = Vec::new();
    for arg in args {
        let Some((name, file)) = arg.split_once('=') else {
            return Err(refuse(FLAG, arg, "expected NAME=FILE"));
        };
        let name_ok = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !name_ok {
            return Err(refuse(
                FLAG,
                arg,
                "the name must be 1-64 letters, digits, '-' or '_'",
            ));
        }
        if out.iter().any(|p| p.name == name) {
            return Err(refuse(FLAG, arg, "this name is given twice"));
        }
        let len = std::fs::metadata(file)
            .map_err(|e| refuse(FLAG, arg, format!("cannot read {file}: {e}")))?
            .len();
        if len > MAX_SHARED_PROMPT_BYTES {
            return Err(refuse(
                FLAG,
                arg,
                format!("{file} is {len} bytes; at most {MAX_SHARED_PROMPT_BYTES}"),
            ));
        }
        let text = std::fs::read_to_string(file)
            .map_err(|e| refuse(FLAG, arg, format!("cannot read {file}: {e}")))?;
        if text.trim().is_empty() {
            return Err(refuse(FLAG, arg, format!("{file} is empty")));
        }
        out.push(SharedPromptText {
            name: name.to_string(),
            text,
        });
    }
    Ok(out)
}

/// The workers to use, and the token every call to them carries: the `--worker` list with
/// `--worker-token`, or the quick start's local worker with that token or a random one.
fn workers(
    a: &ServeArgs,
    models_dir: PathBuf,
) -> Result<(Workers, Option<WorkerToken>), ConfigError> {
    let token = a
        .worker_token
        .as_deref()
        .map(WorkerToken::new)
        .transpose()
        .map_err(|why| refuse("--worker-token", "(hidden)", why))?;
    if let Some(remote) = remote_workers(a)? {
        return Ok((remote, token));
    }
    let token = match token {
        Some(t) => t,
        None => WorkerToken::random().map_err(|why| refuse("--worker-token", "(random)", why))?,
    };
    let local = LocalWorker {
        token: token.clone(),
        bin: a.worker_bin.clone().unwrap_or_else(default_worker_bin),
        models_dir,
        model: a.model.clone(),
        tokenizer: a.tokenizer.clone(),
        args: a.worker_args.clone(),
    };
    Ok((Workers::Local(local), Some(token)))
}

/// The `--worker` list, checked: `host:port` addresses and `dns:NAME:PORT` names (with how
/// they are looked up); `None` without any (the quick start's local worker).
fn remote_workers(a: &ServeArgs) -> Result<Option<Workers>, ConfigError> {
    let refresh = at_least("--dns-refresh-secs", a.dns_refresh_secs, 1)?;
    let (mut addrs, mut names) = (Vec::new(), Vec::new());
    for w in &a.workers {
        match DnsWorkers::parse(w) {
            Some(dns) => names.push(dns.map_err(|why| refuse("--worker", w, why))?),
            None => {
                check_worker_addr(w)?;
                addrs.push(w.clone());
            }
        }
    }
    if names.is_empty() {
        if let Some(server) = a.dns_server {
            return Err(refuse(
                "--dns-server",
                server,
                "is only asked for --worker dns:NAME:PORT workers, and there are none",
            ));
        }
    }
    if addrs.is_empty() && names.is_empty() {
        return Ok(None);
    }
    let dns = (!names.is_empty()).then(|| Discovery {
        names,
        refresh: Duration::from_secs(refresh),
        server: a.dns_server,
    });
    Ok(Some(Workers::Remote { addrs, dns }))
}

/// Admission, batching and health checks of the worker pool.
fn pool_config(a: &ServeArgs) -> Result<PoolConfig, ConfigError> {
    let secs = Duration::from_secs;
    Ok(PoolConfig {
        batch: BatchConfig {
            max_batch: at_least("--batch-size", a.batch_size, 1)?,
            max_delay: Duration::from_millis(a.batch_delay_ms),
        },
        health_interval: Duration::from_millis(at_least(
            "--health-interval-ms",
            a.health_interval_ms,
            10,
        )?),
        per_worker_capacity: a.worker_capacity,
        max_queue: a.max_queue,
        queue_timeout: secs(a.queue_timeout_secs),
        stall_timeout: secs(at_least("--stall-timeout-secs", a.stall_timeout_secs, 1)?),
        // Set with the workers (see `workers`).
        token: None,
        worker_ca: match &a.worker_ca {
            Some(p) => Some(
                std::fs::read(p)
                    .map_err(|e| refuse("--worker-ca", p.display(), e.to_string()))?
                    .into(),
            ),
            None => None,
        },
    })
}

/// Per-user limits and the defaults of a chat request.
fn chat_limits(a: &ServeArgs) -> Result<ChatLimits, ConfigError> {
    Ok(ChatLimits {
        default_max_tokens: at_least("--default-max-tokens", a.default_max_tokens, 1)?,
        requests_per_minute: a.requests_per_minute.map(i64::from),
        tokens_per_day: a.tokens_per_day.map(i64::from),
        max_sessions_per_user: at_least("--max-sessions-per-user", a.max_sessions_per_user, 1)?,
        // A turn stores two messages.
        max_messages_per_session: at_least(
            "--max-messages-per-session",
            a.max_messages_per_session,
            2,
        )?,
        max_session_bytes: at_least("--max-session-bytes", a.max_session_bytes, 1024)?,
        max_keep_alive_ms: i64::from(a.max_keep_alive_secs) * 1000,
        max_loads_per_hour: i64::from(a.max_loads_per_hour),
    })
}

/// `hearth-worker` next to this executable, else on `PATH`.
fn default_worker_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name("hearth-worker"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("hearth-worker"))
}

/// A worker's gRPC address: `host:port`, without a scheme.
fn check_worker_addr(addr: &str) -> Result<(), ConfigError> {
    let why = if addr.is_empty() {
        Some("a worker address must not be empty")
    } else if addr.contains("://") {
        Some("give the worker as host:port, without a scheme")
    } else {
        match addr.parse::<axum::http::uri::Authority>() {
            Ok(a) if a.port_u16().is_some() && !a.host().is_empty() => None,
            Ok(_) => Some("a worker address needs a port (host:port)"),
            Err(_) => Some("not a host:port address"),
        }
    };
    match why {
        Some(reason) => Err(refuse("--worker", addr, reason)),
        None => Ok(()),
    }
}

/// A Redis URL that names a server (`redis://`, `rediss://`, or a Unix socket); the password in
/// it is masked in the error.
fn check_redis_url(url: &str) -> Result<(), ConfigError> {
    use redis::IntoConnectionInfo;
    url.into_connection_info().map(|_| ()).map_err(|e| {
        refuse(
            "--redis-url",
            redact_url(url),
            format!(
                "not a Redis URL ({})",
                e.detail().unwrap_or("redis://HOST:PORT")
            ),
        )
    })
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;

/// `url` with its password (if any) replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let masked = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                // `redis://secret@host`: the single part is the password.
                "***".to_string()
            };
            format!("{scheme}://{masked}@{host}{tail}")
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url;

    #[test]
    fn passwords_in_urls_are_masked() {
        assert_eq!(
            redact_url("redis://:hunter2@cache:6379/0"),
            "redis://:***@cache:6379/0"
        );
        assert_eq!(
            redact_url("redis://app:hunter2@cache:6379"),
            "redis://app:***@cache:6379"
        );
        assert_eq!(redact_url("redis://hunter2@cache"), "redis://***@cache");
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
