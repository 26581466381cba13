//! The processes a chaos run breaks: a PostgreSQL server and a Redis of the run's own (so both
//! can be restarted), orchestrator replicas on fixed ports, each reaching PostgreSQL and Redis
//! through a proxy of its own (so one replica can be cut off), and workers on fixed ports.
//! Every process can be killed (`kill -9`) and started again on its port, or stopped
//! (`SIGSTOP`) and continued.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hearth_worker::fixtures::WorkerProcess;

use crate::http::Req;
use crate::pg::PgServer;
use crate::proxy::Proxy;
use crate::redis::RedisServer;
use crate::stack::{hearth_bin, worker_bin, WORKER_TOKEN};

/// The replicas' `RUST_LOG`: `HEARTH_CHAOS_LOG` when set (`hearth_orchestrator=debug` to
/// follow each reply), else warnings only.
fn replica_log_filter() -> String {
    std::env::var("HEARTH_CHAOS_LOG").unwrap_or_else(|_| "warn".into())
}

/// What the workers run.
#[derive(Debug, Clone)]
pub enum Model {
    /// No model: a token every `token_ms` (continuing a cut reply as a greedy model does).
    Scripted { model: PathBuf, token_ms: u64 },
    /// A GGUF file, run for real.
    File(PathBuf),
}

/// A process of the run, by its index among its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proc {
    Replica(usize),
    Worker(usize),
}

impl std::fmt::Display for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Replica(i) => write!(f, "replica {i}"),
            Self::Worker(i) => write!(f, "worker {i}"),
        }
    }
}

/// Which of a replica's links a cut parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Postgres,
    Redis,
}

struct Replica {
    addr: SocketAddr,
    child: Option<Child>,
    postgres: Proxy,
    redis: Proxy,
}

struct Worker {
    listen: String,
    process: Option<WorkerProcess>,
}

/// The run's processes.
pub struct Cluster {
    pub pg: PgServer,
    /// The database, reached directly (not through a proxy): for keys and the final check.
    pub db_url: String,
    pub redis: RedisServer,
    replicas: Vec<Replica>,
    workers: Vec<Worker>,
    model: Model,
    tokenizer: PathBuf,
    orphan_after_secs: u64,
    logs: PathBuf,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("replicas", &self.replica_addrs())
            .finish_non_exhaustive()
    }
}

