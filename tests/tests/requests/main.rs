//! What a request may ask, and how the server answers it, on both APIs:
//!
//! - [`honoured`]: generation options are honoured end to end, not only accepted;
//! - [`refusals`]: requests the server must refuse, each with its documented answer and nothing
//!   stored or charged;
//! - [`bad_input`]: malformed requests, generated from a seed, each a documented 4xx that changes
//!   nothing stored.

mod bad_input;
mod honoured;
mod refusals;
