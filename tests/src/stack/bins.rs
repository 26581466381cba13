//! The binaries a stack runs, found next to the running test (`target/<profile>/`), and refused
//! when they are older than the sources they are built from.

use std::path::{Path, PathBuf};

/// `target/<profile>/<name>`: next to the running test's directory (`target/<profile>/deps`), or
/// to the running binary (`hearth-chaos`); `cargo test --workspace` builds every binary there.
/// Refuses a binary older than the sources it is built from (a `cargo test -p hearth-e2e` after
/// an edit elsewhere would otherwise test yesterday's code).
fn sibling_bin(name: &str, package: &str, sources: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let dir = exe.parent().expect("target dir");
    let dir = match dir.file_name() {
        Some(d) if d == "deps" => dir.parent().expect("target dir"),
        _ => dir,
    };
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build -p {package}` (or `make test`)",
        bin.display()
    );
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let newest = sources
        .iter()
        .chain(COMMON_SOURCES.iter())
        .filter_map(|d| newest_source(&root.join(d)))
        .max();
    if let (Some(built), Some((changed, file))) = (built, newest) {
        assert!(
            changed <= built,
            "{} is older than {}: run `cargo build -p {package}` (or `make test`)",
            bin.display(),
            file.display()
        );
    }
    bin
}

/// The most recently modified source file (Rust, proto, SQL, Cargo.toml) under `dir`.
fn newest_source(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    if dir.is_file() {
        let t = std::fs::metadata(dir).and_then(|m| m.modified()).ok()?;
        return Some((t, dir.to_path_buf()));
    }
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                // `src/bin/*` are other binaries, named one by one where they count; a crate's
                // tests, benchmarks and examples are not in its binaries at all.
                let skipped = p.file_name().is_some_and(|n| {
                    matches!(n.to_str(), Some("bin" | "tests" | "benches" | "examples"))
                });
                if !skipped {
                    stack.push(p);
                }
                continue;
            }
            let source = p
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| matches!(x, "rs" | "proto" | "sql"))
                || p.file_name().is_some_and(|n| n == "Cargo.toml");
            if !source {
                continue;
            }
            if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                if newest.as_ref().is_none_or(|(n, _)| t > *n) {
                    newest = Some((t, p));
                }
            }
        }
    }
    newest
}

/// What every binary is built from besides its own crate: the shared crate and its build
/// script (the generated gRPC types), and the locked dependency versions.
const COMMON_SOURCES: [&str; 5] = [
    "shared/src",
    "shared/build.rs",
    "shared/Cargo.toml",
    "proto",
    "Cargo.lock",
];
/// `migrations/` is embedded in `hearth` at build time.
const ORCHESTRATOR_SOURCES: &[&str] = &[
    "orchestrator/src",
    "orchestrator/build.rs",
    "orchestrator/Cargo.toml",
    "migrations",
];
const WORKER_SOURCES: &[&str] = &["gpu-worker/src", "gpu-worker/Cargo.toml"];
const E2E_SOURCES: &[&str] = &[
    "tests/src",
    "tests/Cargo.toml",
    "orchestrator/src",
    "orchestrator/build.rs",
    "migrations",
    "gpu-worker/src",
];

pub fn worker_bin() -> PathBuf {
    sibling_bin("hearth-worker", "hearth-worker", WORKER_SOURCES)
}

pub fn hearth_bin() -> PathBuf {
    sibling_bin("hearth", "hearth-orchestrator", ORCHESTRATOR_SOURCES)
}

pub fn bench_bin() -> PathBuf {
    let sources = [E2E_SOURCES, &["tests/src/bin/hearth-bench.rs"]].concat();
    sibling_bin("hearth-bench", "hearth-e2e", &sources)
}

pub fn stack_bin() -> PathBuf {
    let sources = [E2E_SOURCES, &["tests/src/bin/hearth-stack.rs"]].concat();
    sibling_bin("hearth-stack", "hearth-e2e", &sources)
}