/// How the cluster is made.
#[derive(Debug, Clone)]
pub struct Shape {
    pub replicas: usize,
    pub workers: usize,
    pub model: Model,
    pub tokenizer: PathBuf,
    pub orphan_after_secs: u64,
    /// Where each process's log goes (`replica-<i>.log`, `worker-<i>.log`).
    pub logs: PathBuf,
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Cluster {
    /// Starts PostgreSQL, Redis, the workers, then the replicas, and waits until every replica
    /// is ready with every worker.
    pub async fn start(shape: Shape) -> Self {
        std::fs::create_dir_all(&shape.logs).expect("log directory");
        let pg = tokio::task::spawn_blocking(|| PgServer::start("chaos"))
            .await
            .expect("PostgreSQL");
        let db_url = pg.create_database("hearth").await;
        let redis = tokio::task::spawn_blocking(RedisServer::start)
            .await
            .expect("Redis");
        let pg_addr = port_of(&db_url);
        let redis_addr = port_of(&redis.url());
        let mut replicas = Vec::new();
        for _ in 0..shape.replicas {
            replicas.push(Replica {
                addr: loopback(crate::free_port()),
                child: None,
                postgres: Proxy::start(pg_addr).await,
                redis: Proxy::start(redis_addr).await,
            });
        }
        let workers = (0..shape.workers)
            .map(|_| Worker {
                listen: format!("127.0.0.1:{}", crate::free_port()),
                process: None,
            })
            .collect();
        let mut c = Self {
            pg,
            db_url,
            redis,
            replicas,
            workers,
            model: shape.model,
            tokenizer: shape.tokenizer,
            orphan_after_secs: shape.orphan_after_secs,
            logs: shape.logs,
        };
        for i in 0..c.workers.len() {
            c.start_proc(Proc::Worker(i)).await;
        }
        for i in 0..c.replicas.len() {
            c.start_proc(Proc::Replica(i)).await;
        }
        for i in 0..c.replicas.len() {
            c.wait_ready(i, Duration::from_secs(120)).await;
        }
        c
    }

    pub fn replica_addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|r| r.addr).collect()
    }

    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Starts the process (again, on its own port).
    pub async fn start_proc(&mut self, p: Proc) {
        match p {
            Proc::Replica(i) => {
                let child = self.spawn_replica(i);
                self.replicas[i].child = Some(child);
            }
            Proc::Worker(i) => {
                let (bin, model, flags) = self.worker_command();
                let listen = self.workers[i].listen.clone();
                let log = self.log(&format!("worker-{i}.log"));
                let process = tokio::task::spawn_blocking(move || {
                    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
                    WorkerProcess::spawn_logged(&bin, &model, &listen, &flags, log)
                })
                .await
                .expect("worker task")
                .unwrap_or_else(|e| panic!("start worker {i}: {e}"));
                self.workers[i].process = Some(process);
            }
        }
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(name))
            .expect("log file")
    }

    fn worker_command(&self) -> (PathBuf, PathBuf, Vec<String>) {
        let mut flags = vec![
            "--worker-token".to_string(),
            WORKER_TOKEN.to_string(),
            "--drain-timeout-secs".into(),
            "1".into(),
        ];
        let model = match &self.model {
            Model::Scripted { model, token_ms } => {
                flags.extend(["--kv-budget".into(), "64MiB".into()]);
                flags.extend(["--scripted-token-ms".into(), token_ms.to_string()]);
                model.clone()
            }
            Model::File(model) => model.clone(),
        };
        (worker_bin(), model, flags)
    }

    fn spawn_replica(&self, i: usize) -> Child {
        let r = &self.replicas[i];
        let database = format!("postgres://postgres@{}/hearth", r.postgres.addr);
        let mut cmd = Command::new(hearth_bin());
        cmd.args(["--listen", &r.addr.to_string()])
            .args(["--database-url", &database])
            .args(["--redis-url", &format!("redis://{}", r.redis.addr)])
            .args(["--tokenizer", &self.tokenizer.display().to_string()])
            .args(["--auth", "keys", "--health-interval-ms", "100"])
            .args(["--orphan-after-secs", &self.orphan_after_secs.to_string()]);
        for w in &self.workers {
            cmd.args(["--worker", &w.listen]);
        }
        cmd.env("RUST_LOG", replica_log_filter())
            .env("HEARTH_WORKER_TOKEN", WORKER_TOKEN)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.log(&format!("replica-{i}.log")))
            .spawn()
            .expect("start hearth")
    }

    /// Waits until replica `i` answers `/readyz` with 200.
    pub async fn wait_ready(&self, i: usize, within: Duration) {
        let addr = self.replicas[i].addr;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let r = Req::new("GET", "/readyz")
                .try_send(addr, Duration::from_secs(2))
                .await;
            if r.is_ok_and(|r| r.status == 200) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "replica {i} at {addr} never became ready"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn pid(&self, p: Proc) -> Option<u32> {
        match p {
            Proc::Replica(i) => self.replicas[i].child.as_ref().map(Child::id),
            Proc::Worker(i) => self.workers[i].process.as_ref().map(|w| w.child.id()),
        }
    }

    /// `kill -9`, and reaps it.
    pub fn kill(&mut self, p: Proc) {
        match p {
            Proc::Replica(i) => {
                if let Some(mut c) = self.replicas[i].child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            Proc::Worker(i) => {
                // Dropping the process kills and reaps it.
                self.workers[i].process.take();
            }
        }
    }

    /// Sends `SIGSTOP` (`stop`) or `SIGCONT`.
    pub fn pause(&self, p: Proc, stop: bool) {
        if let Some(pid) = self.pid(p) {
            let sig = if stop { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: kill(2) on a child this process started and has not reaped.
            unsafe { libc::kill(pid as i32, sig) };
        }
    }

    /// Parts replica `i` from PostgreSQL or Redis (`on`), or mends the link.
    pub fn cut(&self, i: usize, link: Link, on: bool) {
        let r = &self.replicas[i];
        match link {
            Link::Postgres => r.postgres.cut(on),
            Link::Redis => r.redis.cut(on),
        }
    }

    /// Kills Redis (it keeps nothing) and starts it again on its port.
    pub async fn restart_redis(&mut self, down: Duration) {
        self.redis.kill();
        tokio::time::sleep(down).await;
        tokio::task::block_in_place(|| self.redis.resume());
    }

    /// Stops PostgreSQL (open connections are terminated) and starts it again.
    pub async fn restart_pg(&mut self, down: Duration) {
        tokio::task::block_in_place(|| self.pg.stop());
        tokio::time::sleep(down).await;
        tokio::task::block_in_place(|| self.pg.resume());
    }

    /// Whether every process runs (none killed and not started again yet).
    pub fn all_up(&self) -> bool {
        self.replicas.iter().all(|r| r.child.is_some())
            && self.workers.iter().all(|w| w.process.is_some())
    }

    /// Continues every stopped process and starts every killed one, and mends every link.
    pub async fn heal(&mut self) {
        for i in 0..self.replicas.len() {
            self.cut(i, Link::Postgres, false);
            self.cut(i, Link::Redis, false);
            self.pause(Proc::Replica(i), false);
        }
        for i in 0..self.workers.len() {
            self.pause(Proc::Worker(i), false);
            if self.workers[i].process.is_none() {
                self.start_proc(Proc::Worker(i)).await;
            }
        }
        for i in 0..self.replicas.len() {
            if self.replicas[i].child.is_none() {
                self.start_proc(Proc::Replica(i)).await;
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.replicas.len() {
            self.pause(Proc::Replica(i), false);
            self.kill(Proc::Replica(i));
        }
        for i in 0..self.workers.len() {
            self.pause(Proc::Worker(i), false);
            self.kill(Proc::Worker(i));
        }
    }
}

/// The `127.0.0.1:<port>` of a URL.
fn port_of(url: &str) -> SocketAddr {
    let host = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split(['/', '?']).next())
        .map(|h| h.rsplit('@').next().unwrap_or(h))
        .expect("a host in the URL");
    host.parse().expect("a loopback address")
}

/// Where the whole-stack tests' models are (`$HEARTH_MODELS_DIR`, else the user's cache).
pub fn models_dir() -> PathBuf {
    std::env::var_os("HEARTH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/hearth/models")
        })
}

/// The real model and its tokenizer, if fetched.
pub fn real_model() -> Option<(PathBuf, PathBuf)> {
    let dir = models_dir();
    let model = dir.join("gemma-3-270m-q4_k_m.gguf");
    let tokenizer = dir.join("gemma-3-tokenizer.json");
    (model.is_file() && tokenizer.is_file()).then_some((model, tokenizer))
}
