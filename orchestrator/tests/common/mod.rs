//! Helpers shared by the orchestrator's integration tests (each test binary uses a part).
#![allow(dead_code)]

pub mod http;
pub mod pg;
pub mod stack;
