//! A real Prometheus server (Debian's `prometheus` package, or `$PROMETHEUS_BIN`) on a loopback
//! port with a temporary data directory, scraping the targets a test gives it, and a client for
//! its HTTP query API.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::http::Req;

/// One scrape job: its name and `host:port` targets.
#[derive(Debug, Clone)]
pub struct Job {
    pub name: String,
    pub targets: Vec<String>,
}

/// A running `prometheus`; killed and its directory removed when dropped.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

/// Percent-encodes a query-string value.
pub fn encode(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

impl Prometheus {
    /// Starts Prometheus scraping `jobs` every `scrape` with `rule_files` loaded, and waits
    /// until it is ready.
    pub async fn start(jobs: &[Job], rule_files: &[&Path], scrape: Duration) -> Self {
        let bin =
            std::env::var_os("PROMETHEUS_BIN").map_or_else(|| "prometheus".into(), PathBuf::from);
        let dir = std::env::temp_dir().join(format!(
            "hearth-prometheus-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(dir.join("data")).expect("prometheus temp dir");
        let secs = scrape.as_secs_f64();
        let mut config = format!(
            "global:\n  scrape_interval: {secs}s\n  evaluation_interval: {secs}s\nrule_files:\n"
        );
        for f in rule_files {
            let _ = writeln!(config, "  - {}", f.display());
        }
        config.push_str("scrape_configs:\n");
        for j in jobs {
            let targets: Vec<String> = j.targets.iter().map(|t| format!("\"{t}\"")).collect();
            let _ = writeln!(
                config,
                "  - job_name: {}\n    static_configs:\n      - targets: [{}]",
                j.name,
                targets.join(", ")
            );
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).expect("prometheus config");
        let addr = SocketAddr::from(([127, 0, 0, 1], crate::free_port()));
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log file");
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `{}` ({e}): install Debian's `prometheus` package \
                     (`apt-get install prometheus`; .ci/run does) or set PROMETHEUS_BIN",
                    bin.display()
                )
            });
        let mut p = Self { child, addr, dir };
        for _ in 0..300 {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("prometheus exited ({status}):\n{}", p.log());
            }
            let listening = tokio::net::TcpStream::connect(addr).await.is_ok();
            if listening && Req::new("GET", "/-/ready").send(addr).await.status == 200 {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("prometheus never became ready:\n{}", p.log());
    }

    /// What Prometheus wrote on stderr (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` on the API; the JSON `data`, or the error Prometheus gave.
    pub async fn api(&self, path: &str) -> Result<Value, String> {
        let r = Req::new("GET", path).send(self.addr).await;
        let v = r.json();
        if v["status"] == "success" {
            Ok(v["data"].clone())
        } else {
            Err(format!(
                "{} {}: {}",
                r.status,
                v["errorType"].as_str().unwrap_or(""),
                v["error"].as_str().map_or_else(|| r.text(), str::to_string)
            ))
        }
    }

    /// An instant query: the result vector, or Prometheus's error (a parse error names the
    /// position).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .await?;
        match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => {
                Ok(data["result"].as_array().cloned().unwrap_or_default())
            }
            // A scalar or string is one value.
            Some(_) => Ok(vec![data["result"].clone()]),
            None => Err(format!("no result type in {data}")),
        }
    }

    /// Values of `label` on series of `metric` (Grafana's `label_values(metric, label)`).
    pub async fn label_values(&self, metric: &str, label: &str) -> Result<Vec<String>, String> {
        let data = self
            .api(&format!(
                "/api/v1/label/{label}/values?match[]={}",
                encode(metric)
            ))
            .await?;
        Ok(data
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
