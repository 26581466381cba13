//! Whole-stack tests and the `hearth-bench` load generator live here once the orchestrator exists.
//! The engine's own tests are in `gpu-worker/tests`.
