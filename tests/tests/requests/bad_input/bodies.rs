//! Bodies that are wrong as JSON: not JSON at all (broken syntax, NaN, invalid UTF-8, deep
//! nesting), values of the wrong type, and the strings and sampling parameters the range checks
//! refuse.

use hearth_e2e::rng::Rng;
use serde_json::{json, Value};

use super::case::{BodyRoute, Kind};

/// A JSON value that is not of `kind` (never `null`: several fields take it as "absent").
pub(crate) fn wrong_type(rng: &mut Rng, kind: Kind) -> Value {
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
pub(crate) fn bad_params(rng: &mut Rng) -> Value {
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

/// A string of `limit + 1` to `limit + extra` bytes.
pub(crate) fn long_text_over(rng: &mut Rng, limit: usize, extra: usize) -> String {
    let n = limit + rng.range(1, extra);
    long_text(rng, n)
}

/// A string that is `n` bytes long and not blank.
pub(crate) fn long_text(rng: &mut Rng, n: usize) -> String {
    let unit = rng.pick(&["a", "é", "語", "🦀", "ab cd "]).to_string();
    let mut s = unit.repeat(n / unit.len() + 1);
    while s.len() > n {
        s.pop();
    }
    s.insert(0, 'x');
    s
}

/// A body that is not JSON (400), or whose syntax error comes after a wrongly typed value: the
/// deserializer stops at the first problem, so deep nesting where a field wants a string is a
/// 422 and only deep nesting inside a free-form value (`tools`) reaches the recursion limit.
pub(crate) fn not_json(rng: &mut Rng, route: BodyRoute) -> (String, Vec<u8>, &'static [u16]) {
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
