//! `hearth`, the orchestrator. Not built yet: the HTTP API, storage and routing arrive with the
//! orchestrator issue. Until then this binary says so and exits with an error.

fn main() -> std::process::ExitCode {
    eprintln!(
        "hearth: the orchestrator is not built yet; the engine is usable via `hearth-worker bench`"
    );
    std::process::ExitCode::FAILURE
}
