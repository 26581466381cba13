//! A test's model files: a temporary directory with a tiny generated model and its tokenizer.

use std::path::{Path, PathBuf};

use hearth_worker::fixtures::{write_tiny_gguf, write_tiny_tokenizer, TinySpec};

/// A temporary directory with a tiny model and its tokenizer.
#[derive(Debug)]
pub struct Assets {
    pub dir: PathBuf,
    pub model: PathBuf,
    pub tokenizer: PathBuf,
}

impl Assets {
    /// A SQLite database in the directory, created on first use.
    pub fn sqlite_url(&self) -> String {
        format!("sqlite://{}?mode=rwc", self.dir.join("hearth.db").display())
    }

    /// `hearth`'s arguments for a server without keys on this SQLite database and tokenizer,
    /// its workers checked every 100 ms, then `extra`; no workers (the test adds its own).
    pub fn open_args(&self, extra: &[&str]) -> Vec<String> {
        let fixed = [
            "--database-url",
            &self.sqlite_url(),
            "--tokenizer",
            &path(&self.tokenizer),
            "--auth",
            "none",
            "--health-interval-ms",
            "100",
        ]
        .map(str::to_string);
        fixed
            .into_iter()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    }
}

/// A model big enough that a long reply takes seconds, so a test can act while it streams.
pub fn slow_spec() -> TinySpec {
    TinySpec {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        head_dim: 64,
        ffn: 2048,
        ..TinySpec::default()
    }
}

pub fn assets(tag: &str) -> Assets {
    assets_with(tag, &TinySpec::default())
}

pub fn assets_with(tag: &str, spec: &TinySpec) -> Assets {
    let dir = std::env::temp_dir().join(format!(
        "hearth-{tag}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("tiny.gguf");
    write_tiny_gguf(&model, spec).expect("tiny model");
    let tokenizer = dir.join("tiny-tokenizer.json");
    write_tiny_tokenizer(&tokenizer, TinySpec::default().vocab).expect("tiny tokenizer");
    Assets {
        dir,
        model,
        tokenizer,
    }
}

pub fn path(p: &Path) -> String {
    p.display().to_string()
}
