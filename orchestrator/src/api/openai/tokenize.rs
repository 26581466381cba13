//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a prompt's tokens as the model
//! reads them (chat messages rendered with its template, as a chat completion renders them), and
//! tokens' text.

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::wire::{conversation, refuse, InMessage};
use crate::api::{ApiError, AppState, ValidJson};
use crate::service::{Caller, RawPrompt, ToTokenize};
use crate::tools::{Tool, Tools};

/// A prompt, or chat messages, to tokenize.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    /// A served model's name (as `/v1/models` lists it, or `name@version`); absent: the default
    /// model. A repository model is loaded first if it must be, as for a completion.
    #[serde(default)]
    model: Option<String>,
    /// A prompt as it is. Give this or `messages`.
    #[serde(default)]
    prompt: Option<String>,
    /// Chat messages, as chat completions take them, rendered with the model's chat template.
    #[serde(default)]
    messages: Option<Vec<InMessage>>,
    /// With `messages`: the tools a completion would offer; their description heads the prompt.
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    /// With `prompt`: the BOS token first (default `true`).
    #[serde(default)]
    add_special_tokens: Option<bool>,
    /// With `messages`: the prompt ends where the reply begins. Only `true` (the default).
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    /// Only `false` (the default): the last message is not continued.
    #[serde(default)]
    continue_final_message: Option<bool>,
    /// Each token's text too, special tokens as they are written.
    #[serde(default)]
    return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// How many tokens: what a completion of the same input counts as its prompt.
    pub count: usize,
    /// The model's context, in tokens.
    #[schema(required = true)]
    pub max_model_len: Option<usize>,
    pub tokens: Vec<u32>,
    /// Each token's text, when `return_token_strs` asked for it; else null.
    #[schema(required = true)]
    pub token_strs: Option<Vec<String>>,
}

/// Tokens to turn back into text.
#[derive(Debug, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    /// As `/tokenize`'s.
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The tokens' text, special tokens as they are written.
    pub prompt: String,
}

impl TokenizeRequest {
    /// What to tokenize: exactly one of `prompt` and `messages`, with the options that apply.
    fn input(&self) -> Result<ToTokenize, ApiError> {
        if self.add_generation_prompt == Some(false) {
            let why = "only true: a chat prompt ends where the model's reply begins";
            return Err(refuse("add_generation_prompt", why));
        }
        if self.continue_final_message == Some(true) {
            let why = "only false: the last message is not continued";
            return Err(refuse("continue_final_message", why));
        }
        match (&self.prompt, &self.messages) {
            (Some(text), None) => {
                if self.tools.is_some() {
                    return Err(refuse("tools", "only with `messages`"));
                }
                // A completion's checks: not empty, no NUL, within the size cap.
                RawPrompt::text(text.clone())?;
                let bos = self.add_special_tokens.unwrap_or(true);
                Ok(ToTokenize::Prompt {
                    text: text.clone(),
                    bos,
                })
            }
            (None, Some(messages)) => {
                let tools = Tools::new(self.tools.as_deref(), None)?;
                Ok(ToTokenize::Chat(conversation(messages, tools.as_ref())?))
            }
            (Some(_), Some(_)) => Err(refuse("prompt", "give `prompt` or `messages`, not both")),
            (None, None) => Err(refuse("messages", "give `prompt` or `messages`")),
        }
    }
}

/// A prompt's tokens, or chat messages' as a chat completion would prefill them (vLLM's
/// `/tokenize`). Nothing is generated; the request counts against the key's requests per
/// minute.
#[utoipa::path(post, path = "/tokenize", operation_id = "tokenize", tag = "openai", request_body = TokenizeRequest,
    responses(
        (status = 200, description = "The tokens", body = TokenizeResponse),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = crate::api::ErrorBody),
        (status = 422, description = "Neither or both of `prompt` and `messages`, or a field Hearth cannot honour", body = crate::api::ErrorBody),
    ))]
pub async fn tokenize(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let input = req.input()?;
    let texts = req.return_token_strs == Some(true);
    let t = s
        .chat
        .tokenize(&caller, req.model.as_deref(), input, texts)
        .await?;
    Ok(Json(TokenizeResponse {
        count: t.tokens.len(),
        max_model_len: t.context_length,
        tokens: t.tokens,
        token_strs: t.texts,
    }))
}

/// The text of token ids (vLLM's `/detokenize`); an id outside the model's vocabulary is a 422
/// that names it (`tokens[i]`).
#[utoipa::path(post, path = "/detokenize", operation_id = "detokenize", tag = "openai", request_body = DetokenizeRequest,
    responses(
        (status = 200, description = "The text", body = DetokenizeResponse),
        (status = 404, description = "`model` names a model this server does not serve (`model_not_found`)", body = crate::api::ErrorBody),
        (status = 422, description = "A token outside the vocabulary", body = crate::api::ErrorBody),
    ))]
pub async fn detokenize(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let prompt = s
        .chat
        .detokenize(&caller, req.model.as_deref(), &req.tokens)
        .await?;
    Ok(Json(DetokenizeResponse { prompt }))
}
