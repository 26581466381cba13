//! The malformed requests' model: one request and the answers it may get ([`Case`]), what the
//! generator knows about the stack ([`Ctx`]), the routes that take a body and the fields each
//! body has ([`BodyRoute`], [`Kind`]), and the small builders the generators share.

use std::net::SocketAddr;

use hearth_e2e::http::{RawRequest, Reply};
use serde_json::{json, Value};

/// The server's body limit (`MAX_BODY_BYTES`); bodies over it are a 413.
pub(crate) const BODY_LIMIT: usize = 1 << 20;

/// One request and the statuses it may get.
#[derive(Debug, Clone)]
pub(crate) struct Case {
    pub(crate) label: String,
    pub(crate) method: String,
    pub(crate) path: String,
    /// Sent as is (values may hold any byte but CR and LF).
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Option<Vec<u8>>,
    /// Send the body with `Transfer-Encoding: chunked` instead of `Content-Length`.
    pub(crate) chunked: bool,
    pub(crate) expect: Vec<u16>,
}

impl Case {
    pub(crate) async fn send(&self, addr: SocketAddr) -> Result<Reply, String> {
        RawRequest {
            method: &self.method,
            path: &self.path,
            headers: &self.headers,
            body: self.body.as_deref(),
            chunked: self.chunked,
        }
        .send(addr)
        .await
    }
}

/// What the generator needs to know about the stack.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub(crate) key: String,
    /// The caller's session, with one finished turn.
    pub(crate) sid: String,
    /// Another user's session.
    pub(crate) foreign_sid: String,
    /// A key that was revoked.
    pub(crate) revoked: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyRoute {
    Create,
    Patch,
    Post,
    Regenerate,
    Completions,
}

pub(crate) const BODY_ROUTES: [BodyRoute; 5] = [
    BodyRoute::Create,
    BodyRoute::Patch,
    BodyRoute::Post,
    BodyRoute::Regenerate,
    BodyRoute::Completions,
];

/// The native routes whose bodies refuse unknown fields.
pub(crate) const STRICT_ROUTES: [BodyRoute; 4] = [
    BodyRoute::Create,
    BodyRoute::Patch,
    BodyRoute::Post,
    BodyRoute::Regenerate,
];

impl BodyRoute {
    pub(crate) fn method(self) -> &'static str {
        match self {
            Self::Patch => "PATCH",
            _ => "POST",
        }
    }

    pub(crate) fn path(self, sid: &str) -> String {
        match self {
            Self::Create => "/v1/sessions".into(),
            Self::Patch => format!("/v1/sessions/{sid}"),
            Self::Post => format!("/v1/sessions/{sid}/messages"),
            Self::Regenerate => format!("/v1/sessions/{sid}/regenerate"),
            Self::Completions => "/v1/chat/completions".into(),
        }
    }

    /// A body the route accepts (so a request with it fails only for another reason).
    pub(crate) fn valid(self) -> Value {
        match self {
            Self::Create => json!({"title": "probe", "system_prompt": "Be brief."}),
            Self::Patch => json!({"title": "renamed by a probe"}),
            Self::Post => json!({"content": "Hello", "max_tokens": 4, "stream": false}),
            Self::Regenerate => json!({"max_tokens": 4, "stream": false}),
            Self::Completions => json!({
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hello"}]
            }),
        }
    }

    /// Fields of the route's body and the kind of value each takes.
    pub(crate) fn fields(self) -> &'static [(&'static str, Kind)] {
        match self {
            Self::Create | Self::Patch => &[
                ("title", Kind::Str),
                ("system_prompt", Kind::Str),
                ("params", Kind::Params),
            ],
            Self::Post => &[
                ("content", Kind::Str),
                ("params", Kind::Params),
                ("stream", Kind::Bool),
                ("max_tokens", Kind::U32),
                ("stop", Kind::Strings),
                ("ignore_eos", Kind::Bool),
            ],
            Self::Regenerate => &[
                ("params", Kind::Params),
                ("stream", Kind::Bool),
                ("max_tokens", Kind::U32),
                ("stop", Kind::Strings),
                ("ignore_eos", Kind::Bool),
            ],
            Self::Completions => &[
                ("messages", Kind::Messages),
                ("stream", Kind::Bool),
                ("max_tokens", Kind::U32),
                ("max_completion_tokens", Kind::U32),
                ("temperature", Kind::F32),
                ("top_p", Kind::F32),
                ("top_k", Kind::U32),
                ("seed", Kind::U64),
                ("stop", Kind::StopField),
                ("ignore_eos", Kind::Bool),
                ("n", Kind::U32),
                ("stream_options", Kind::Object),
            ],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Str,
    Bool,
    U32,
    U64,
    F32,
    Strings,
    StopField,
    Params,
    Messages,
    Object,
}

/// Routes without a body, with an id in the path.
pub(crate) const ID_ROUTES: [(&str, &str); 5] = [
    ("GET", "/v1/sessions/{id}"),
    ("DELETE", "/v1/sessions/{id}"),
    ("GET", "/v1/sessions/{id}/messages"),
    ("POST", "/v1/sessions/{id}/stop"),
    ("GET", "/v1/sessions/{id}/stream"),
];

/// A request that is only wrong in its body.
pub(crate) fn body_case(
    ctx: &Ctx,
    route: BodyRoute,
    label: String,
    body: Vec<u8>,
    expect: &[u16],
) -> Case {
    Case {
        label: format!("{} {}: {label}", route.method(), route.path("{id}")),
        method: route.method().into(),
        path: route.path(&ctx.sid),
        headers: vec![auth(&ctx.key), json_ct()],
        body: Some(body),
        chunked: false,
        expect: expect.to_vec(),
    }
}

pub(crate) fn json_ct() -> (String, Vec<u8>) {
    ("Content-Type".into(), b"application/json".to_vec())
}

pub(crate) fn auth(key: &str) -> (String, Vec<u8>) {
    ("Authorization".into(), bearer(key))
}

pub(crate) fn bearer(key: &str) -> Vec<u8> {
    format!("Bearer {key}").into_bytes()
}

pub(crate) fn with(mut body: Value, field: &str, v: Value) -> Value {
    body[field] = v;
    body
}

pub(crate) fn without(mut body: Value, field: &str) -> Value {
    if let Some(o) = body.as_object_mut() {
        o.remove(field);
    }
    body
}

pub(crate) fn trim(s: &str) -> String {
    trim_to(s, 80)
}

pub(crate) fn trim_to(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}
