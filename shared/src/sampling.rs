//! Per-request sampling parameters, validated once at the edge.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Most entries of `logit_bias` (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Most `dry_sequence_breakers`, and most characters in one.
pub const MAX_DRY_BREAKERS: usize = 16;
pub const MAX_DRY_BREAKER_CHARS: usize = 32;

/// How the next token is chosen. `temperature == 0` means greedy (argmax).
/// The ranges in its schema are the ones [`SamplingParams::validate`] enforces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 is greedy (argmax).
    #[schema(minimum = 0, maximum = 100, default = 0)]
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    #[schema(default = 0)]
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p`; 1 disables.
    #[schema(exclusive_minimum = 0, maximum = 1, default = 1)]
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one; 0 disables.
    #[schema(minimum = 0, maximum = 1, default = 0)]
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of tokens already seen; 1 disables.
    #[schema(exclusive_minimum = 0, maximum = 10, default = 1)]
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the reply already holds (OpenAI's); 0 disables.
    #[schema(minimum = -2, maximum = 2, default = 0)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the reply already holds it; 0 disables.
    #[schema(minimum = -2, maximum = 2, default = 0)]
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids (keys), each in [-100, 100]; at most 300.
    /// -100 bans a token, 100 all but forces it.
    pub logit_bias: BTreeMap<u32, f32>,
    /// DRY ("don't repeat yourself", llama.cpp's parameters): a token that would continue a run
    /// of `n > dry_allowed_length` tokens already seen earlier in the context, followed by that
    /// token, loses `dry_multiplier * dry_base^(n - dry_allowed_length)` from its logit. 0
    /// disables.
    #[schema(minimum = 0, maximum = 10, default = 0)]
    pub dry_multiplier: f32,
    #[schema(minimum = 1, maximum = 10, default = 1.75)]
    pub dry_base: f32,
    /// Repeated runs up to this long go unpenalized.
    #[schema(minimum = 1, maximum = 1024, default = 2)]
    pub dry_allowed_length: u32,
    /// How many of the latest tokens DRY looks back over; -1: the whole context, 0: none.
    #[schema(minimum = -1, default = -1)]
    pub dry_penalty_last_n: i32,
    /// A run never extends across a token whose text contains one of these (at most 16, each
    /// of 1 to 32 characters): a repeated line or list item does not grow a penalty from the
    /// one before.
    #[schema(default = json!(["\n", ":", "\"", "*"]))]
    pub dry_sequence_breakers: Vec<String>,
    /// Seed for the request's own RNG: the same seed, prompt and parameters give the same output.
    pub seed: Option<u64>,
}

/// llama.cpp's default DRY sequence breakers.
pub fn default_dry_breakers() -> Vec<String> {
    ["\n", ":", "\"", "*"].map(String::from).to_vec()
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: default_dry_breakers(),
            seed: None,
        }
    }
}

/// A sampling parameter out of range; the message names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}`: {reason}")]
pub struct SamplingError {
    pub field: &'static str,
    pub reason: String,
}

