//! One generated request of each kind of malformed request ([`Family`]), and the requests that
//! must be refused whatever the seed ([`pinned`]).

use hearth_e2e::rng::Rng;
use serde_json::{json, Value};

use super::bodies::{long_text, not_json, wrong_type};
use super::case::{
    auth, body_case, json_ct, trim, with, BodyRoute, Case, Ctx, BODY_LIMIT, BODY_ROUTES, ID_ROUTES,
    STRICT_ROUTES,
};
use super::envelope::{bad_auth, bad_content_type, bad_id};
use super::ranges::out_of_range;

/// The kinds of malformed request, each tested on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    NotJson,
    WrongShape,
    UnknownField,
    OutOfRange,
    TooLarge,
    BadId,
    WrongRoute,
    BadAuth,
    BadContentType,
    BadQuery,
    LongHeaders,
}

/// One generated request of `family`.
pub(crate) fn generate(rng: &mut Rng, ctx: &Ctx, family: Family) -> Case {
    match family {
        // Not JSON at all.
        Family::NotJson => {
            let route = *rng.pick(&BODY_ROUTES);
            let (label, body, expect) = not_json(rng, route);
            body_case(ctx, route, label, body, expect)
        }
        // JSON of the wrong shape.
        Family::WrongShape => {
            let route = *rng.pick(&BODY_ROUTES);
            let (field, kind) = *rng.pick(route.fields());
            let wrong = wrong_type(rng, kind);
            let (label, body) = if rng.chance(15) {
                let top = rng
                    .pick(&[
                        json!([]),
                        json!("text"),
                        json!(42),
                        json!(null),
                        json!(true),
                        json!([route.valid()]),
                    ])
                    .clone();
                (format!("top-level {top}"), top)
            } else {
                (
                    format!("{field} = {}", trim(&wrong.to_string())),
                    with(route.valid(), field, wrong),
                )
            };
            body_case(ctx, route, label, body.to_string().into_bytes(), &[422])
        }
        // Unknown fields (the native routes refuse them, also inside `params`).
        Family::UnknownField => {
            let route = *rng.pick(&STRICT_ROUTES);
            let name = format!("x_{}", {
                let hi = if rng.chance(10) { 9000 } else { 20 };
                rng.letters_in(1, hi)
            });
            let (label, body) = if rng.chance(30) {
                (
                    format!("unknown field params.{}", trim(&name)),
                    with(route.valid(), "params", json!({ name: 1 })),
                )
            } else {
                (
                    format!("unknown field {}", trim(&name)),
                    with(route.valid(), &name, json!(rng.ascii(5))),
                )
            };
            body_case(ctx, route, label, body.to_string().into_bytes(), &[422])
        }
        // Well-formed values out of range.
        Family::OutOfRange => {
            let route = *rng.pick(&BODY_ROUTES);
            let (label, body) = out_of_range(rng, route);
            let bytes = body.to_string().into_bytes();
            let expect: &[u16] = if bytes.len() > BODY_LIMIT {
                &[413]
            } else {
                &[422]
            };
            body_case(ctx, route, label, bytes, expect)
        }
        // Bodies over the limit (but under 2 MiB), by length or chunked.
        Family::TooLarge => {
            let route = *rng.pick(&BODY_ROUTES);
            let n = BODY_LIMIT + rng.range(1, 900 << 10);
            let field = if route == BodyRoute::Completions {
                "model"
            } else {
                "content"
            };
            let body = json!({ field: long_text(rng, n) }).to_string().into_bytes();
            let chunked = rng.chance(50);
            let mut c = body_case(
                ctx,
                route,
                format!("{n}-byte body{}", if chunked { ", chunked" } else { "" }),
                body,
                &[413],
            );
            c.chunked = chunked;
            c
        }
        // Ids that are not ids, on every route that takes one.
        Family::BadId => {
            let (id, what) = bad_id(rng, ctx);
            let (method, path, body) = if rng.chance(50) {
                let route = *rng.pick(&BODY_ROUTES[1..4]);
                (route.method(), route.path(&id), Some(route.valid()))
            } else {
                let (m, p) = *rng.pick(&ID_ROUTES);
                (m, p.replace("{id}", &id), None)
            };
            let mut headers = vec![auth(&ctx.key)];
            if body.is_some() {
                headers.push(json_ct());
            }
            Case {
                label: format!("{method} {}: {what}", trim(&path)),
                method: method.into(),
                path,
                headers,
                body: body.map(|b| b.to_string().into_bytes()),
                chunked: false,
                expect: vec![404],
            }
        }
        // Wrong methods and unknown routes.
        Family::WrongRoute => {
            let sid = &ctx.sid;
            let wrong_method: Vec<(&str, String)> = vec![
                ("PUT", "/v1/sessions".into()),
                ("DELETE", "/v1/sessions".into()),
                ("PATCH", "/v1/sessions".into()),
                ("PUT", format!("/v1/sessions/{sid}")),
                ("POST", format!("/v1/sessions/{sid}")),
                ("PATCH", format!("/v1/sessions/{sid}/messages")),
                ("DELETE", format!("/v1/sessions/{sid}/messages")),
                ("GET", format!("/v1/sessions/{sid}/regenerate")),
                ("GET", format!("/v1/sessions/{sid}/stop")),
                ("DELETE", format!("/v1/sessions/{sid}/stop")),
                ("POST", format!("/v1/sessions/{sid}/stream")),
                ("GET", "/v1/chat/completions".into()),
                ("PUT", "/v1/chat/completions".into()),
                ("POST", "/v1/models".into()),
                ("TRACE", "/v1/sessions".into()),
                ("OPTIONS", format!("/v1/sessions/{sid}")),
                ("BREW", "/v1/chat/completions".into()),
                ("PROPFIND", format!("/v1/sessions/{sid}/messages")),
            ];
            let unknown: Vec<(&str, String)> = vec![
                ("GET", "/v1/session".into()),
                ("POST", "/v1/sessions/".into()),
                ("GET", "/v1/sessions//messages".into()),
                ("POST", format!("/v1/sessions/{sid}/messages/extra")),
                ("POST", format!("/v1/sessions/{sid}/regenerate/{sid}")),
                // A GET outside the API is the web UI's (its 404 page, HTML; see
                // orchestrator/tests/web.rs); every other method is a JSON 404 there too.
                ("POST", "/v2/sessions".into()),
                ("POST", "/v1/chat/completion".into()),
                ("POST", "/v1/chat/completions/x".into()),
                ("GET", "/v1/%FF%FE".into()),
                ("GET", format!("/v1/{}", rng.letters_in(1, 3000))),
                ("PUT", format!("/{}", rng.letters_in(1, 3000))),
                ("POST", "/V1/SESSIONS".into()),
            ];
            let method_wrong = rng.chance(60);
            let (method, path) = if method_wrong {
                rng.pick(&wrong_method).clone()
            } else {
                rng.pick(&unknown).clone()
            };
            let has_body = method != "GET" && rng.chance(50);
            let mut headers = vec![auth(&ctx.key)];
            if has_body {
                headers.push(json_ct());
            }
            Case {
                label: format!(
                    "{method} {}: {}",
                    trim(&path),
                    if method_wrong {
                        "wrong method"
                    } else {
                        "unknown route"
                    }
                ),
                method: method.into(),
                path,
                headers,
                body: has_body.then(|| json!({"content": "x"}).to_string().into_bytes()),
                chunked: false,
                expect: vec![if method_wrong { 405 } else { 404 }],
            }
        }
        // Garbage Authorization, on any route, with an otherwise valid request.
        Family::BadAuth => {
            let (what, value) = bad_auth(rng, ctx);
            let mut headers = Vec::new();
            if let Some(v) = value {
                headers.push(("Authorization".to_string(), v));
            }
            let (method, path, body) = if rng.chance(50) {
                let route = *rng.pick(&BODY_ROUTES);
                headers.push(json_ct());
                (route.method(), route.path(&ctx.sid), Some(route.valid()))
            } else {
                let (m, p) = *rng.pick(&[
                    ("GET", "/v1/sessions"),
                    ("GET", "/v1/sessions/{id}"),
                    ("DELETE", "/v1/sessions/{id}"),
                    ("GET", "/v1/sessions/{id}/messages"),
                    ("POST", "/v1/sessions/{id}/stop"),
                    ("GET", "/v1/sessions/{id}/stream"),
                    ("GET", "/v1/models"),
                ]);
                (m, p.replace("{id}", &ctx.sid), None)
            };
            Case {
                label: format!("{method} {path}: {what}"),
                method: method.into(),
                path,
                headers,
                body: body.map(|b| b.to_string().into_bytes()),
                chunked: false,
                expect: vec![401],
            }
        }
        // Wrong or missing Content-Type on a valid body.
        Family::BadContentType => {
            let route = *rng.pick(&BODY_ROUTES);
            let (what, ct) = bad_content_type(rng);
            let mut headers = vec![auth(&ctx.key)];
            if let Some(v) = ct {
                headers.push(("Content-Type".to_string(), v));
            }
            Case {
                label: format!("{} {}: {what}", route.method(), route.path("{id}")),
                method: route.method().into(),
                path: route.path(&ctx.sid),
                headers,
                body: Some(route.valid().to_string().into_bytes()),
                chunked: false,
                expect: vec![415],
            }
        }
        // Bad query parameters on the session list.
        Family::BadQuery => {
            let long_q = rng.letters_in(201, 3000);
            let choices: Vec<String> = vec![
                "limit=0".into(),
                "limit=101".into(),
                "limit=-1".into(),
                "limit=abc".into(),
                "limit=1.5".into(),
                "limit=99999999999999999999".into(),
                "limit=%FF".into(),
                "limit=1&limit=2".into(),
                format!("q={long_q}"),
                "q=%00".into(),
                "before=junk".into(),
                "before=123_xyz".into(),
                format!("before=abc_{}", ctx.sid),
                format!("before=1_{}", ctx.sid.to_uppercase()),
                format!("x_{}=1", rng.letters_in(1, 30)),
                "limit=NaN".into(),
            ];
            let q = rng.pick(&choices).clone();
            let path = format!("/v1/sessions?{q}");
            Case {
                label: format!("GET {}", trim(&path)),
                method: "GET".into(),
                path,
                headers: vec![auth(&ctx.key)],
                body: None,
                chunked: false,
                expect: vec![422],
            }
        }
        // Long header values (under 8 KiB) on an otherwise invalid request.
        Family::LongHeaders => {
            let route = *rng.pick(&STRICT_ROUTES);
            let mut c = body_case(
                ctx,
                route,
                "long headers and an unknown field".into(),
                with(route.valid(), "x_unknown", json!(1))
                    .to_string()
                    .into_bytes(),
                &[422],
            );
            for i in 0..rng.range(1, 6) {
                c.headers.push((
                    format!("X-Filler-{i}"),
                    rng.ascii_in(1000, 7900).into_bytes(),
                ));
            }
            c
        }
    }
}

/// Requests that must be refused whatever the seed. A JSON array is the positional form of a
/// struct to serde, so to a lenient parser each of these is a complete, valid request (`[]`
/// being every field at its default).
pub(crate) fn pinned(ctx: &Ctx) -> Vec<Case> {
    let array = |route: BodyRoute, body: Value, what: &str| {
        body_case(
            ctx,
            route,
            format!("array body {body} ({what})"),
            body.to_string().into_bytes(),
            &[422],
        )
    };
    vec![
        array(BodyRoute::Create, json!([]), "creates a session"),
        array(
            BodyRoute::Create,
            json!(["a title", "a system prompt"]),
            "creates a titled session",
        ),
        array(BodyRoute::Patch, json!([]), "bumps updated_at"),
        array(
            BodyRoute::Post,
            json!(["Hello", null, false, 4]),
            "posts a turn",
        ),
        array(BodyRoute::Regenerate, json!([]), "replaces the reply"),
        array(
            BodyRoute::Completions,
            json!([null, [{"role": "user", "content": "Hello"}], false, null, 2]),
            "generates",
        ),
    ]
}
