//! A client's command over the WebSocket, parsed from its JSON text into one typed value before
//! anything runs: its `type` picks the variant, and each variant takes only its own fields.

use crate::invalid::Invalid;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::native::TurnBody;
use super::super::ApiError;
use crate::ids::MessageId;

/// What a client asked for.
#[derive(Debug)]
pub(super) enum Command {
    /// A new turn: the fields of `POST …/messages` (or its `tool_results`).
    Message(TurnBody),
    /// The last reply again, with the turn's options.
    Regenerate(TurnBody),
    /// A user message's new text, and a new reply to it.
    Edit {
        message_id: MessageId,
        turn: TurnBody,
    },
    /// Stop the running reply.
    Stop,
    /// The running (or just finished) reply's events after `last_event_id` (all without it).
    Resume { last_event_id: Option<String> },
}

/// The commands' `type`s.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Message,
    Regenerate,
    Edit,
    Stop,
    Resume,
}

impl Command {
    /// `text` as a command, or the error that names what is wrong with it.
    pub(super) fn parse(text: &str) -> Result<Self, ApiError> {
        let mut fields = match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(ApiError::BadRequest("a command is a JSON object".into())),
            Err(e) => return Err(ApiError::BadRequest(format!("not JSON: {e}"))),
        };
        let kind: Kind = match fields.remove("type") {
            None | Some(Value::Null) => {
                return Err(ApiError::Validation(Invalid::field(
                    "type",
                    "required: message, regenerate, edit, stop or resume",
                )))
            }
            Some(kind) => serde_json::from_value(kind)
                .map_err(|e| ApiError::Validation(Invalid::field("type", format!("{e}"))))?,
        };
        Ok(match kind {
            Kind::Message => Command::Message(turn_body(fields)?),
            Kind::Regenerate => Command::Regenerate(turn_body(fields)?),
            Kind::Edit => {
                let message_id = take_str(&mut fields, "message_id")?
                    .and_then(|m| MessageId::parse(&m))
                    .ok_or_else(|| {
                        ApiError::Validation(Invalid::field(
                            "message_id",
                            "required, a message's id",
                        ))
                    })?;
                let turn = turn_body(fields)?;
                Command::Edit { message_id, turn }
            }
            Kind::Stop => {
                no_more(&fields)?;
                Command::Stop
            }
            Kind::Resume => {
                let last_event_id = take_str(&mut fields, "last_event_id")?;
                no_more(&fields)?;
                Command::Resume { last_event_id }
            }
        })
    }
}

/// A turn's fields (those of `POST …/messages`), checked as there.
fn turn_body(fields: Map<String, Value>) -> Result<TurnBody, ApiError> {
    if fields.get("stream") == Some(&Value::Bool(false)) {
        return Err(ApiError::Validation(Invalid::field(
            "stream",
            "replies over the WebSocket always stream",
        )));
    }
    serde_json::from_value(Value::Object(fields))
        .map_err(|e| ApiError::Validation(Invalid::request(e.to_string())))
}

/// A text field taken out of a command (absent: `None`; not text: an error naming it).
fn take_str(fields: &mut Map<String, Value>, name: &str) -> Result<Option<String>, ApiError> {
    match fields.remove(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::Validation(Invalid::field(name, "must be text"))),
    }
}

/// Refuses fields a command does not take.
fn no_more(fields: &Map<String, Value>) -> Result<(), ApiError> {
    match fields.keys().next() {
        Some(k) => Err(ApiError::Validation(Invalid::field(
            k.as_str(),
            "not a field of this command",
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> String {
        match Command::parse(text) {
            Err(e) => format!("{} {e}", e.status().as_u16()),
            Ok(c) => panic!("{text} was taken: {c:?}"),
        }
    }

    #[test]
    fn each_type_takes_its_own_fields() {
        let c = Command::parse(r#"{"type": "message", "content": "hi", "max_tokens": 3}"#);
        assert!(matches!(c, Ok(Command::Message(b)) if b.content.as_deref() == Some("hi")));
        assert!(matches!(
            Command::parse(r#"{"type": "regenerate"}"#),
            Ok(Command::Regenerate(_))
        ));
        let id = MessageId::random();
        let edit = format!(r#"{{"type": "edit", "message_id": "{id}", "content": "x"}}"#);
        assert!(
            matches!(Command::parse(&edit), Ok(Command::Edit { message_id, .. }) if message_id == id)
        );
        assert!(matches!(
            Command::parse(r#"{"type": "stop"}"#),
            Ok(Command::Stop)
        ));
        let resume = r#"{"type": "resume", "last_event_id": "m:3"}"#;
        assert!(matches!(
            Command::parse(resume),
            Ok(Command::Resume { last_event_id: Some(l) }) if l == "m:3"
        ));
        assert!(matches!(
            Command::parse(r#"{"type": "resume"}"#),
            Ok(Command::Resume {
                last_event_id: None
            })
        ));
    }

    #[test]
    fn a_refused_command_names_what_is_wrong() {
        for (text, says) in [
            ("{", "400 not JSON"),
            ("[1]", "400 a command is a JSON object"),
            (r#"{"content": "x"}"#, "422 type: required"),
            (r#"{"type": 3}"#, "422 type: invalid type"),
            (r#"{"type": "dance"}"#, "`dance`"),
            (r#"{"type": "stop", "now": true}"#, "422 now: not a field"),
            (
                r#"{"type": "resume", "last_event_id": 1}"#,
                "last_event_id: must be text",
            ),
            (
                r#"{"type": "edit", "content": "x"}"#,
                "message_id: required",
            ),
            (
                r#"{"type": "edit", "message_id": "nope"}"#,
                "message_id: required",
            ),
            (r#"{"type": "message", "contnet": "x"}"#, "contnet"),
            (r#"{"type": "message", "stream": false}"#, "always stream"),
        ] {
            let got = refused(text);
            assert!(got.contains(says), "{text}: {got}");
        }
    }
}
