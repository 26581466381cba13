//! `hearth-worker serve --repository`: a name or version the repository does not hold stops the
//! worker before it listens, with a message that lists what it does hold; a manifest that biases
//! a token outside the model's vocabulary stops it once the model is loaded. (Serving a model
//! from a repository is tested through the whole stack, in `tests/tests/repository.rs`.)

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
    let bad = root.join("tiny/3/manifest.json");
    std::fs::write(&bad, r#"{"params": {"logit_bias": {"999999": 5}}}"#).expect("manifest");
    let (ok, _, err) = run(&root, "tiny@3");
    assert!(!ok, "a bias outside the vocabulary was served");
    assert!(
        err.contains("params.logit_bias: token 999999 is not in the model's vocabulary"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(root);
}
