//! Malformed requests over the HTTP API of a real stack, generated from a seeded deterministic
//! RNG: broken and wrongly typed JSON, unknown fields, out-of-range, NaN and huge numbers, huge
//! strings and bodies, invalid UTF-8, ids that are not ids, wrong methods and routes, and header
//! abuse (wrong or missing `Content-Type`, garbage `Authorization`, long header values).
//!
//! Every answer must be a 4xx of the expected family with the API's JSON error body, none may
//! hang, and none may change what is stored: the caller's sessions and messages (and another
//! user's) are snapshotted before and after and must be identical. Requests go over raw sockets so
//! the test controls every byte and header. `HEARTH_BAD_INPUT_SEED` replays another seed. Each
//! kind of malformed request is its own test, on its own stack, so a failure names its kind.

use std::net::SocketAddr;

use hearth_e2e::http::{RawRequest, Reply, Req};
use hearth_e2e::stack::{Db, Stack};
use hearth_orchestrator::storage::{now_ms, Store};
use serde_json::{json, Value};

/// The seed every run uses unless `HEARTH_BAD_INPUT_SEED` names another.
const DEFAULT_SEED: u64 = 0x4845_4152_5448_0001;
/// The server's body limit (`MAX_BODY_BYTES`); bodies over it are a 413.
const BODY_LIMIT: usize = 1 << 20;

/// SplitMix64: small, seedable, and the same on every machine.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A number in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// Visible ASCII other than the space (safe in header values and JSON strings).
    fn ascii(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| char::from(b'!' + self.below(94) as u8))
            .filter(|c| *c != '"' && *c != '\\')
            .collect()
    }

    fn letters(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| char::from(b'a' + self.below(26) as u8))
            .collect()
    }

    fn hex(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| char::from(b"0123456789abcdef"[self.below(16)]))
            .collect()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    fn ascii_in(&mut self, lo: usize, hi: usize) -> String {
        let n = self.range(lo, hi);
        self.ascii(n)
    }

    fn letters_in(&mut self, lo: usize, hi: usize) -> String {
        let n = self.range(lo, hi);
        self.letters(n)
    }

    fn bytes_in(&mut self, lo: usize, hi: usize) -> Vec<u8> {
        let n = self.range(lo, hi);
        self.bytes(n)
    }
}

/// One request and the statuses it may get.
#[derive(Debug, Clone)]
struct Case {
    label: String,
    method: String,
    path: String,
    /// Sent as is (values may hold any byte but CR and LF).
    headers: Vec<(String, Vec<u8>)>,
    body: Option<Vec<u8>>,
    /// Send the body with `Transfer-Encoding: chunked` instead of `Content-Length`.
    chunked: bool,
    expect: Vec<u16>,
}

impl Case {
    async fn send(&self, addr: SocketAddr) -> Result<Reply, String> {
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
struct Ctx {
    key: String,
    /// The caller's session, with one finished turn.
    sid: String,
    /// Another user's session.
    foreign_sid: String,
    /// A key that was revoked.
    revoked: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyRoute {
    Create,
    Patch,
    Post,
    Regenerate,
    Completions,
}

const BODY_ROUTES: [BodyRoute; 5] = [
    BodyRoute::Create,
    BodyRoute::Patch,
    BodyRoute::Post,
    BodyRoute::Regenerate,
    BodyRoute::Completions,
];

/// The native routes whose bodies refuse unknown fields.
const STRICT_ROUTES: [BodyRoute; 4] = [
    BodyRoute::Create,
    BodyRoute::Patch,
    BodyRoute::Post,
    BodyRoute::Regenerate,
];

impl BodyRoute {
    fn method(self) -> &'static str {
        match self {
            Self::Patch => "PATCH",
            _ => "POST",
        }
    }

    fn path(self, sid: &str) -> String {
        match self {
            Self::Create => "/v1/sessions".into(),
            Self::Patch => format!("/v1/sessions/{sid}"),
            Self::Post => format!("/v1/sessions/{sid}/messages"),
            Self::Regenerate => format!("/v1/sessions/{sid}/regenerate"),
            Self::Completions => "/v1/chat/completions".into(),
        }
    }

    /// A body the route accepts (so a request with it fails only for another reason).
    fn valid(self) -> Value {
        match self {
            Self::Create => json!({"title": "probe", "system_prompt": "Be brief."}),
            Self::Patch => json!({"title": "renamed by a probe"}),
            Self::Post => json!({"content": "Hello", "max_tokens": 4, "stream": false}),
            Self::Regenerate => json!({"max_tokens": 4, "stream": false}),
            Self::Completions => json!({
                "model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hello"}]
            }),
        }
    }

