//! Constrained decoding: the grammar a reply must follow (any JSON object, a JSON Schema, a Lark
//! grammar or a regular expression), as both APIs take it and as it travels to the worker.
//!
//! Grammars are compiled by llguidance. [`Grammar::check`] compiles one against a byte-level
//! vocabulary, which needs no tokenizer and finds every error of the grammar itself (a schema
//! llguidance does not support, a Lark syntax error, a bad regular expression), so the
//! orchestrator can refuse it before any worker sees it. The worker compiles it again against
//! the model's vocabulary. [`Grammar::check_shape`] is the cheap part (size, a schema's type),
//! for a request's first checks; the compile itself is work (milliseconds to seconds) that the
//! orchestrator runs off its async threads, once the request has been charged, within
//! llguidance's limits and [`MAX_LEXER_STATES`] (its memory).

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::ApproximateTokEnv;
use llguidance::ParserFactory;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Most bytes of a grammar's text (a schema as JSON, a Lark grammar, a pattern).
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;

/// Most lexer states a grammar's check may build (a state takes 1-2 kB): the memory one
/// request's compile may take, a fifth of llguidance's default.
pub const MAX_LEXER_STATES: usize = 50_000;

/// What a reply must be. The reply ends when the grammar is complete and the model ends its
/// turn, or when nothing can follow; a reply cut by `max_tokens` first is incomplete (and says
/// so with the finish reason `length`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// JSON that validates against `schema` (JSON Schema draft 2020-12, as llguidance supports
    /// it: types, properties, required, enum, const, anyOf, oneOf, allOf, $ref, patterns,
    /// formats and bounds).
    JsonSchema {
        #[schema(value_type = Object)]
        schema: Value,
    },
    /// A grammar in llguidance's Lark dialect (its start rule is `start`).
    Lark { grammar: String },
    /// A regular expression (Rust's syntax) that the whole reply matches.
    Regex { pattern: String },
}

/// Why a grammar was refused; the message names the problem as llguidance found it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

impl Grammar {
    /// The grammar as llguidance takes it. JSON is written with single spaces after `,` and
    /// `:`, as models usually write it, and no other whitespace: a model may not pad a reply
    /// with whitespace until it runs out of tokens. A schema's own `x-guidance` options win.
    pub fn to_llguidance(&self) -> TopLevelGrammar {
        let json = |mut schema: Value| {
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance").or_insert_with(|| {
                    serde_json::json!({
                        "whitespace_flexible": false,
                        "item_separator": ", ",
                        "key_separator": ": ",
                    })
                });
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        match self {
            Self::JsonObject => json(serde_json::json!({"type": "object"})),
            Self::JsonSchema { schema } => json(schema.clone()),
            Self::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
            Self::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
        }
    }

    /// Bytes of the grammar's text.
    fn text_len(&self) -> usize {
        match self {
            Self::JsonObject => 0,
            Self::JsonSchema { schema } => schema.to_string().len(),
            Self::Lark { grammar } => grammar.len(),
            Self::Regex { pattern } => pattern.len(),
        }
    }

    /// What can be told without compiling: its size, and that a schema is one.
    pub fn check_shape(&self) -> Result<(), GrammarError> {
        if self.text_len() > MAX_GRAMMAR_BYTES {
            return Err(GrammarError(format!(
                "longer than {MAX_GRAMMAR_BYTES} bytes"
            )));
        }
        if let Self::JsonSchema { schema } = self {
            if !schema.is_object() && !schema.is_boolean() {
                return Err(GrammarError(
                    "a JSON Schema is an object (or true or false)".into(),
                ));
            }
        }
        Ok(())
    }

    /// Compiles the grammar (against a byte-level vocabulary) and reports its first error. Work
    /// for a blocking thread: see the module's documentation.
    pub fn check(&self) -> Result<(), GrammarError> {
        self.check_shape()?;
        let factory = byte_level_factory()?;
        factory
            .create_parser(self.to_llguidance())
            .map(drop)
            .map_err(|e| GrammarError(e.to_string()))
    }
}

/// A parser factory over the 256 single-byte tokens, made once.
fn byte_level_factory() -> Result<Arc<ParserFactory>, GrammarError> {
    static FACTORY: OnceLock<Result<Arc<ParserFactory>, String>> = OnceLock::new();
    FACTORY
        .get_or_init(|| {
            let mut f = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())
                .map_err(|e| e.to_string())?;
            f.quiet();
            f.limits_mut().max_lexer_states = MAX_LEXER_STATES;
            Ok(Arc::new(f))
        })
        .clone()
        .map_err(|e| GrammarError(format!("the grammar engine did not start: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_grammars_compile_and_bad_ones_name_the_problem() {
        let ok = [
            Grammar::JsonObject,
            Grammar::JsonSchema {
                schema: serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            },
            Grammar::Lark {
                grammar: "start: \"yes\" | \"no\"".into(),
            },
            Grammar::Regex {
                pattern: "[0-9]{3}".into(),
            },
        ];
        for g in ok {
            g.check().unwrap_or_else(|e| panic!("{g:?}: {e}"));
        }
        let bad_type = Grammar::JsonSchema {
            schema: serde_json::json!({"type": "objekt"}),
        };
        let e = bad_type.check().expect_err("unknown type");
        assert!(e.0.contains("objekt"), "{e}");
        let not_object = Grammar::JsonSchema {
            schema: serde_json::json!([1]),
        };
        assert!(not_object.check().is_err());
        let lark = Grammar::Lark {
            grammar: "start: (".into(),
        };
        assert!(lark.check().is_err());
        let regex = Grammar::Regex {
            pattern: "[0-9".into(),
        };
        assert!(regex.check().is_err());
        let long = Grammar::Regex {
            pattern: "a".repeat(MAX_GRAMMAR_BYTES + 1),
        };
        assert!(long.check().expect_err("long").0.contains("longer"));
    }

    #[test]
    fn the_api_shape_is_tagged_by_type() {
        let g: Grammar =
            serde_json::from_value(serde_json::json!({"type": "regex", "pattern": "a+"}))
                .expect("regex");
        assert_eq!(
            g,
            Grammar::Regex {
                pattern: "a+".into()
            }
        );
        let unknown =
            serde_json::from_value::<Grammar>(serde_json::json!({"type": "regex", "regexp": "a"}));
        assert!(unknown.is_err());
    }
}
