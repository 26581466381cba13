//! `hearth-worker serve --repository`: a model named in the repository is served under its
//! name and version, and a name or version the repository does not hold stops the worker before
//! it listens, with a message that lists what it does hold.

use std::path::Path;

use hearth_worker::fixtures::{write_tiny_gguf, TinySpec};

fn run(root: &Path, model: &str) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-worker"))
        .args(["serve", "--model", model, "--repository"])
        .arg(root)
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn names_the_repository_does_not_hold_are_refused_before_listening() {
    let root = std::env::temp_dir().join(format!("hearth-repo-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for v in ["1", "3"] {
        let dir = root.join("tiny").join(v);
        std::fs::create_dir_all(&dir).expect("dir");
        write_tiny_gguf(&dir.join("tiny.gguf"), &TinySpec::default()).expect("model");
    }
    for (model, says) in [
        ("nope", "model `nope` is not in the repository"),
        ("tiny@2", "model `tiny` has no version `2` (it has: 1, 3)"),
        ("https://h/x.gguf", "a URL is not a model of --repository"),
    ] {
        let (ok, out, err) = run(&root, model);
        assert!(!ok, "{model} was served");
        assert!(out.is_empty(), "{model}: it listened: {out}");
        assert!(err.contains(says), "{model}: {err}");
    }
    let _ = std::fs::remove_dir_all(root);
}
