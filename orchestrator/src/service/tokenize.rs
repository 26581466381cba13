//! Tokenizing without generating (`POST /tokenize`, `POST /detokenize`): a prompt's tokens as
//! the model reads them, for clients that count or budget them before they send a request.
//! Nothing is generated or stored; each call counts against the key's requests per minute.

use hearth_shared::chat::template::{render, ChatError as TemplateError};

use super::{Caller, ChatError, ChatService, Conversation, Target};
use crate::invalid::Invalid;

/// What to tokenize.
#[derive(Debug)]
pub enum ToTokenize {
    /// A conversation, rendered with the model's chat template as a chat completion renders
    /// it: every message kept, ending where the reply begins.
    Chat(Conversation),
    /// A prompt as it is, after the BOS token when `bos`.
    Prompt { text: String, bos: bool },
}

/// A tokenized prompt.
#[derive(Debug)]
pub struct Tokenized {
    pub tokens: Vec<u32>,
    /// Each token's text, special tokens as they are written, when asked for.
    pub texts: Option<Vec<String>>,
    /// The model's context, in tokens.
    pub context_length: Option<usize>,
}

impl ChatService {
    /// The tokens of `input` for the model `asked` names (loaded on demand, as for a
    /// completion, after the request is counted), with each token's text when `texts`.
    pub async fn tokenize(
        &self,
        caller: &Caller,
        asked: Option<&str>,
        input: ToTokenize,
        texts: bool,
    ) -> Result<Tokenized, ChatError> {
        self.limiter.admit_request(&caller.quota).await?;
        let target = self.target(caller, asked).await?;
        let tok = self.tokenizer(&target).tok.clone();
        let tokens = match input {
            ToTokenize::Chat(convo) => {
                let messages = convo.into_messages();
                let rendered = tokio::task::spawn_blocking({
                    let tok = tok.clone();
                    move || render(&tok, &messages, usize::MAX)
                })
                .await
                .map_err(|e| ChatError::Internal(format!("prompt rendering failed: {e}")))?;
                rendered
                    .map_err(|e| match e {
                        TemplateError::Tokenizer(e) => ChatError::Internal(e.to_string()),
                        other => ChatError::Invalid(Invalid::request(other.to_string())),
                    })?
                    .tokens
            }
            ToTokenize::Prompt { text, bos } => {
                let mut ids = Vec::from_iter(bos.then_some(tok.bos_id));
                ids.extend(
                    tok.encode(&text)
                        .map_err(|e| ChatError::Internal(e.to_string()))?,
                );
                ids
            }
        };
        let texts = texts.then(|| {
            let text = |t: &u32| tok.decode_with_special(&[*t]).unwrap_or_default();
            tokens.iter().map(text).collect()
        });
        Ok(Tokenized {
            tokens,
            texts,
            context_length: target.context_length(),
        })
    }

    /// The text of `tokens` for the model `asked` names, special tokens as they are written;
    /// a token outside the vocabulary is refused by its index.
    pub async fn detokenize(
        &self,
        caller: &Caller,
        asked: Option<&str>,
        tokens: &[u32],
    ) -> Result<String, ChatError> {
        self.limiter.admit_request(&caller.quota).await?;
        let target: Target = self.target(caller, asked).await?;
        let tok = self.tokenizer(&target).tok.clone();
        let vocab = tok.vocab_size();
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(ChatError::Invalid(Invalid::field(
                format!("tokens[{i}]"),
                format!("token id {id} is outside the vocabulary of {vocab}"),
            )));
        }
        tok.decode_with_special(tokens)
            .map_err(|e| ChatError::Internal(e.to_string()))
    }
}
