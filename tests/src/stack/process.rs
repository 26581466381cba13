//! The stack's processes: workers (with the tiny model or scripted), `hearth` on a port the OS
//! chose, and the signals and exits a test sends and waits for.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hearth_worker::fixtures::WorkerProcess;

use super::{worker_bin, Assets};
use crate::http::Req;

/// The flags test workers run with: a KV budget that suits the tiny model.
pub(super) const WORKER_FLAGS: [&str; 2] = ["--kv-budget", "64MiB"];

/// The worker token of every stack: its workers require it and its `hearth` sends it, so every
/// whole-stack test goes through the authenticated gRPC link.
pub const WORKER_TOKEN: &str = "hearth-test-worker-token-0123456789";

/// A worker on `model` with `flags`, requiring [`WORKER_TOKEN`].
pub fn worker_with(model: &Path, flags: &[&str]) -> WorkerProcess {
    let mut args = vec!["--worker-token", WORKER_TOKEN];
    args.extend_from_slice(flags);
    WorkerProcess::spawn(&worker_bin(), model, &args).expect("start worker")
}

/// [`worker_with`], its gRPC service on `listen` (`127.0.0.2:0`, or a port another worker has
/// on another loopback address: workers on several hosts share one).
pub fn worker_at(model: &Path, listen: &str, flags: &[&str]) -> WorkerProcess {
    let mut args = vec!["--worker-token", WORKER_TOKEN];
    args.extend_from_slice(flags);
    WorkerProcess::spawn_at(&worker_bin(), model, listen, &args)
        .unwrap_or_else(|e| panic!("start a worker on {listen}: {e}"))
}

pub fn spawn_worker(a: &Assets) -> WorkerProcess {
    worker_with(&a.model, &WORKER_FLAGS)
}

/// A worker that gives every request one token per `token_ms` milliseconds (no model is run).
pub fn scripted_worker(model: &Path, token_ms: u64) -> WorkerProcess {
    let ms = token_ms.to_string();
    worker_with(model, &["--scripted-token-ms", &ms])
}

/// Resident memory of a process, in bytes (Linux).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A `hearth` process; killed when dropped.
#[derive(Debug)]
pub struct Hearth {
    pub child: Child,
    pub addr: SocketAddr,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Hearth {
    /// Starts `hearth` with `args` (plus a loopback port the OS chose) and reads its address.
    pub fn spawn(args: &[String]) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(super::hearth_bin())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .env("HEARTH_WORKER_TOKEN", WORKER_TOKEN)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start hearth");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("address line");
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("hearth printed `{line}` instead of its address: {e}"));
        let addr = v["listening"]["http"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in `{line}`"));
        Self {
            child,
            addr,
            _stdout: stdout,
        }
    }

    /// Waits until `/readyz` says every worker is ready (not only the first, so a test that
    /// kills one knows another can take over).
    pub async fn wait_ready(&self) {
        for _ in 0..600 {
            let r = Req::new("GET", "/readyz").send(self.addr).await;
            let all = r.json()["workers"]
                .as_array()
                .is_some_and(|w| w.iter().all(|w| w["ready"] == true));
            if r.status == 200 && all {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("hearth at {} never became ready", self.addr);
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Hearth {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends a POSIX signal to a child process (SIGSTOP, SIGCONT, SIGTERM…).
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child this process started and has not reaped.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill({}, {sig})", child.id());
}

/// Polls a child every 50 ms until it exits; its exit status, or `None` if it is still running
/// at `deadline`.
pub async fn wait_exit(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
