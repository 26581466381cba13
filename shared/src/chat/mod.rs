//! Turning a conversation into model input and model output back into text: the Gemma chat
//! template with context fitting ([`template`]), incremental detokenization that never splits a
//! UTF-8 character ([`detokenize`]), and stop strings that may span tokens ([`stop`]).

pub mod detokenize;
pub mod stop;
pub mod template;

pub use detokenize::Detokenizer;
pub use stop::StopMatcher;
pub use template::{render, ChatError, Message, Prompt, Role};
