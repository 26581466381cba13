//! What surrounds a body: ids in the path that name no session, `Authorization` values that are
//! not a live key, and `Content-Type` values that are not JSON.

use hearth_e2e::rng::Rng;

use super::case::{bearer, Ctx};

/// Ids that name no session: `(text for the path, label)`.
pub(crate) fn bad_id(rng: &mut Rng, ctx: &Ctx) -> (String, String) {
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

/// `Authorization` values that are not a live key (`None`: no header).
pub(crate) fn bad_auth(rng: &mut Rng, ctx: &Ctx) -> (String, Option<Vec<u8>>) {
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
pub(crate) fn bad_content_type(rng: &mut Rng) -> (String, Option<Vec<u8>>) {
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
