//! The OpenAI-compatible API: `POST /v1/chat/completions` (streaming and not, with structured
//! outputs, tools, log-probabilities and several choices), `POST /v1/responses` and
//! `GET /v1/models`. Stateless:
//! nothing is stored, and a client that goes away cancels its generation. Fields Hearth cannot
//! honour are refused with a 422 that names them rather than silently ignored; fields that do
//! not change the output (`metadata`, …) are accepted.
//!
//! - `wire`: the request and the answer as clients see them;
//! - `chat`: `POST /v1/chat/completions`;
//! - `stream`: streamed choices as chunks;
//! - `completions`: the legacy `POST /v1/completions`;
//! - `models`: `GET /v1/models`;
//! - `responses`: `POST /v1/responses`, stateless;
//! - `tokenize`: `POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

pub(super) mod chat;
mod chunk;
pub(super) mod completions;
pub(super) mod models;
pub(super) mod responses;
pub(super) mod stream;
pub(super) mod tokenize;
pub(super) mod wire;
