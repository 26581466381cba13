//! A model repository: a directory of models, each with its versions.
//!
//! ```text
//! <repository>/
//!   gemma-3-270m/            a model's name
//!     1/                     a version (a directory name)
//!       model.gguf           the weights: one .gguf file, or a safetensors checkpoint
//!       tokenizer.json       optional
//!       manifest.json        optional
//!     2/
//!       …
//! ```
//!
//! A version holds one GGUF file, or `config.json` with `*.safetensors` (a checkpoint, loaded as
//! the directory). `manifest.json`, when present, may give `display_name`, `context_length` (a
//! cap on the model's own), `chat_template` (`gemma`, the one template Hearth renders) and
//! `params` (default sampling parameters for requests that give none). Unknown fields are
//! refused, so a misspelt one does not silently do nothing.
//!
//! `name` names the newest version: versions compare as numbers where they are numbers (`10` is
//! newer than `9`), part by part (`1.10` after `1.9`), and as text otherwise. `name@version`
//! pins one.

use std::path::{Path, PathBuf};

pub use hearth_shared::versions::compare_versions;

use hearth_shared::SamplingParams;
use serde::Deserialize;

/// A version's optional `manifest.json`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// For people (`/v1/models`, the web UI); the model's name when absent.
    #[serde(default)]
    pub display_name: Option<String>,
    /// Most tokens of context to serve: at most the model's own.
    #[serde(default)]
    pub context_length: Option<u32>,
    /// The chat template: only `gemma` today.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Default sampling parameters for requests that set none: the fields given, as given
    /// (checked as [`SamplingParams`]).
    #[serde(default)]
    pub params: Option<serde_json::Map<String, serde_json::Value>>,
}

/// The chat templates the orchestrator renders.
pub const CHAT_TEMPLATES: &[&str] = &["gemma"];