    /// Fields of the route's body and the kind of value each takes.
    fn fields(self) -> &'static [(&'static str, Kind)] {
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
enum Kind {
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

/// A JSON value that is not of `kind` (never `null`: several fields take it as "absent").
fn wrong_type(rng: &mut Rng, kind: Kind) -> Value {
    let pool: Vec<Value> = match kind {
        Kind::Str => vec![
            json!(1),
            json!(-2.5),
            json!(true),
            json!([]),
            json!(["a"]),
            json!({}),
        ],
        Kind::Bool => vec![json!("true"), json!(1), json!(0), json!([]), json!({})],
        Kind::U32 => vec![
            json!("12"),
            json!(-1),
            json!(1.5),
            json!(4_294_967_296_u64),
            json!(1e12),
            json!(-1e30),
            json!(true),
            json!([4]),
        ],
        Kind::U64 => vec![json!(-1), json!(0.5), json!("7"), json!(1e30), json!(false)],
        Kind::F32 => vec![json!("0.5"), json!(true), json!([0.5]), json!({"v": 1})],
        Kind::Strings => vec![
            json!("stop"),
            json!(3),
            json!([1]),
            json!([null]),
            json!({}),
        ],
        Kind::StopField => vec![json!(3), json!([1, 2]), json!({}), json!(true)],
        Kind::Params => vec![
            json!("greedy"),
            json!(1),
            json!(["x"]),
            json!({"temperature": "hot"}),
            json!({"top_k": -1}),
            json!({"seed": "x"}),
            json!({"top_p": [1]}),
        ],
        Kind::Messages => vec![
            json!("Hello"),
            json!({}),
            json!([1]),
            json!([{"role": 1, "content": "x"}]),
            json!([{"content": "no role"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"text": "no type"}]}]),
        ],
        Kind::Object => vec![json!(1), json!("x"), json!(false), json!([1])],
    };
    rng.pick(&pool).clone()
}

/// Sampling parameters that are well typed but out of range.
fn bad_params(rng: &mut Rng) -> Value {
    let pool = [
        json!({"temperature": -0.5}),
        json!({"temperature": 100.5}),
        json!({"temperature": 1e39}),
        json!({"temperature": -1e39}),
        json!({"top_p": 0}),
        json!({"top_p": 1.5}),
        json!({"top_p": -3}),
        json!({"min_p": 2}),
        json!({"min_p": -0.1}),
        json!({"repetition_penalty": 0}),
        json!({"repetition_penalty": 11}),
        json!({"repetition_penalty": -1}),
        json!({"repetition_penalty": 1e39}),
    ];
    rng.pick(&pool).clone()
}

fn with(mut body: Value, field: &str, v: Value) -> Value {
    body[field] = v;
    body
}

fn without(mut body: Value, field: &str) -> Value {
    if let Some(o) = body.as_object_mut() {
        o.remove(field);
    }
    body
}

/// A string of `limit + 1` to `limit + extra` bytes.
fn long_text_over(rng: &mut Rng, limit: usize, extra: usize) -> String {
    let n = limit + rng.range(1, extra);
    long_text(rng, n)
}

/// A string that is `n` bytes long and not blank.
fn long_text(rng: &mut Rng, n: usize) -> String {
    let unit = rng.pick(&["a", "é", "語", "🦀", "ab cd "]).to_string();
    let mut s = unit.repeat(n / unit.len() + 1);
    while s.len() > n {
        s.pop();
    }
    s.insert(0, 'x');
    s
}

