//! Models, as users and operators see them:
//!
//! - [`serving`]: several models and versions across workers, requests routed to the one they
//!   name, progress while a model is fetched, and a model's own tokenizer;
//! - [`lifecycle`]: models loaded and unloaded while the stack serves (admin API, on-demand
//!   loads, `keep_alive`, a reply that outlives its model's unload);
//! - [`repository`]: a model repository's names, versions, context and default parameters.

mod lifecycle;
mod repository;
mod serving;
