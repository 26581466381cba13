//! PostgreSQL for the tests: a database of its own for one test on the shared server
//! ([`PgDatabase`]; `TEST_DATABASE_URL`, default the local server), or a whole server of the
//! test's own on a free port that it may stop and start again ([`PgServer`]; `initdb` and
//! `pg_ctl`, run as the `postgres` OS user when the tests run as root, since PostgreSQL refuses
//! root). A missing PostgreSQL fails the test.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use sqlx::Connection;

fn admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database of its own for one test run, dropped afterwards.
#[derive(Debug)]
pub struct PgDatabase {
    name: String,
}

impl PgDatabase {
    pub async fn create(tag: &str) -> (Self, String) {
        let admin = admin_url();
        let name = format!(
            "hearth_test_{tag}_{}_{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        );
        let mut c = sqlx::PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {admin} is required for this test: {e}"));
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .expect("create test database");
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(b, _)| b)
            .to_string();
        (Self { name: name.clone() }, format!("{base}/{name}"))
    }

    pub async fn drop_db(self) {
        let mut c = sqlx::PgConnection::connect(&admin_url())
            .await
            .expect("connect");
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut c)
        .await
        .expect("drop test database");
    }
}

/// A directory holding `initdb`, `pg_ctl` and `postgres`: `$PATH` first, then the Debian layout.
fn pg_bin_dir() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file());
    if let Some(d) = on_path {
        return d;
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| entries.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    versions.retain(|d| d.join("initdb").is_file());
    versions.sort();
    versions.pop().expect(
        "PostgreSQL's initdb and pg_ctl are required for this test \
         (not on $PATH nor in /usr/lib/postgresql/*/bin)",
    )
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// PostgreSQL's tools refuse to run as root; as root they run as the `postgres` OS user.
fn postgres_user_ids() -> Option<(u32, u32)> {
    if command_output("id", &["-u"])? != "0" {
        return None;
    }
    let uid = command_output("id", &["-u", "postgres"]).and_then(|s| s.parse().ok());
    let gid = command_output("id", &["-g", "postgres"]).and_then(|s| s.parse().ok());
    match (uid, gid) {
        (Some(u), Some(g)) => Some((u, g)),
        _ => panic!(
            "this test runs as root, which PostgreSQL refuses, and there is no `postgres` OS user \
             to run initdb and pg_ctl as (create one, or run the tests as another user)"
        ),
    }
}

/// A PostgreSQL server of this test's own, on a free port, that the test stops and starts.
#[derive(Debug)]
pub struct PgServer {
    base: PathBuf,
    bin: PathBuf,
    port: u16,
    /// Run the tools as the `postgres` OS user.
    as_postgres: bool,
}

impl PgServer {
    pub fn start(tag: &str) -> Self {
        let bin = pg_bin_dir();
        let ids = postgres_user_ids();
        let base = std::env::temp_dir().join(format!(
            "hearth-pg-{tag}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&base).expect("temp dir");
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(&base, Some(uid), Some(gid)).expect("chown to postgres");
        }
        let pg = Self {
            base,
            bin,
            port: crate::free_port(),
            as_postgres: ids.is_some(),
        };
        pg.tool(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        pg.resume();
        pg
    }

    /// Like [`start`](Self::start), with TLS on (the server certificate of `ca`) and plain
    /// connections refused (`hostnossl … reject`).
    pub fn start_tls(tag: &str, ca: &crate::tls::TestCa) -> Self {
        let pg = Self::start(tag);
        pg.stop();
        let data = PathBuf::from(pg.data());
        for (from, to) in [
            (&ca.server_cert, "server.crt"),
            (&ca.server_key, "server.key"),
        ] {
            let dest = data.join(to);
            std::fs::copy(from, &dest).expect("copy the certificate");
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o600)).expect("chmod");
            if let Some((uid, gid)) = postgres_user_ids() {
                std::os::unix::fs::chown(&dest, Some(uid), Some(gid)).expect("chown");
            }
        }
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        std::fs::write(&conf, text).expect("write postgresql.conf");
        let hba = data.join("pg_hba.conf");
        let rules = std::fs::read_to_string(&hba).expect("pg_hba.conf");
        let tls_only =
            "hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n";
        std::fs::write(&hba, format!("{tls_only}{rules}")).expect("write pg_hba.conf");
        pg.resume();
        pg
    }

    fn data(&self) -> String {
        self.base.join("data").display().to_string()
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs one of PostgreSQL's tools (as `postgres` if need be) and fails the test if it fails.
    fn tool(&self, name: &str, args: &[&str]) {
        let program = self.bin.join(name);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        // The test's own directory may not be readable by `postgres`.
        cmd.args(args)
            .current_dir(&self.base)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = match cmd.output() {
            Err(e) if self.as_postgres && e.kind() == std::io::ErrorKind::NotFound => {
                // No runuser: `su` does the same.
                let line = std::iter::once(program.display().to_string())
                    .chain(args.iter().map(|a| a.to_string()))
                    .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
                    .collect::<Vec<_>>()
                    .join(" ");
                Command::new("su")
                    .args(["postgres", "-s", "/bin/sh", "-c", &line])
                    .current_dir(&self.base)
                    .stdin(Stdio::null())
                    .output()
            }
            other => other,
        }
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
        let log = std::fs::read_to_string(self.base.join("server.log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "{name} {args:?} failed ({}):\n{}{}\nserver log:\n{log}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }

    /// Starts the server and waits until it accepts connections.
    pub fn resume(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.base.display()
        );
        let log = self.base.join("server.log").display().to_string();
        self.tool(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
    }

    /// Stops the server (`-m fast`: open connections are terminated) and waits until it is down.
    pub fn stop(&self) {
        self.tool(
            "pg_ctl",
            &["-D", &self.data(), "-m", "fast", "-w", "-t", "120", "stop"],
        );
    }

    pub async fn create_database(&self, name: &str) -> String {
        let mut c = sqlx::PgConnection::connect(&self.url("postgres"))
            .await
            .expect("connect to the private PostgreSQL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .expect("create database");
        c.close().await.expect("close");
        self.url(name)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let data = self.data();
        let program = self.bin.join("pg_ctl");
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&program)
                .args(args)
                .current_dir(&self.base)
                .output()
        } else {
            Command::new(&program).args(args).output()
        };
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