fn check(
    ok: bool,
    field: &'static str,
    reason: impl FnOnce() -> String,
) -> Result<(), SamplingError> {
    if ok {
        Ok(())
    } else {
        Err(SamplingError {
            field,
            reason: reason(),
        })
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Rejects NaN, infinities and out-of-range values.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        check(
            t.is_finite() && (0.0..=100.0).contains(&t),
            "temperature",
            || format!("must be a finite number in [0, 100], got {t}"),
        )?;
        let p = self.top_p;
        check(p.is_finite() && p > 0.0 && p <= 1.0, "top_p", || {
            format!("must be in (0, 1], got {p}")
        })?;
        let m = self.min_p;
        check(m.is_finite() && (0.0..=1.0).contains(&m), "min_p", || {
            format!("must be in [0, 1], got {m}")
        })?;
        let r = self.repetition_penalty;
        check(
            r.is_finite() && r > 0.0 && r <= 10.0,
            "repetition_penalty",
            || format!("must be in (0, 10], got {r}"),
        )?;
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            check(v.is_finite() && (-2.0..=2.0).contains(&v), field, || {
                format!("must be in [-2, 2], got {v}")
            })?;
        }
        self.validate_logit_bias()?;
        self.validate_dry()
    }

    fn validate_logit_bias(&self) -> Result<(), SamplingError> {
        let n = self.logit_bias.len();
        check(n <= MAX_LOGIT_BIAS, "logit_bias", || {
            format!("at most {MAX_LOGIT_BIAS} tokens, got {n}")
        })?;
        for (&token, &b) in &self.logit_bias {
            check(
                b.is_finite() && (-100.0..=100.0).contains(&b),
                "logit_bias",
                || format!("token {token}: the bias must be in [-100, 100], got {b}"),
            )?;
        }
        Ok(())
    }

    fn validate_dry(&self) -> Result<(), SamplingError> {
        let m = self.dry_multiplier;
        check(
            m.is_finite() && (0.0..=10.0).contains(&m),
            "dry_multiplier",
            || format!("must be in [0, 10], got {m}"),
        )?;
        let b = self.dry_base;
        check(
            b.is_finite() && (1.0..=10.0).contains(&b),
            "dry_base",
            || format!("must be in [1, 10], got {b}"),
        )?;
        let a = self.dry_allowed_length;
        check((1..=1024).contains(&a), "dry_allowed_length", || {
            format!("must be in [1, 1024], got {a}")
        })?;
        let n = self.dry_penalty_last_n;
        check(n >= -1, "dry_penalty_last_n", || {
            format!("must be -1 (the whole context), 0 (none) or more, got {n}")
        })?;
        let breakers = &self.dry_sequence_breakers;
        check(
            breakers.len() <= MAX_DRY_BREAKERS,
            "dry_sequence_breakers",
            || format!("at most {MAX_DRY_BREAKERS}, got {}", breakers.len()),
        )?;
        for (i, s) in breakers.iter().enumerate() {
            let chars = s.chars().count();
            check(
                (1..=MAX_DRY_BREAKER_CHARS).contains(&chars),
                "dry_sequence_breakers",
                || format!("[{i}] must be 1 to {MAX_DRY_BREAKER_CHARS} characters, got {chars}"),
            )?;
        }
        Ok(())
    }

    /// Whether DRY changes anything.
    pub fn dry_enabled(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_penalty_last_n != 0
    }

    /// Whether any penalty or bias changes the logits before the pick.
    pub fn modifies_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.dry_enabled()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_greedy() {
        let p = SamplingParams::default();
        assert!(p.validate().is_ok());
        assert!(p.is_greedy());
    }

    #[test]
    fn rejects_out_of_range_values_naming_the_field() {
        let cases = [
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.1,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::INFINITY,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: [(5, 101.0)].into(),
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    logit_bias: (0..301).map(|t| (t, 1.0)).collect(),
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    dry_multiplier: -0.5,
                    ..Default::default()
                },
                "dry_multiplier",
            ),
            (
                SamplingParams {
                    dry_base: 0.5,
                    ..Default::default()
                },
                "dry_base",
            ),
            (
                SamplingParams {
                    dry_allowed_length: 0,
                    ..Default::default()
                },
                "dry_allowed_length",
            ),
            (
                SamplingParams {
                    dry_penalty_last_n: -2,
                    ..Default::default()
                },
                "dry_penalty_last_n",
            ),
            (
                SamplingParams {
                    dry_sequence_breakers: vec![String::new()],
                    ..Default::default()
                },
                "dry_sequence_breakers",
            ),
        ];
        for (params, field) in cases {
            let err = params.validate().expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.to_string().contains(field));
        }
    }

    #[test]
    fn logit_bias_keys_are_token_ids_and_dry_defaults_are_llama_cpps() {
        let p: SamplingParams = serde_json::from_str(
            r#"{"logit_bias": {"17": -100, "2": 5.5}, "dry_multiplier": 0.8}"#,
        )
        .expect("parses");
        assert_eq!(p.logit_bias, [(2, 5.5), (17, -100.0)].into());
        assert!(p.validate().is_ok() && p.dry_enabled() && p.modifies_logits());
        assert_eq!((p.dry_base, p.dry_allowed_length), (1.75, 2));
        assert_eq!(p.dry_sequence_breakers, ["\n", ":", "\"", "*"]);
        assert!(!SamplingParams::default().modifies_logits());
        let err = serde_json::from_str::<SamplingParams>(r#"{"logit_bias": {"x": 1}}"#);
        assert!(err.is_err(), "a key that is not a token id");
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<SamplingParams>(r#"{"temprature": 1.0}"#).unwrap_err();
        assert!(err.to_string().contains("temprature"));
    }
}
