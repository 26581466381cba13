//! Operators' shared system prompts: the one exception to the per-user prefix cache.
//!
//! Workers cache prompt prefixes per user (the user id salts the hash chain), so that no user can
//! learn from `cached_tokens` what another sent. An operator who gives every user the same long
//! system prompt pays for it once per user that way. `--shared-prompt NAME=FILE` names such a
//! prompt: a request whose prompt begins with that system prompt's rendering tells the worker how
//! many of its leading tokens are operator text, and the worker caches those for everyone.
//!
//! Only operator text is ever shared. The shared tokens are the part of a rendered conversation
//! that depends on the system prompt alone: rendered before two different first user messages,
//! the tokens the two renderings have in common. A request shares at most its common run with
//! those tokens, so whatever a user writes (even text that repeats the operator's prompt) stays
//! behind the user's own salt.

use hearth_shared::chat::{render, ChatError as TemplateError, Message, Role};
use hearth_shared::tokenizer::Tokenizer;

/// An operator's shared system prompt, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPromptText {
    pub name: String,
    pub text: String,
}

/// The shared prompts' leading tokens, ready to match prompts against.
#[derive(Debug, Clone, Default)]
pub struct SharedPrompts {
    prompts: Vec<(String, Vec<u32>)>,
}

impl SharedPrompts {
    /// Renders each prompt as the system prompt of a conversation, with the model's template.
    pub fn new(tok: &Tokenizer, texts: &[SharedPromptText]) -> Result<Self, TemplateError> {
        let mut prompts = Vec::with_capacity(texts.len());
        for t in texts {
            let with = |first: &str| {
                let convo = [
                    Message::new(Role::System, t.text.as_str()),
                    Message::new(Role::User, first),
                ];
                render(tok, &convo, usize::MAX).map(|p| p.tokens)
            };
            let (a, b) = (with("a")?, with("b")?);
            let common = common_run(&a, &b);
            prompts.push((t.name.clone(), a[..common].to_vec()));
        }
        Ok(Self { prompts })
    }

    /// How many leading tokens of `prompt` are a shared prompt's operator text, and its name;
    /// `None` when the prompt begins with none of them.
    pub fn leading(&self, prompt: &[u32]) -> Option<(&str, usize)> {
        self.prompts
            .iter()
            .map(|(name, tokens)| (name.as_str(), common_run(tokens, prompt)))
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n > 0)
    }

    /// The prompts' names and token counts, for the start-up log.
    pub fn summary(&self) -> Vec<(String, usize)> {
        self.prompts
            .iter()
            .map(|(name, tokens)| (name.clone(), tokens.len()))
            .collect()
    }
}

/// The length of the longest common leading run of `a` and `b`.
fn common_run(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_run_stops_at_the_first_difference() {
        assert_eq!(common_run(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_run(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_run(&[], &[1]), 0);
    }

    #[test]
    fn the_longest_matching_prompt_wins_and_none_matches_nothing() {
        let p = SharedPrompts {
            prompts: vec![
                ("short".into(), vec![2, 5, 6]),
                ("long".into(), vec![2, 5, 7, 8, 9]),
            ],
        };
        assert_eq!(p.leading(&[2, 5, 7, 8, 1, 1]), Some(("long", 4)));
        assert_eq!(p.leading(&[2, 5, 6, 6]), Some(("short", 3)));
        // A prompt that goes past a shared prompt's tokens shares only those.
        assert_eq!(p.leading(&[2, 5, 7, 8, 9, 9, 9]), Some(("long", 5)));
        assert_eq!(p.leading(&[3, 5]), None);
        assert_eq!(SharedPrompts::default().leading(&[2, 5]), None);
    }
}