/// A well-formed body with a value the route refuses (422).
fn out_of_range(rng: &mut Rng, route: BodyRoute) -> (String, Value) {
    let v = route.valid();
    let nul = "before\u{0}after";
    let choices: Vec<(&str, Value)> = match route {
        BodyRoute::Create | BodyRoute::Patch => vec![
            (
                "title too long",
                with(v.clone(), "title", json!("t".repeat(rng.range(201, 5000)))),
            ),
            (
                "multibyte title too long",
                with(v.clone(), "title", json!("é".repeat(201))),
            ),
            ("NUL in title", with(v.clone(), "title", json!(nul))),
            (
                "NUL in system prompt",
                with(v.clone(), "system_prompt", json!(nul)),
            ),
            (
                "system prompt too long",
                with(
                    v.clone(),
                    "system_prompt",
                    json!(long_text_over(rng, 64 << 10, 200_000)),
                ),
            ),
            (
                "params out of range",
                with(v.clone(), "params", bad_params(rng)),
            ),
        ],
        BodyRoute::Post => vec![
            ("content missing", without(v.clone(), "content")),
            ("content empty", with(v.clone(), "content", json!(""))),
            (
                "content blank",
                with(v.clone(), "content", json!(" \n\t \r\n")),
            ),
            ("NUL in content", with(v.clone(), "content", json!(nul))),
            (
                "content too long",
                with(
                    v.clone(),
                    "content",
                    json!(long_text_over(rng, 256 << 10, 500_000)),
                ),
            ),
            (
                "params out of range",
                with(v.clone(), "params", bad_params(rng)),
            ),
            ("max_tokens 0", with(v.clone(), "max_tokens", json!(0))),
            (
                "max_tokens over the context",
                with(
                    v.clone(),
                    "max_tokens",
                    json!(rng.range(1024, 4_294_967_295)),
                ),
            ),
            (
                "too many stop strings",
                with(v.clone(), "stop", json!(vec!["s"; rng.range(17, 200)])),
            ),
            (
                "empty stop string",
                with(v.clone(), "stop", json!(["ok", ""])),
            ),
            (
                "stop string too long",
                with(v.clone(), "stop", json!(["s".repeat(rng.range(257, 5000))])),
            ),
        ],
        BodyRoute::Regenerate => vec![
            (
                "content on regenerate",
                with(v.clone(), "content", json!("again")),
            ),
            (
                "empty content on regenerate",
                with(v.clone(), "content", json!("")),
            ),
            (
                "params out of range",
                with(v.clone(), "params", bad_params(rng)),
            ),
            ("max_tokens 0", with(v.clone(), "max_tokens", json!(0))),
            (
                "max_tokens over the context",
                with(
                    v.clone(),
                    "max_tokens",
                    json!(rng.range(1024, 4_294_967_295)),
                ),
            ),
            (
                "too many stop strings",
                with(v.clone(), "stop", json!(vec!["s"; rng.range(17, 200)])),
            ),
            ("empty stop string", with(v.clone(), "stop", json!([""]))),
        ],
        BodyRoute::Completions => {
            let params = bad_params(rng);
            let (k, pv) = params
                .as_object()
                .and_then(|o| o.iter().next())
                .map(|(k, v)| (k.clone(), v.clone()))
                .unwrap_or_else(|| ("temperature".into(), json!(-1)));
            let msg = |content: Value| json!([{"role": "user", "content": content}]);
            let role = *rng.pick(&["tool", "function", "", "USER", "robot"]);
            vec![
                ("no messages", with(v.clone(), "messages", json!([]))),
                ("messages missing", without(v.clone(), "messages")),
                (
                    "unsupported role",
                    with(
                        v.clone(),
                        "messages",
                        json!([{"role": role, "content": "x"}]),
                    ),
                ),
                ("sampling out of range", with(v.clone(), &k, pv)),
                ("n > 1", with(v.clone(), "n", json!(rng.range(2, 1000)))),
                ("n = 0", with(v.clone(), "n", json!(0))),
                (
                    "frequency penalty",
                    with(v.clone(), "frequency_penalty", json!(0.5)),
                ),
                (
                    "presence penalty",
                    with(v.clone(), "presence_penalty", json!(-1.25)),
                ),
                ("logprobs", with(v.clone(), "logprobs", json!(true))),
                (
                    "tools",
                    with(
                        v.clone(),
                        "tools",
                        json!([{"type": "function", "function": {"name": "f"}}]),
                    ),
                ),
                (
                    "json response format",
                    with(v.clone(), "response_format", json!({"type": "json_object"})),
                ),
                ("max_tokens 0", with(v.clone(), "max_tokens", json!(0))),
                (
                    "max_completion_tokens 0",
                    with(v.clone(), "max_completion_tokens", json!(0)),
                ),
                (
                    "max_tokens over the context",
                    with(
                        v.clone(),
                        "max_tokens",
                        json!(rng.range(1024, 4_294_967_295)),
                    ),
                ),
                (
                    "too many stop strings",
                    with(v.clone(), "stop", json!(vec!["s"; rng.range(17, 100)])),
                ),
                ("empty stop string", with(v.clone(), "stop", json!(""))),
                (
                    "stop string too long",
                    with(v.clone(), "stop", json!("s".repeat(rng.range(257, 4000)))),
                ),
                (
                    "NUL in content",
                    with(v.clone(), "messages", msg(json!(nul))),
                ),
                (
                    "content too long",
                    with(
                        v.clone(),
                        "messages",
                        msg(json!(long_text_over(rng, 256 << 10, 400_000))),
                    ),
                ),
                (
                    "image part",
                    with(
                        v.clone(),
                        "messages",
                        msg(json!([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
                    ),
                ),
                (
                    "text part without text",
                    with(v.clone(), "messages", msg(json!([{"type": "text"}]))),
                ),
            ]
        }
    };
    let (label, body) = rng.pick(&choices).clone();
    (label.to_string(), body)
}

/// A body that is not JSON (400), or whose syntax error comes after a wrongly typed value: the
/// deserializer stops at the first problem, so deep nesting where a field wants a string is a
/// 422 and only deep nesting inside a free-form value (`tools`) reaches the recursion limit.
fn not_json(rng: &mut Rng, route: BodyRoute) -> (String, Vec<u8>, &'static [u16]) {
    let valid = route.valid().to_string();
    let field = rng.pick(route.fields()).0;
    let depth = rng.range(129, 100_000);
    let invalid_utf8: [&[u8]; 5] = [
        b"\xFF\xFE",
        b"\xC3\x28",
        b"\xED\xA0\x80",
        b"\xF8\x88\x80\x80\x80",
        b"\xC0\xAF",
    ];
    let choices: Vec<(&str, Vec<u8>)> = vec![
        ("empty body", Vec::new()),
        (
            "truncated",
            valid.as_bytes()[..rng.range(1, valid.len() - 1)].to_vec(),
        ),
        (
            "trailing garbage",
            format!("{valid}{}", rng.ascii_in(1, 40)).into_bytes(),
        ),
        ("two documents", format!("{valid} {valid}").into_bytes()),
        ("single quotes", valid.replace('"', "'").into_bytes()),
        (
            "trailing comma",
            format!("{},}}", &valid[..valid.len() - 1]).into_bytes(),
        ),
        ("comment", format!("/* hi */{valid}").into_bytes()),
        (
            "byte order mark",
            [b"\xEF\xBB\xBF".as_slice(), valid.as_bytes()].concat(),
        ),
        ("NaN", format!("{{\"{field}\": NaN}}").into_bytes()),
        (
            "Infinity",
            format!("{{\"{field}\": Infinity}}").into_bytes(),
        ),
        (
            "-Infinity",
            format!("{{\"{field}\": -Infinity}}").into_bytes(),
        ),
        (
            "NaN in params",
            b"{\"params\": {\"temperature\": NaN}}".to_vec(),
        ),
        (
            "number out of range",
            format!("{{\"{field}\": 1e{}}}", rng.range(400, 100_000)).into_bytes(),
        ),
        (
            "lone surrogate escape",
            format!("{{\"{field}\": \"\\ud800\"}}").into_bytes(),
        ),
        (
            "bad escape",
            format!("{{\"{field}\": \"\\x41\"}}").into_bytes(),
        ),
        (
            "raw control character",
            format!("{{\"{field}\": \"a\nb\"}}").into_bytes(),
        ),
        ("unquoted key", format!("{{{field}: 1}}").into_bytes()),
        (
            "random bytes",
            [b"\xFF".as_slice(), &rng.bytes_in(1, 4000)].concat(),
        ),
        (
            "random text",
            format!("x{}", rng.ascii_in(1, 4000)).into_bytes(),
        ),
        (
            "invalid UTF-8 in a string",
            [
                format!("{{\"{field}\": \"ab").as_bytes(),
                *rng.pick(&invalid_utf8),
                b"cd\"}",
            ]
            .concat(),
        ),
        (
            "invalid UTF-8 in a key",
            [b"{\"\xFF".as_slice(), field.as_bytes(), b"\": 1}"].concat(),
        ),
    ];
    let nested: Vec<(&str, Vec<u8>, &'static [u16])> = vec![
        (
            "deep nesting",
            format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes(),
            &[400, 422],
        ),
        (
            "deep object nesting",
            format!(
                "{{\"{field}\": {}1{}}}",
                "{\"a\":".repeat(depth.min(20_000)),
                "}".repeat(depth.min(20_000))
            )
            .into_bytes(),
            &[400, 422],
        ),
        (
            "unclosed nesting",
            "[".repeat(depth).into_bytes(),
            &[400, 422],
        ),
    ];
    if route == BodyRoute::Completions && rng.chance(30) {
        let mut body = route.valid().to_string();
        body.pop();
        body += &format!(",\"tools\": {}{}}}", "[".repeat(depth), "]".repeat(depth));
        return ("deep nesting in tools".into(), body.into_bytes(), &[400]);
    }
    if rng.chance(15) {
        let (label, body, expect) = rng.pick(&nested).clone();
        return (label.to_string(), body, expect);
    }
    let (label, body) = rng.pick(&choices).clone();
    (label.to_string(), body, &[400])
}

/// Ids that name no session: `(text for the path, label)`.
fn bad_id(rng: &mut Rng, ctx: &Ctx) -> (String, String) {
    let encoded: String = rng
        .bytes_in(1, 40)
        .iter()
        .map(|b| format!("%{b:02X}"))
        .collect();
    let choices: Vec<(String, &str)> = vec![
        (encoded, "percent-encoded random bytes"),
        ("%FF%FE%FD".into(), "percent-encoded invalid UTF-8"),
        ("%C0%AF".into(), "overlong UTF-8"),
        ("%ED%A0%80".into(), "encoded surrogate"),
        (format!("{}%00", ctx.sid), "id with an encoded NUL"),
        (ctx.sid.to_uppercase(), "upper-case id"),
        (ctx.sid[..31].to_string(), "id one character short"),
        (format!("{}0", ctx.sid), "id one character long"),
        (format!("{}%20", ctx.sid), "id with an encoded space"),
        (format!("%20{}", ctx.sid), "id after an encoded space"),
        (rng.hex(32), "well-formed unknown id"),
        (ctx.foreign_sid.clone(), "another user's session"),
        ("%2e%2e".into(), "encoded dot-dot"),
        ("..%2F..%2Fetc%2Fpasswd".into(), "encoded traversal"),
        ("%2F".into(), "encoded slash"),
        ("'%20OR%20'1'%3D'1".into(), "SQL injection"),
        ("%E2%98%83%F0%9F%A6%80".into(), "encoded emoji"),
        ("%".into(), "lone percent"),
        ("%zz%4".into(), "broken percent-encoding"),
        ("null".into(), "null"),
        ("-1".into(), "negative number"),
        (rng.letters_in(33, 4000), "very long id"),
        (format!("{}{}", ctx.sid, rng.hex(32)), "two ids"),
    ];
    let (id, label) = rng.pick(&choices).clone();
    (id, label.to_string())
}

fn bearer(key: &str) -> Vec<u8> {
    format!("Bearer {key}").into_bytes()
}

/// `Authorization` values that are not a live key (`None`: no header).
fn bad_auth(rng: &mut Rng, ctx: &Ctx) -> (String, Option<Vec<u8>>) {
    let mut flipped = ctx.key.clone().into_bytes();
    let at = rng.range(3, flipped.len() - 1);
    flipped[at] = if flipped[at] == b'0' { b'1' } else { b'0' };
    let flipped = String::from_utf8(flipped).unwrap_or_default();
    let choices: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("no Authorization", None),
        ("empty Authorization", Some(Vec::new())),
        ("scheme only", Some(b"Bearer".to_vec())),
        ("empty token", Some(b"Bearer ".to_vec())),
        ("basic auth", Some(b"Basic dXNlcjpwYXNzd29yZA==".to_vec())),
        (
            "lower-case scheme",
            Some(format!("bearer {}", ctx.key).into_bytes()),
        ),
        (
            "other scheme",
            Some(format!("Token {}", ctx.key).into_bytes()),
        ),
        (
            "tab after the scheme",
            Some(format!("Bearer\t{}", ctx.key).into_bytes()),
        ),
        ("raw key", Some(ctx.key.clone().into_bytes())),
        ("one character changed", Some(bearer(&flipped))),
        ("key too short", Some(bearer(&ctx.key[..ctx.key.len() - 1]))),
        ("key too long", Some(bearer(&format!("{}a", ctx.key)))),
        ("unknown key", Some(bearer(&format!("hk_{}", rng.hex(64))))),
        (
            "upper-case hex",
            Some(bearer(&format!("hk_{}", ctx.key[3..].to_uppercase()))),
        ),
        ("revoked key", Some(bearer(&ctx.revoked))),
        ("garbage token", Some(bearer(&rng.ascii_in(1, 200)))),
        ("very long token", Some(bearer(&rng.ascii_in(4000, 7900)))),
        (
            "non-ASCII bytes",
            Some([bearer(&ctx.key), b"\xFF\xFE".to_vec()].concat()),
        ),
        (
            "obs-text token",
            Some([b"Bearer hk_".as_slice(), &[0xE9; 64]].concat()),
        ),
        ("SQL in token", Some(bearer("hk_' OR '1'='1"))),
    ];
    let (label, v) = rng.pick(&choices).clone();
    (label.to_string(), v)
}

/// `Content-Type` values that are not JSON (`None`: no header).
fn bad_content_type(rng: &mut Rng) -> (String, Option<Vec<u8>>) {
    let long = format!("application/{}", rng.letters_in(2000, 7900));
    let choices: Vec<Option<&[u8]>> = vec![
        None,
        Some(b""),
        Some(b"text/plain"),
        Some(b"text/json"),
        Some(b"application/jsonx"),
        Some(b"application/x-www-form-urlencoded"),
        Some(b"multipart/form-data; boundary=xyz"),
        Some(b"application/octet-stream"),
        Some(b"application"),
        Some(b"*/*"),
        Some(b"json"),
        Some(b"application/xml"),
        Some(b"application/\xFFjson"),
        Some(long.as_bytes()),
    ];
    let v = rng.pick(&choices).map(<[u8]>::to_vec);
    let label = match &v {
        None => "no Content-Type".to_string(),
        Some(b) => format!(
            "Content-Type {:?}",
            String::from_utf8_lossy(&b[..b.len().min(40)])
        ),
    };
    (label, v)
}

fn json_ct() -> (String, Vec<u8>) {
    ("Content-Type".into(), b"application/json".to_vec())
}

fn auth(key: &str) -> (String, Vec<u8>) {
    ("Authorization".into(), bearer(key))
}

/// A request that is only wrong in its body.
fn body_case(ctx: &Ctx, route: BodyRoute, label: String, body: Vec<u8>, expect: &[u16]) -> Case {
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

/// Routes without a body, with an id in the path.
const ID_ROUTES: [(&str, &str); 5] = [
    ("GET", "/v1/sessions/{id}"),
    ("DELETE", "/v1/sessions/{id}"),
    ("GET", "/v1/sessions/{id}/messages"),
    ("POST", "/v1/sessions/{id}/stop"),
    ("GET", "/v1/sessions/{id}/stream"),
];

/// One generated request.
/// The kinds of malformed request, each tested on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
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

fn generate(rng: &mut Rng, ctx: &Ctx, family: Family) -> Case {
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
fn pinned(ctx: &Ctx) -> Vec<Case> {
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

fn trim(s: &str) -> String {
    trim_to(s, 80)
}

fn trim_to(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}

/// What must not change: the caller's sessions, the used session and its messages, and another
/// user's session and messages.
async fn snapshot(
    addr: SocketAddr,
    key: &str,
    sid: &str,
    foreign_key: &str,
    foreign_sid: &str,
) -> Value {
    let get = |path: String, key: String| async move {
        let r = Req::new("GET", &path).key(Some(&key)).send(addr).await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
        r.json()
    };
    let sessions = get("/v1/sessions?limit=100".into(), key.into()).await;
    let session = get(format!("/v1/sessions/{sid}"), key.into()).await;
    let messages = get(format!("/v1/sessions/{sid}/messages"), key.into()).await;
    let foreign_sessions = get("/v1/sessions?limit=100".into(), foreign_key.into()).await;
    let foreign_messages = get(
        format!("/v1/sessions/{foreign_sid}/messages"),
        foreign_key.into(),
    )
    .await;
    json!({
        "sessions": sessions,
        "session": session,
        "messages": messages,
        "foreign_sessions": foreign_sessions,
        "foreign_messages": foreign_messages,
    })
}

/// The parts of two snapshots that differ, briefly.
fn diff(before: &Value, after: &Value) -> String {
    let (Some(b), Some(a)) = (before.as_object(), after.as_object()) else {
        return format!("{before} -> {after}");
    };
    b.iter()
        .filter(|(k, v)| a.get(*k) != Some(*v))
        .map(|(k, v)| {
            let then = v.to_string();
            let now = a.get(k).map(Value::to_string).unwrap_or_default();
            format!("\n  {k}: {} -> {}", trim_to(&then, 600), trim_to(&now, 600))
        })
        .collect()
}

/// Why an answer does not meet the contract, if it does not.
fn check(c: &Case, a: &Reply) -> Option<String> {
    let body = String::from_utf8_lossy(&a.body);
    let shown = trim(&body);
    if !(400..500).contains(&a.status) {
        return Some(format!("status {} (not a 4xx): {shown}", a.status));
    }
    if !c.expect.contains(&a.status) {
        return Some(format!(
            "status {}, expected {:?}: {shown}",
            a.status, c.expect
        ));
    }
    if !a
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/json"))
    {
        return Some(format!(
            "status {} with Content-Type {:?}: {shown}",
            a.status,
            a.header("content-type")
        ));
    }
    let v: Value = match serde_json::from_slice(&a.body) {
        Ok(v) => v,
        Err(e) => {
            return Some(format!(
                "status {}, body is not JSON ({e}): {shown}",
                a.status
            ))
        }
    };
    let message = v["error"]["message"].as_str();
    if message.is_none_or(str::is_empty) || !v["error"]["type"].is_string() {
        return Some(format!(
            "status {}, not an API error body: {shown}",
            a.status
        ));
    }
    None
}

/// Sends `n` generated requests of `family` (and, with `pinned`, the requests of [`pinned`]) to
/// a fresh stack, and checks that each gets its documented JSON 4xx, that what is stored is
/// unchanged, and that the server is still ready.
async fn probe(tag: &str, family: Family, n: usize, with_pinned: bool) {
    let seed = std::env::var("HEARTH_BAD_INPUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    let s = Stack::start(tag, Db::Postgres, 1, &[]).await;
    let key = s.key("prober").await;
    let foreign_key = s.key("alice").await;
    // A key that existed and was revoked.
    let revoked = s.key("prober").await;
    let rows = s
        .store
        .api_keys_by_prefix(&revoked[..11])
        .await
        .expect("keys");
    let (record, _) = rows.first().expect("the new key");
    s.store
        .revoke_api_key(&record.id, now_ms())
        .await
        .expect("revoke");
    let addr = s.addr();

    // The caller's session with one finished turn, and another user's.
    let mut sids = Vec::new();
    for k in [&key, &foreign_key] {
        let r = Req::new("POST", "/v1/sessions")
            .key(Some(k))
            .json(&json!({"title": "kept", "params": {"temperature": 0.5}}))
            .send(addr)
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let sid = r.json()["id"].as_str().expect("id").to_string();
        let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
            .key(Some(k))
            .json(&json!({"content": "Hello", "max_tokens": 6, "stream": false}))
            .send(addr)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        sids.push(sid);
    }
    let ctx = Ctx {
        key: key.clone(),
        sid: sids[0].clone(),
        foreign_sid: sids[1].clone(),
        revoked,
    };
    let before = snapshot(addr, &key, &ctx.sid, &foreign_key, &ctx.foreign_sid).await;

    let mut rng = Rng(seed ^ family as u64);
    let mut cases: Vec<Case> = (0..n).map(|_| generate(&mut rng, &ctx, family)).collect();
    if with_pinned {
        // Last, so that one getting through cannot disturb the generated ones.
        cases.extend(pinned(&ctx));
    }
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeMap::<u16, usize>::new();
    for (i, c) in cases.iter().enumerate() {
        match c.send(addr).await {
            Ok(a) => {
                *seen.entry(a.status).or_default() += 1;
                if let Some(why) = check(c, &a) {
                    failures.push(format!("#{i} {}: {why}", c.label));
                }
            }
            Err(e) => failures.push(format!("#{i} {}: {e}", c.label)),
        }
    }
    let took = started.elapsed();
    let n = cases.len();
    eprintln!(
        "{n} malformed requests ({family:?}, seed {seed:#x}) in {took:.1?}: statuses {seen:?}"
    );

    let after = snapshot(addr, &key, &ctx.sid, &foreign_key, &ctx.foreign_sid).await;
    let ready = Req::new("GET", "/readyz").send(addr).await.status;
    // Drop the test database before judging, so a failure leaves nothing behind.
    s.finish().await;
    let changed = before != after;
    assert!(
        failures.is_empty() && !changed,
        "{} of {n} requests ({family:?}, seed {seed:#x}) broke the contract:\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        if changed {
            format!("and what is stored changed: {}", diff(&before, &after))
        } else {
            "what is stored did not change".to_string()
        }
    );
    assert_eq!(
        ready, 200,
        "the server is not ready after the malformed requests"
    );
}

#[tokio::test]
async fn bodies_that_are_not_json_get_400_or_422() {
    probe("bad_notjson", Family::NotJson, 60, false).await;
}

#[tokio::test]
async fn json_of_the_wrong_shape_gets_422() {
    probe("bad_shape", Family::WrongShape, 60, false).await;
}

#[tokio::test]
async fn unknown_fields_get_422_on_the_native_routes() {
    probe("bad_unknown", Family::UnknownField, 32, false).await;
}

#[tokio::test]
async fn values_out_of_range_get_422() {
    probe("bad_range", Family::OutOfRange, 80, false).await;
}

#[tokio::test]
async fn bodies_over_the_limit_get_413() {
    probe("bad_large", Family::TooLarge, 16, false).await;
}

#[tokio::test]
async fn ids_that_are_not_ids_get_404_on_every_route() {
    probe("bad_id", Family::BadId, 48, false).await;
}

#[tokio::test]
async fn wrong_methods_and_unknown_routes_get_405_or_404() {
    probe("bad_route", Family::WrongRoute, 24, false).await;
}

#[tokio::test]
async fn garbage_authorization_gets_401() {
    probe("bad_auth", Family::BadAuth, 32, false).await;
}

#[tokio::test]
async fn a_wrong_or_missing_content_type_gets_415() {
    probe("bad_ctype", Family::BadContentType, 24, false).await;
}

#[tokio::test]
async fn bad_session_list_queries_get_422() {
    probe("bad_query", Family::BadQuery, 16, false).await;
}

#[tokio::test]
async fn long_headers_and_what_lenient_parsers_take_are_refused_as_json() {
    probe("bad_headers", Family::LongHeaders, 8, true).await;
}
