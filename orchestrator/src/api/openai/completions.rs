//! OpenAI's legacy text completions, `POST /v1/completions`: a prompt sent as it is (text, or
//! token ids), without the chat template, as evaluation harnesses and older clients send it.
//! Stateless, like the chat completions it shares its sampling, choices and streaming with.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hearth_shared::{Grammar, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::chat::{finished_choices, Head};
use super::stream::{streamed, Shape, StopOnDrop};
use super::wire::{refuse, requested_grammar, ResponseFormat, StopField, Usage};
use crate::api::{ApiError, AppState, ValidJson};
use crate::generate::OpenAiFinish;
use crate::generate::Outcome;
use crate::service::{Caller, GenOptions, ModelDefaults, RawPrompt, ValidTurn, MAX_CHOICES};

/// Most alternatives the legacy `logprobs` asks for per token (OpenAI's limit).
const MAX_LEGACY_LOGPROBS: u32 = 5;

/// OpenAI's text completion request. Fields that do not change the output (`metadata`, …) are
/// accepted; those Hearth cannot honour are refused by name.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// A served model's name, as `/v1/models` lists it (its newest ready version), or
    /// `name@version` for one version; another is a 404 `model_not_found`. Absent: the default
    /// model (the first `/v1/models` lists).
    #[serde(default)]
    model: Option<String>,
    /// Text, token ids, or a list of one of them.
    #[schema(value_type = Object)]
    prompt: PromptField,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamUsage>,
    /// Longest reply (OpenAI's default: 16).
    #[serde(default)]
    #[schema(minimum = 1)]
    max_tokens: Option<u32>,
    /// OpenAI's default, 1, when absent; 0 is greedy.
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    logit_bias: Option<std::collections::BTreeMap<u32, f32>>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    #[schema(value_type = Option<crate::api::openapi::StopList>)]
    stop: Option<StopField>,
    /// Choices to generate (1 to 16).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 16)]
    n: Option<u32>,
    /// Only equal to `n` (or 1): Hearth does not rank extra candidates.
    #[serde(default)]
    best_of: Option<u32>,
    /// The prompt's text before each choice's.
    #[serde(default)]
    echo: bool,
    /// Refused: inserting text before a suffix is not supported.
    #[serde(default)]
    suffix: Option<String>,
    /// This many likeliest alternatives per generated token (0 to 5), with each token's own.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 5)]
    logprobs: Option<u32>,
    /// Non-standard (vLLM, llama.cpp): generate exactly `max_tokens`.
    #[serde(default)]
    ignore_eos: bool,
    /// The end user the request is for, as on the chat API.
    #[serde(default)]
    user: Option<String>,
    /// Non-standard (Ollama): how long, in seconds, the model stays loaded once idle, from
    /// this request on; negative keeps it for good, 0 unloads it as soon as it is idle. It
    /// applies to models from a worker's repository, which load again on demand.
    #[serde(default)]
    keep_alive: Option<f64>,
    /// Non-standard: the grammar the completion follows (JSON Schema, Lark or a regular
    /// expression), as on the chat API.
    #[serde(default)]
    grammar: Option<Grammar>,
    /// Non-standard here (vLLM's): `json_object` or `json_schema`, as on the chat API.
    #[serde(default)]
    response_format: Option<ResponseFormat>,
}

#[derive(Debug, Deserialize, ToSchema)]
struct StreamUsage {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl CompletionRequest {
    fn prompt(&self) -> Result<RawPrompt, ApiError> {
        let one = "only one prompt per request is supported";
        Ok(match &self.prompt {
            PromptField::Text(t) => RawPrompt::text(t.clone())?,
            PromptField::Tokens(ids) => RawPrompt::tokens(ids.clone())?,
            PromptField::Texts(v) => match v.as_slice() {
                [t] => RawPrompt::text(t.clone())?,
                _ => return Err(refuse("prompt", one)),
            },
            PromptField::TokenLists(v) => match v.as_slice() {
                [ids] => RawPrompt::tokens(ids.clone())?,
                _ => return Err(refuse("prompt", one)),
            },
        })
    }

