//! A certificate authority of a test's own, made with the `openssl` command: a CA certificate
//! and a server certificate for `127.0.0.1` signed by it, for PostgreSQL and Redis servers that
//! a test starts with TLS on.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA and one server certificate (for the IP address 127.0.0.1), in a temporary directory
/// removed when dropped.
#[derive(Debug)]
pub struct TestCa {
    pub dir: PathBuf,
    /// The CA certificate a client trusts.
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command is required for this test");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    pub fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("hearth-ca-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut ca_args = vec!["req", "-x509"];
        ca_args.extend(ec);
        ca_args.extend([
            "-days",
            "2",
            "-subj",
            "/CN=Hearth test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&dir, &ca_args);
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend([
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        openssl(&dir, &req);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )
        .expect("extensions");
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.pem",
            ],
        );
        Self {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            dir,
        }
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
