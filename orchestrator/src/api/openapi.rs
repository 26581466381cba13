//! The API's OpenAPI 3.1 document, generated from the same request and response types the
//! handlers use, and served at `/openapi.json`. `hearth openapi` prints it; the committed copy
//! (`orchestrator/openapi.json`, which the web UI's types are generated from) must equal it.

use utoipa::openapi::path::Operation;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::Schema;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi as Document, Ref, RefOr};
use utoipa::OpenApi;

use super::native::{ReplyFailed, TokenText};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Hearth",
        description = "Chat sessions whose history and KV caches survive between turns, and an \
                       OpenAI-compatible chat completions API. Every error answers with the \
                       `ErrorBody` shape.",
    ),
    paths(
        super::sessions::list,
        super::sessions::create,
        super::sessions::fetch,
        super::sessions::update,
        super::sessions::remove,
        super::sessions::messages,
        super::native::post_message,
        super::native::regenerate,
        super::native::edit,
        super::native::stop,
        super::native::resume,
        super::ws::socket,
        super::openai::chat::completions,
        super::openai::completions::completions,
        super::openai::responses::create,
        super::openai::responses::kept::get,
        super::openai::responses::kept::delete,
        super::openai::responses::kept::input_items,
        super::openai::responses::kept::cancel,
        super::openai::models::models,
        super::openai::models::model,
        super::openai::tokenize::tokenize,
        super::openai::tokenize::detokenize,
        super::anthropic::messages,
        super::anthropic::count_tokens,
        super::admin::workers,
        super::admin::load,
        super::admin::unload,
    ),
    // The SSE events' data, which no path's schema reaches.
    components(schemas(
        crate::generate::TurnIds,
        TokenText,
        super::native::LogprobsEvent,
        super::native::ReplyEnd,
        ReplyFailed,
        super::loading::ModelLoading
    )),
    modifiers(&CommonAnswers),
    tags(
        (name = "sessions", description = "The caller's chat sessions and their stored messages"),
        (name = "generation", description = "Replies on the native API, streamed as Server-Sent Events"),
        (name = "openai", description = "OpenAI-compatible and stateless"),
        (name = "anthropic", description = "Anthropic's Messages API, stateless; errors in Anthropic's shape (`AnthropicError`)"),
        (name = "admin", description = "The workers' models, loaded and unloaded (admin keys only)"),
    ),
)]
struct ApiDoc;

/// One Server-Sent Event of a native reply stream, as a client parses it: `event` names it,
/// `data` is JSON (the schema named in each alternative's description) and `id` is
/// `<message id>:<n>`, which `Last-Event-ID` takes to resume after it.
pub struct ReplyEvent;

impl utoipa::PartialSchema for ReplyEvent {
    fn schema() -> RefOr<Schema> {
        // An event with an id (a reply's), or without (around a turn that waits for its model).
        let event = |event: &str, data: &str, with_id: bool| {
            let mut e = serde_json::json!({
                "type": "object",
                "description": format!("`data` is a JSON `{data}`"),
                "properties": {
                    "event": {"type": "string", "enum": [event]},
                    "data": {"type": "string", "contentMediaType": "application/json"},
                },
                "required": ["event", "data"],
            });
            if with_id {
                e["properties"]["id"] =
                    serde_json::json!({"type": "string", "pattern": "^[0-9a-f]{32}:[0-9]+$"});
                e["required"] = serde_json::json!(["event", "id", "data"]);
            }
            e
        };
        let alternative = |name: &str, data: &str| event(name, data, true);
        literal_schema(serde_json::json!({"oneOf": [
            alternative("message_start", "MessageStart"),
            alternative("token", "TokenText"),
            alternative("logprobs", "LogprobsEvent"),
            alternative("message_end", "ReplyEnd"),
            alternative("error", "ReplyFailed"),
            // Before the reply, while the session's model loads on demand; and the turn's
            // refusal once it has loaded (the response had started). Neither has an id.
            event("model_loading", "ModelLoading", false),
            event("error", "ErrorBody", false),
        ]}))
    }
}

impl utoipa::ToSchema for ReplyEvent {}

/// One Server-Sent Event of a streamed chat completion: `data` is a JSON
/// `chat.completion.chunk` (or an error object), and the last event's data is `[DONE]`.
pub struct CompletionEvent;

impl utoipa::PartialSchema for CompletionEvent {
    fn schema() -> RefOr<Schema> {
        literal_schema(serde_json::json!({
            "type": "object",
            "properties": {"data": {"type": "string"}},
            "required": ["data"],
        }))
    }
}

impl utoipa::ToSchema for CompletionEvent {}

/// Up to 16 stop strings, each of 1 to 256 characters.
pub struct StopList;

fn stop_string() -> serde_json::Value {
    serde_json::json!({"type": "string", "minLength": 1, "maxLength": 256})
}

impl utoipa::PartialSchema for StopList {
    fn schema() -> RefOr<Schema> {
        literal_schema(serde_json::json!({"type": "array", "items": stop_string(), "maxItems": 16}))
    }
}

impl utoipa::ToSchema for StopList {}

impl utoipa::PartialSchema for super::openai::wire::StopField {
    fn schema() -> RefOr<Schema> {
        literal_schema(serde_json::json!({"oneOf": [
            stop_string(),
            {"type": "array", "items": stop_string(), "maxItems": 16},
        ]}))
    }
}

impl utoipa::ToSchema for super::openai::wire::StopField {}

