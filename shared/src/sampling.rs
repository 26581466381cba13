//! Per-request sampling parameters, validated once at the edge.

use serde::{Deserialize, Serialize};

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
    /// Seed for the request's own RNG: the same seed, prompt and parameters give the same output.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
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
        Ok(())
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
        ];
        for (params, field) in cases {
            let err = params.validate().expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.to_string().contains(field));
        }
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err = serde_json::from_str::<SamplingParams>(r#"{"temprature": 1.0}"#).unwrap_err();
        assert!(err.to_string().contains("temprature"));
    }
}
