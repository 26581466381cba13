//! Well-formed bodies with a value each route refuses (422): too long, empty, NUL bytes,
//! numbers out of range, and OpenAI features asked for in ways Hearth cannot honour.

use hearth_e2e::rng::Rng;
use serde_json::{json, Value};

use super::bodies::{bad_params, long_text_over};
use super::case::{with, without, BodyRoute};

/// A well-formed body with a value the route refuses (422).
pub(crate) fn out_of_range(rng: &mut Rng, route: BodyRoute) -> (String, Value) {
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
                ("n > 16", with(v.clone(), "n", json!(rng.range(17, 1000)))),
                ("n = 0", with(v.clone(), "n", json!(0))),
                (
                    "frequency penalty",
                    with(v.clone(), "frequency_penalty", json!(2.5)),
                ),
                (
                    "presence penalty",
                    with(v.clone(), "presence_penalty", json!(-3.25)),
                ),
                (
                    "top_logprobs over 20",
                    with(
                        with(v.clone(), "logprobs", json!(true)),
                        "top_logprobs",
                        json!(rng.range(21, 1000)),
                    ),
                ),
                (
                    "top_logprobs without logprobs",
                    with(v.clone(), "top_logprobs", json!(rng.range(1, 20))),
                ),
                (
                    "end user name too long",
                    with(v.clone(), "user", json!("u".repeat(rng.range(257, 2000)))),
                ),
                (
                    "tool with a bad name",
                    with(
                        v.clone(),
                        "tools",
                        json!([{"type": "function", "function": {"name": "f g"}}]),
                    ),
                ),
                (
                    "tool choice naming no tool",
                    with(
                        with(
                            v.clone(),
                            "tools",
                            json!([{"type": "function", "function": {"name": "f"}}]),
                        ),
                        "tool_choice",
                        json!({"type": "function", "function": {"name": "g"}}),
                    ),
                ),
                (
                    "json schema format with a bad name",
                    with(
                        v.clone(),
                        "response_format",
                        json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
                    ),
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