fn literal_schema(v: serde_json::Value) -> RefOr<Schema> {
    // The literal above is a valid schema object, so this cannot fail; an empty schema (any
    // value) would only loosen the document.
    RefOr::T(serde_json::from_value(v).unwrap_or_default())
}

/// The document.
fn document() -> Document {
    ApiDoc::openapi()
}

/// The document as pretty-printed JSON, built once.
pub fn json() -> &'static str {
    static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    JSON.get_or_init(|| {
        let mut doc = serde_json::to_value(document()).unwrap_or_default();
        spell_link_fields(&mut doc);
        serde_json::to_string_pretty(&doc).unwrap_or_default()
    })
}

/// utoipa 5 writes a link's `operationId` as `operation_id`; OpenAPI spells it in camel case
/// (clients and fuzzers ignore links without it).
fn spell_link_fields(doc: &mut serde_json::Value) {
    let Some(paths) = doc.get_mut("paths").and_then(|p| p.as_object_mut()) else {
        return;
    };
    let links = paths
        .values_mut()
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut())
        .filter_map(|op| op.get_mut("responses")?.as_object_mut())
        .flat_map(|responses| responses.values_mut())
        .filter_map(|response| response.get_mut("links")?.as_object_mut())
        .flat_map(|links| links.values_mut())
        .filter_map(|link| link.as_object_mut());
    for link in links {
        if let Some(id) = link.remove("operation_id") {
            link.insert("operationId".into(), id);
        }
    }
}

/// `GET /openapi.json`: public, like the routes' shapes it describes.
pub async fn serve() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json(),
    )
        .into_response()
}

/// Answers any route can give, added to every operation with the `ErrorBody` schema (on
/// Anthropic's routes `AnthropicError`; a route's own description of the same status is kept),
/// and the API key scheme.
struct CommonAnswers;

/// Statuses every authenticated route may answer, and why.
const COMMON: &[(&str, &str)] = &[
    ("400", "The body is not JSON, or not a JSON object"),
    ("401", "The API key is missing, unknown, expired or revoked"),
    (
        "403",
        "Without API keys: the request names another site (Host or Origin)",
    ),
    ("408", "The body did not arrive in time"),
    ("413", "The body is larger than 1 MiB"),
    ("415", "The body is not `application/json`"),
    ("422", "A value is out of range or of the wrong kind"),
    (
        "429",
        "The key's rate or daily token limit is reached (see `Retry-After`)",
    ),
    ("503", "No worker or the database cannot be reached"),
];

impl utoipa::Modify for CommonAnswers {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "`Authorization: Bearer <key>`; `hearth keys create` makes one. \
                         Not needed when the server runs with `--auth none`.",
                    ))
                    .build(),
            ),
        );
        doc.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "api_key",
            Vec::<String>::new(),
        )]);
        link_new_sessions(doc);
        for item in doc.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.patch,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                add_common(op);
            }
        }
    }
}

/// Operations that take the session `POST /v1/sessions` creates (OpenAPI links, which let a
/// client, or a fuzzer testing sequences of calls, follow the new session's id).
const ON_A_SESSION: &[&str] = &[
    "getSession",
    "updateSession",
    "listMessages",
    "postMessage",
    "regenerate",
    "stopReply",
    "resumeStream",
    "deleteSession",
];

fn link_new_sessions(doc: &mut Document) {
    // A session's first message is a user message, which `editMessage` takes.
    let listed = doc
        .paths
        .paths
        .get_mut("/v1/sessions/{id}/messages")
        .and_then(|item| item.get.as_mut())
        .and_then(|op| op.responses.responses.get_mut("200"));
    if let Some(RefOr::T(listed)) = listed {
        listed.links.insert(
            "editMessage".to_string(),
            RefOr::T(
                utoipa::openapi::link::LinkBuilder::new()
                    .operation_id("editMessage")
                    .parameter("id", "$request.path.id")
                    .parameter("message_id", "$response.body#/data/0/id")
                    .build(),
            ),
        );
    }
    let created = doc
        .paths
        .paths
        .get_mut("/v1/sessions")
        .and_then(|item| item.post.as_mut())
        .and_then(|op| op.responses.responses.get_mut("201"));
    let Some(RefOr::T(created)) = created else {
        return;
    };
    for &op in ON_A_SESSION {
        created.links.insert(
            op.to_string(),
            RefOr::T(
                utoipa::openapi::link::LinkBuilder::new()
                    .operation_id(op)
                    .parameter("id", "$response.body#/id")
                    .build(),
            ),
        );
    }
}

fn add_common(op: &mut Operation) {
    let has_body = op.request_body.is_some();
    // Anthropic's API answers its own error shape, and a bad value as a 400.
    let anthropic = op.tags.iter().flatten().any(|t| t == "anthropic");
    let body_schema = if anthropic {
        "AnthropicError"
    } else {
        "ErrorBody"
    };
    let has_query = op
        .parameters
        .iter()
        .flatten()
        .any(|p| matches!(p.parameter_in, utoipa::openapi::path::ParameterIn::Query));
    for &(status, why) in COMMON {
        // Body errors only where there is a body to get wrong, value errors only where there
        // are values.
        let skip = match status {
            "400" | "413" | "415" => !has_body,
            "422" => anthropic || (!has_body && !has_query),
            _ => false,
        };
        if skip || op.responses.responses.contains_key(status) {
            continue;
        }
        let response = ResponseBuilder::new()
            .description(why)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(RefOr::Ref(Ref::from_schema_name(body_schema))))
                    .build(),
            )
            .build();
        op.responses
            .responses
            .insert(status.to_string(), RefOr::T(response));
    }
}