    fn check_supported(&self) -> Result<u32, ApiError> {
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(refuse(
                "suffix",
                "inserting text before a suffix is not supported",
            ));
        }
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_CHOICES).contains(&n) {
            return Err(refuse(
                "n",
                &format!("must be 1 to {MAX_CHOICES} choices, got {n}"),
            ));
        }
        if self.best_of.is_some_and(|b| b != n && b != 1) {
            return Err(refuse(
                "best_of",
                "only equal to n: Hearth does not rank extra candidates",
            ));
        }
        if self.logprobs.is_some_and(|l| l > MAX_LEGACY_LOGPROBS) {
            return Err(refuse(
                "logprobs",
                &format!("at most {MAX_LEGACY_LOGPROBS} alternatives"),
            ));
        }
        if self.echo && self.logprobs.is_some() {
            return Err(refuse(
                "echo",
                "with logprobs it needs the prompt's log-probabilities, which are not computed",
            ));
        }
        Ok(n)
    }

    /// The request's sampling fields over the model's defaults.
    fn params(&self, defaults: &ModelDefaults) -> SamplingParams {
        let d = defaults.params().clone();
        SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.openai_temperature()),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            logit_bias: self.logit_bias.clone().unwrap_or(d.logit_bias.clone()),
            seed: self.seed.or(d.seed),
            ..d
        }
    }

    fn turn(&self, defaults: &ModelDefaults) -> Result<(ValidTurn<RawPrompt>, u32), ApiError> {
        let n = self.check_supported()?;
        let stop = match self.stop.as_ref() {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        let options = GenOptions::new(
            Some(self.params(defaults)),
            "",
            self.max_tokens,
            stop,
            self.ignore_eos,
        )?
        .with_logprobs(self.logprobs.is_some(), self.logprobs)?;
        let (field, grammar) =
            requested_grammar(self.response_format.as_ref(), self.grammar.as_ref())?;
        let options = options
            .with_grammar(field, grammar)?
            .with_end_user(self.user.as_deref())?
            .with_keep_alive(self.keep_alive)?;
        Ok((ValidTurn::new(self.prompt()?, options, self.stream), n))
    }
}

/// OpenAI-compatible text completion of a prompt sent as it is (no chat template), streaming
/// (`text_completion` chunks, then `[DONE]`) or not. Stateless.
#[utoipa::path(post, path = "/v1/completions", operation_id = "createCompletion", tag = "openai", request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion", content(
            (TextCompletion = "application/json"),
            (crate::api::openapi::CompletionEvent = "text/event-stream"),
        )),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = crate::api::ErrorBody),
        (status = 422, description = "A field is out of range or asks for what Hearth cannot do", body = crate::api::ErrorBody),
    ))]
pub async fn completions(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    if s.chat.needs_load(req.model.as_deref()).is_some() {
        // What can be refused before the load is: bad input costs no load.
        req.turn(&Default::default())?;
    }
    let target = s.chat.target(&caller, req.model.as_deref()).await?;
    let (turn, n) = req.turn(&target.defaults())?;
    let echo = match (&req.prompt, req.echo) {
        (_, false) => None,
        (PromptField::Text(t), true) => Some(t.clone()),
        (PromptField::Texts(v), true) => v.first().cloned(),
        (PromptField::Tokens(ids), true) => Some(s.chat.decode(&target, ids)),
        (PromptField::TokenLists(v), true) => v.first().map(|ids| s.chat.decode(&target, ids)),
    };
    let lives = s.chat.complete_raw(&caller, turn, &target, n).await?;
    let head = Head {
        id: format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        created: crate::storage::now_ms() / 1000,
        model: target.name(),
    };
    let guards: Vec<StopOnDrop> = lives.iter().cloned().map(StopOnDrop).collect();
    let shape = Shape::Text { echo: echo.clone() };
    let logprobs = req.logprobs.is_some();
    if req.stream {
        let usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(streamed(head, guards, usage, logprobs, shape));
    }
    let finished = finished_choices(&lives, logprobs, &shape).await?;
    let choices = (0u32..)
        .zip(&finished)
        .map(|(index, f)| TextChoice {
            index,
            text: format!("{}{}", echo.as_deref().unwrap_or(""), f.outcome.content),
            logprobs: f.logprobs.clone(),
            finish_reason: f.finish_reason,
        })
        .collect();
    let outcomes: Vec<Outcome> = finished.into_iter().map(|f| f.outcome).collect();
    drop(guards);
    Ok(Json(TextCompletion {
        id: head.id,
        object: "text_completion".into(),
        created: head.created,
        model: head.model,
        choices,
        usage: Usage::of(&outcomes),
    })
    .into_response())
}

/// A finished text completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextCompletion {
    pub id: String,
    /// `text_completion`
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    pub model: String,
    pub choices: Vec<TextChoice>,
    pub usage: Usage,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TextChoice {
    pub index: u32,
    /// The prompt's text first with `echo`.
    pub text: String,
    /// With `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (token to log-probability)
    /// and `text_offset`, as OpenAI's legacy API; else `null`.
    #[schema(value_type = Option<Object>, required = true)]
    pub logprobs: Value,
    /// `stop` or `length`.
    pub finish_reason: OpenAiFinish,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn prompts_come_as_text_ids_or_a_list_of_one() {
        let req = |prompt: Value| -> CompletionRequest {
            serde_json::from_value(json!({"prompt": prompt})).expect("parses")
        };
        assert_eq!(
            req(json!("Once")).prompt().expect("text"),
            RawPrompt::Text("Once".into())
        );
        assert_eq!(
            req(json!([2, 5])).prompt().expect("ids"),
            RawPrompt::Tokens(vec![2, 5])
        );
        assert_eq!(
            req(json!(["Once"])).prompt().expect("list"),
            RawPrompt::Text("Once".into())
        );
        assert_eq!(
            req(json!([[7]])).prompt().expect("lists"),
            RawPrompt::Tokens(vec![7])
        );
        for bad in [json!(["a", "b"]), json!([]), json!(""), json!([[1], [2]])] {
            assert!(req(bad.clone()).prompt().is_err(), "{bad}");
        }
    }
}
