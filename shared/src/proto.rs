//! The orchestrator ⇄ worker gRPC contract, generated from `proto/hearth/worker/v1/worker.proto`,
//! and its conversions to and from the domain types.

#[allow(clippy::all, clippy::unwrap_used, missing_debug_implementations)]
mod generated {
    tonic::include_proto!("hearth.worker.v1");
}

pub use generated::*;

/// The metadata key of a worker's refusal that may be retried later (a load whose room only
/// models used too recently could make): whole seconds to wait.
pub const RETRY_AFTER_KEY: &str = "hearth-retry-after-secs";

// The domain types under other names: the generated module has its own `FinishReason` and
// `SamplingParams`, which must stay the ones this module exports.
use crate::{FinishReason as DomainFinish, SamplingParams as DomainSampling};

impl From<DomainFinish> for generated::FinishReason {
    fn from(r: DomainFinish) -> Self {
        match r {
            DomainFinish::Stop => Self::Stop,
            DomainFinish::Length => Self::Length,
            DomainFinish::ContextFull => Self::ContextFull,
            DomainFinish::Cancelled => Self::Cancelled,
        }
    }
}

/// A proto finish reason that names no domain reason (unset or from a newer peer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("finish reason {0} is not one this build knows")]
pub struct UnknownFinishReason(pub i32);

impl TryFrom<generated::FinishReason> for DomainFinish {
    type Error = UnknownFinishReason;

    fn try_from(r: generated::FinishReason) -> Result<Self, Self::Error> {
        match r {
            generated::FinishReason::Stop => Ok(Self::Stop),
            generated::FinishReason::Length => Ok(Self::Length),
            generated::FinishReason::ContextFull => Ok(Self::ContextFull),
            generated::FinishReason::Cancelled => Ok(Self::Cancelled),
            generated::FinishReason::Unspecified => Err(UnknownFinishReason(r as i32)),
        }
    }
}

impl Finished {
    /// The domain finish reason; an unknown wire value is an error, not a guess.
    pub fn finish_reason(&self) -> Result<DomainFinish, UnknownFinishReason> {
        generated::FinishReason::try_from(self.reason)
            .map_err(|_| UnknownFinishReason(self.reason))
            .and_then(DomainFinish::try_from)
    }
}

impl From<&DomainSampling> for generated::SamplingParams {
    fn from(p: &DomainSampling) -> Self {
        Self {
            temperature: Some(p.temperature),
            top_k: Some(p.top_k),
            top_p: Some(p.top_p),
            min_p: Some(p.min_p),
            repetition_penalty: Some(p.repetition_penalty),
            seed: p.seed,
            presence_penalty: Some(p.presence_penalty),
            frequency_penalty: Some(p.frequency_penalty),
            logit_bias: p.logit_bias.iter().map(|(&t, &b)| (t, b)).collect(),
            dry_multiplier: Some(p.dry_multiplier),
            dry_base: Some(p.dry_base),
            dry_allowed_length: Some(p.dry_allowed_length),
            dry_penalty_last_n: Some(p.dry_penalty_last_n),
        }
    }
}

/// Unset fields take the domain defaults. Ranges are checked by [`crate::SamplingParams::validate`].
impl From<generated::SamplingParams> for DomainSampling {
    fn from(p: generated::SamplingParams) -> Self {
        let d = DomainSampling::default();
        Self {
            temperature: p.temperature.unwrap_or(d.temperature),
            top_k: p.top_k.unwrap_or(d.top_k),
            top_p: p.top_p.unwrap_or(d.top_p),
            min_p: p.min_p.unwrap_or(d.min_p),
            repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
            seed: p.seed,
            presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
            logit_bias: p.logit_bias.into_iter().collect(),
            dry_multiplier: p.dry_multiplier.unwrap_or(d.dry_multiplier),
            dry_base: p.dry_base.unwrap_or(d.dry_base),
            dry_allowed_length: p.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: p.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            // The worker reads the breakers as token ids (GenerateRequest::dry_breaker_ids).
            dry_sequence_breakers: d.dry_sequence_breakers,
        }
    }
}

impl From<&crate::Grammar> for generated::Grammar {
    fn from(g: &crate::Grammar) -> Self {
        use generated::grammar::Kind;
        let kind = match g {
            crate::Grammar::JsonObject => Kind::JsonObject(true),
            crate::Grammar::JsonSchema { schema } => Kind::JsonSchema(schema.to_string()),
            crate::Grammar::Lark { grammar } => Kind::Lark(grammar.clone()),
            crate::Grammar::Regex { pattern } => Kind::Regex(pattern.clone()),
        };
        Self { kind: Some(kind) }
    }
}

/// A wire grammar that is empty, or whose schema is not JSON.
impl TryFrom<generated::Grammar> for crate::Grammar {
    type Error = crate::GrammarError;

    fn try_from(g: generated::Grammar) -> Result<Self, Self::Error> {
        use generated::grammar::Kind;
        match g.kind {
            None => Err(crate::GrammarError("the grammar names no kind".into())),
            Some(Kind::JsonObject(_)) => Ok(Self::JsonObject),
            Some(Kind::JsonSchema(text)) => serde_json::from_str(&text)
                .map(|schema| Self::JsonSchema { schema })
                .map_err(|e| crate::GrammarError(format!("the JSON Schema is not JSON: {e}"))),
            Some(Kind::Lark(grammar)) => Ok(Self::Lark { grammar }),
            Some(Kind::Regex(pattern)) => Ok(Self::Regex { pattern }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FinishReason, SamplingParams};

    #[test]
    fn finish_reasons_round_trip_and_unknown_values_are_errors() {
        for r in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::ContextFull,
            FinishReason::Cancelled,
        ] {
            let wire = Finished {
                reason: generated::FinishReason::from(r) as i32,
                ..Default::default()
            };
            assert_eq!(wire.finish_reason(), Ok(r));
        }
        for bad in [0, 99] {
            let wire = Finished {
                reason: bad,
                ..Default::default()
            };
            assert_eq!(wire.finish_reason(), Err(UnknownFinishReason(bad)));
        }
    }

    #[test]
    fn sampling_params_round_trip_and_unset_fields_default() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            seed: Some(7),
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            logit_bias: [(3, -100.0), (900, 2.5)].into(),
            dry_multiplier: 0.8,
            dry_base: 2.0,
            dry_allowed_length: 3,
            dry_penalty_last_n: 512,
            ..SamplingParams::default()
        };
        assert_eq!(SamplingParams::from(generated::SamplingParams::from(&p)), p);
        assert_eq!(
            SamplingParams::from(generated::SamplingParams::default()),
            SamplingParams::default()
        );
    }

    #[test]
    fn grammars_round_trip_and_a_kindless_one_is_refused() {
        for g in [
            crate::Grammar::JsonObject,
            crate::Grammar::JsonSchema {
                schema: serde_json::json!({"type": "array", "items": {"enum": [1, "a"]}}),
            },
            crate::Grammar::Lark {
                grammar: "start: \"a\"".into(),
            },
            crate::Grammar::Regex {
                pattern: "x+".into(),
            },
        ] {
            let wire = generated::Grammar::from(&g);
            assert_eq!(crate::Grammar::try_from(wire), Ok(g));
        }
        assert!(crate::Grammar::try_from(generated::Grammar::default()).is_err());
        let not_json = generated::Grammar {
            kind: Some(generated::grammar::Kind::JsonSchema("{".into())),
        };
        assert!(crate::Grammar::try_from(not_json).is_err());
    }
}
