//! Redis for the tests: the shared server's address ([`redis_url`]), and a `redis-server` of a
//! test's own which the test can stop and start again ([`RedisServer`]; the shared one on 6379
//! must stay up for every other test).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// The shared Redis (`TEST_REDIS_URL`, default the local server).
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// `redis-server` on a free port, without persistence; killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> Self {
        let mut r = Self {
            port: free_port(),
            child: None,
        };
        r.resume();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A `redis-server` that speaks TLS only, with the server certificate of `ca` (clients are
    /// not asked for one); its `rediss://` URL.
    pub fn start_tls(ca: &crate::tls::TestCa) -> (Self, String) {
        let port = free_port();
        let arg = |p: &std::path::Path| p.display().to_string();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--tls-cert-file", &arg(&ca.server_cert)])
            .args(["--tls-key-file", &arg(&ca.server_key)])
            .args(["--tls-ca-cert-file", &arg(&ca.ca)])
            .args([
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is required for this test");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let server = Self {
            port,
            child: Some(child),
        };
        (server, format!("rediss://127.0.0.1:{port}"))
    }

    /// Starts it (again, on the same port) and waits until it answers PING.
    pub fn resume(&mut self) {
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is required for this test");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ping() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not answer within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = [0u8; 7];
        c.write_all(b"PING\r\n").is_ok() && c.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