/// One version of one model, found on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelVersion {
    pub name: String,
    pub version: String,
    /// A GGUF file, or a safetensors checkpoint directory.
    pub weights: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub manifest: Manifest,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RepoError {
    #[error("model repository {0}: not a directory")]
    NotADirectory(String),
    #[error("model `{name}` is not in the repository {root} (it holds: {known})")]
    UnknownModel {
        name: String,
        root: String,
        known: String,
    },
    #[error("model `{name}` has no version `{version}` (it has: {known})")]
    UnknownVersion {
        name: String,
        version: String,
        known: String,
    },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

fn invalid(path: &Path, reason: impl Into<String>) -> RepoError {
    RepoError::Invalid {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Names of the entries of `dir` that are directories, sorted; hidden ones are skipped.
fn subdirs(dir: &Path) -> Result<Vec<String>, RepoError> {
    let entries = std::fs::read_dir(dir).map_err(|e| invalid(dir, e.to_string()))?;
    let mut out: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| !n.starts_with('.'))
        .collect();
    out.sort();
    Ok(out)
}

/// A model repository on disk.
#[derive(Debug, Clone)]
pub struct Repository {
    root: PathBuf,
}

impl Repository {
    pub fn open(root: &Path) -> Result<Self, RepoError> {
        if !root.is_dir() {
            return Err(RepoError::NotADirectory(root.display().to_string()));
        }
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    /// The models' names, sorted.
    pub fn models(&self) -> Result<Vec<String>, RepoError> {
        subdirs(&self.root)
    }

    /// A model's versions, oldest first.
    pub fn versions(&self, name: &str) -> Result<Vec<String>, RepoError> {
        let dir = self.root.join(name);
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') || !dir.is_dir() {
            return Err(RepoError::UnknownModel {
                name: name.to_string(),
                root: self.root.display().to_string(),
                known: self.models()?.join(", "),
            });
        }
        let mut v = subdirs(&dir)?;
        v.sort_by(|a, b| compare_versions(a, b));
        Ok(v)
    }

    /// `name` (its newest version) or `name@version`, with its files and manifest checked.
    pub fn resolve(&self, spec: &str) -> Result<ModelVersion, RepoError> {
        let (name, pinned) = match spec.split_once('@') {
            Some((n, v)) => (n, Some(v)),
            None => (spec, None),
        };
        let versions = self.versions(name)?;
        let version = match pinned {
            Some(v) if versions.iter().any(|x| x == v) => v.to_string(),
            None if !versions.is_empty() => versions[versions.len() - 1].clone(),
            _ => {
                return Err(RepoError::UnknownVersion {
                    name: name.to_string(),
                    version: pinned.unwrap_or("(any)").to_string(),
                    known: versions.join(", "),
                })
            }
        };
        self.version(name, &version)
    }

    /// The files of `name`'s `version`.
    fn version(&self, name: &str, version: &str) -> Result<ModelVersion, RepoError> {
        let dir = self.root.join(name).join(version);
        let weights = weights_in(&dir)?;
        let tokenizer = Some(dir.join("tokenizer.json")).filter(|t| t.is_file());
        let manifest_path = dir.join("manifest.json");
        let manifest = if manifest_path.is_file() {
            read_manifest(&manifest_path)?
        } else {
            Manifest::default()
        };
        Ok(ModelVersion {
            name: name.to_string(),
            version: version.to_string(),
            weights,
            tokenizer,
            manifest,
        })
    }
}

/// The version's weights: its one GGUF file, or the directory when it is a safetensors
/// checkpoint.
fn weights_in(dir: &Path) -> Result<PathBuf, RepoError> {
    let entries = std::fs::read_dir(dir).map_err(|e| invalid(dir, e.to_string()))?;
    let mut gguf = Vec::new();
    let mut safetensors = false;
    for e in entries.flatten() {
        let p = e.path();
        match p.extension().and_then(|x| x.to_str()) {
            Some("gguf") => gguf.push(p),
            Some("safetensors") => safetensors = true,
            _ => {}
        }
    }
    gguf.sort();
    match (gguf.as_slice(), safetensors) {
        ([one], false) => Ok(one.clone()),
        ([], true) if dir.join("config.json").is_file() => Ok(dir.to_path_buf()),
        ([], true) => Err(invalid(dir, "safetensors without config.json")),
        ([], false) => Err(invalid(
            dir,
            "no weights (a .gguf file or a safetensors checkpoint)",
        )),
        _ => Err(invalid(
            dir,
            "more than one set of weights; a version holds one .gguf file or one checkpoint",
        )),
    }
}

fn read_manifest(path: &Path) -> Result<Manifest, RepoError> {
    let text = std::fs::read_to_string(path).map_err(|e| invalid(path, e.to_string()))?;
    let m: Manifest = serde_json::from_str(&text).map_err(|e| invalid(path, e.to_string()))?;
    if let Some(t) = m.chat_template.as_deref() {
        if !CHAT_TEMPLATES.contains(&t) {
            return Err(invalid(
                path,
                format!(
                    "chat_template: `{t}` is not one Hearth renders ({})",
                    CHAT_TEMPLATES.join(", ")
                ),
            ));
        }
    }
    if m.context_length == Some(0) {
        return Err(invalid(path, "context_length: must be at least 1"));
    }
    if let Some(p) = &m.params {
        let parsed: SamplingParams = serde_json::from_value(serde_json::Value::Object(p.clone()))
            .map_err(|e| invalid(path, format!("params: {e}")))?;
        parsed
            .validate()
            .map_err(|e| invalid(path, format!("params.{}: {}", e.field, e.reason)))?;
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "hearth-repo-{tag}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    fn file(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().expect("parent")).expect("dir");
        std::fs::write(p, text).expect("write");
    }

    #[test]
    fn a_name_finds_its_newest_version_and_a_pin_finds_its_own() {
        let root = dir("resolve");
        file(&root.join("tiny/2/tiny.gguf"), "x");
        file(&root.join("tiny/10/m.gguf"), "x");
        file(&root.join("tiny/10/tokenizer.json"), "{}");
        file(
            &root.join("tiny/10/manifest.json"),
            r#"{"display_name": "Tiny", "context_length": 64, "chat_template": "gemma",
                "params": {"temperature": 0.5}}"#,
        );
        file(&root.join("other/1/config.json"), "{}");
        file(&root.join("other/1/model.safetensors"), "x");
        let repo = Repository::open(&root).expect("repo");
        assert_eq!(repo.models().expect("models"), ["other", "tiny"]);
        let newest = repo.resolve("tiny").expect("newest");
        assert_eq!(newest.version, "10");
        assert_eq!(newest.weights, root.join("tiny/10/m.gguf"));
        assert_eq!(newest.tokenizer, Some(root.join("tiny/10/tokenizer.json")));
        assert_eq!(newest.manifest.display_name.as_deref(), Some("Tiny"));
        assert_eq!(newest.manifest.context_length, Some(64));
        assert_eq!(
            newest
                .manifest
                .params
                .as_ref()
                .map(|p| p["temperature"].clone()),
            Some(serde_json::json!(0.5))
        );
        let pinned = repo.resolve("tiny@2").expect("pinned");
        assert_eq!(
            (pinned.version.as_str(), pinned.tokenizer.is_none()),
            ("2", true)
        );
        assert_eq!(pinned.manifest, Manifest::default());
        assert_eq!(
            repo.resolve("other").expect("checkpoint").weights,
            root.join("other/1")
        );
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        let root = dir("refuse");
        file(&root.join("tiny/1/a.gguf"), "x");
        file(&root.join("two/1/a.gguf"), "x");
        file(&root.join("two/1/b.gguf"), "x");
        file(&root.join("empty/1/notes.txt"), "x");
        file(&root.join("bad/1/m.gguf"), "x");
        file(&root.join("bad/1/manifest.json"), r#"{"display": "x"}"#);
        file(&root.join("tmpl/1/m.gguf"), "x");
        file(
            &root.join("tmpl/1/manifest.json"),
            r#"{"chat_template": "chatml"}"#,
        );
        file(&root.join("hot/1/m.gguf"), "x");
        file(
            &root.join("hot/1/manifest.json"),
            r#"{"params": {"temperature": -1}}"#,
        );
        let repo = Repository::open(&root).expect("repo");
        let e = repo.resolve("nope").expect_err("unknown");
        assert!(
            matches!(&e, RepoError::UnknownModel { known, .. } if known.contains("tiny")),
            "{e}"
        );
        let e = repo.resolve("tiny@7").expect_err("unknown version");
        assert_eq!(e.to_string(), "model `tiny` has no version `7` (it has: 1)");
        for (spec, says) in [
            ("two", "more than one set of weights"),
            ("empty", "no weights"),
            ("bad", "unknown field `display`"),
            ("tmpl", "chat_template: `chatml`"),
            ("hot", "params.temperature"),
        ] {
            let e = repo.resolve(spec).expect_err(spec);
            assert!(e.to_string().contains(says), "{spec}: {e}");
        }
        for spec in ["../tiny", ".hidden", ""] {
            assert!(
                matches!(repo.resolve(spec), Err(RepoError::UnknownModel { .. })),
                "{spec}"
            );
        }
        assert!(Repository::open(&root.join("missing")).is_err());
        let _ = std::fs::remove_dir_all(root);
    }
}
