//! Anthropic's Messages API through the whole stack: raw HTTP (the message, its usage, stop
//! sequences, the events of a stream, errors in Anthropic's shape from every layer) and the
//! unmodified `anthropic` Python client (text, streams, a forced `tool_use` and its result,
//! `count_tokens`, and its error classes).

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::stack::{worker_metric, Db, Stack, DECODED, PREFILLED};
use serde_json::{json, Value};

async fn post(s: &Stack, key: Option<&str>, path: &str, body: &Value) -> Reply {
    let mut req = Req::new("POST", path).json(body);
    if let Some(k) = key {
        // Anthropic's header, not a bearer token.
        req = req.header("x-api-key", k);
    }
    req.send(s.addr()).await
}

fn ask(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "max_tokens": 12,
        "temperature": 0.0,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": content}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test]
async fn a_message_its_usage_stop_sequences_and_its_stream() {
    let s = Stack::start("anthropic", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let r = post(
        &s,
        Some(&k),
        "/v1/messages",
        &ask("Name a colour.", json!({})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(m["type"], "message", "{m}");
    assert_eq!(m["role"], "assistant", "{m}");
    assert!(
        m["id"].as_str().is_some_and(|id| id.starts_with("msg_")),
        "{m}"
    );
    assert!(
        m["model"].as_str().is_some_and(|n| n.starts_with("tiny")),
        "{m}"
    );
    assert_eq!(m["content"][0]["type"], "text", "{m}");
    let text = m["content"][0]["text"].as_str().expect("text").to_string();
    let used = &m["usage"];
    let input = used["input_tokens"].as_u64().expect("input")
        + used["cache_read_input_tokens"].as_u64().expect("cached");
    assert!(input > 8, "{m}");
    let output = used["output_tokens"].as_u64().expect("output");
    assert!((1..=12).contains(&output), "{m}");
    match m["stop_reason"].as_str() {
        Some("max_tokens") => assert_eq!(output, 12, "{m}"),
        Some("end_turn") => {}
        other => panic!("stop_reason {other:?}: {m}"),
    }
    assert!(m["stop_sequence"].is_null(), "{m}");

    // The same prompt counts as the message's input.
    let c = post(
        &s,
        Some(&k),
        "/v1/messages/count_tokens",
        &ask("Name a colour.", json!({})),
    )
    .await;
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(
        c.json()["input_tokens"].as_u64(),
        Some(input),
        "{}",
        c.text()
    );

    // Greedy again, stopped by a piece of that text: the reply ends before it, and says which.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "a reply too short to cut: {text:?}");
    let stop: String = chars[2..4].iter().collect();
    let before = &text[..text.find(&stop).expect("the stop is in the text")];
    let body = ask(
        "Name a colour.",
        json!({"stop_sequences": ["\u{1F600}never", stop]}),
    );
    let m = post(&s, Some(&k), "/v1/messages", &body).await.json();
    assert_eq!(m["stop_reason"], "stop_sequence", "{m}");
    assert_eq!(m["stop_sequence"].as_str(), Some(stop.as_str()), "{m}");
    assert_eq!(m["content"][0]["text"].as_str(), Some(before), "{m}");

    // Streamed (as Claude Code asks: `?beta=true`, a version header): the events in
    // Anthropic's order, the deltas adding up to the same text.
    let body = ask("Name a colour.", json!({"stream": true}));
    let mut sse = Req::new("POST", "/v1/messages?beta=true")
        .header("x-api-key", k.as_str())
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .events(s.addr())
        .await;
    let mut names = Vec::new();
    let mut streamed = String::new();
    let mut stop_reason = Value::Null;
    while let Some(e) = sse.next().await {
        let data: Value = serde_json::from_str(&e.data).expect("JSON data");
        assert_eq!(data["type"].as_str(), Some(e.event.as_str()), "{data}");
        if e.event == "content_block_delta" {
            assert_eq!(data["index"], 0, "{data}");
            streamed.push_str(data["delta"]["text"].as_str().expect("text delta"));
        }
        if e.event == "message_delta" {
            stop_reason = data["delta"]["stop_reason"].clone();
            assert_eq!(
                data["usage"]["output_tokens"].as_u64(),
                Some(output),
                "{data}"
            );
        }
        if names.last().is_none_or(|n: &String| *n != e.event) {
            names.push(e.event.clone());
        }
    }
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ],
    );
    assert_eq!(streamed, text);
    assert_eq!(stop_reason, m_stop_reason(output));
    s.finish().await;
}

/// The stop reason of the unstopped greedy reply, from its length.
fn m_stop_reason(output: u64) -> Value {
    json!(if output == 12 {
        "max_tokens"
    } else {
        "end_turn"
    })
}

#[tokio::test]
async fn errors_have_anthropics_shape_from_every_layer_and_change_nothing() {
    let s = Stack::start("anthropicerr", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    // One message first, so that the worker's counters exist.
    let r = post(
        &s,
        Some(&k),
        "/v1/messages",
        &ask("Hi", json!({"max_tokens": 1})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let work = async |s: &Stack| {
        let w = &s.workers[0];
        worker_metric(w, PREFILLED).await + worker_metric(w, DECODED).await
    };
    let before = work(&s).await;
    let shape = |r: &Reply, status: u16, kind: &str, names: &str| {
        assert_eq!(r.status, status, "{}", r.text());
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        let message = v["error"]["message"].as_str().expect("message");
        assert!(message.contains(names), "{names:?} not in {message:?}");
    };
    // The body guard answers before any handler: no key, a wrong one.
    let body = ask("Hi", json!({}));
    shape(
        &post(&s, None, "/v1/messages", &body).await,
        401,
        "authentication_error",
        "API key",
    );
    shape(
        &post(&s, Some("hk_wrong"), "/v1/messages", &body).await,
        401,
        "authentication_error",
        "API key",
    );
    // Bad values: a 400 that names the field.
    let cases = [
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"temperature": -1.0}), "temperature"),
        (json!({"stop_sequences": [""]}), "stop_sequences"),
        (
            json!({"tool_choice": {"type": "tool", "name": "nope"}}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_x", "content": "42"}]}]}),
            "messages[0].content[0].tool_use_id",
        ),
        (
            json!({"messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": "hello"}), "messages"),
    ];
    for (extra, names) in cases {
        let r = post(&s, Some(&k), "/v1/messages", &ask("Hi", extra.clone())).await;
        shape(&r, 400, "invalid_request_error", names);
    }
    let mut no_max = ask("Hi", json!({}));
    no_max.as_object_mut().expect("object").remove("max_tokens");
    shape(
        &post(&s, Some(&k), "/v1/messages", &no_max).await,
        400,
        "invalid_request_error",
        "max_tokens",
    );
    shape(
        &post(
            &s,
            Some(&k),
            "/v1/messages",
            &ask("Hi", json!({"model": "claude-none"})),
        )
        .await,
        404,
        "not_found_error",
        "claude-none",
    );
    // Not JSON at all.
    let r = Req::new("POST", "/v1/messages")
        .header("x-api-key", k.as_str())
        .raw(b"{".to_vec())
        .send(s.addr())
        .await;
    shape(&r, 400, "invalid_request_error", "");
    // The other APIs keep their own shape.
    let r = post(&s, None, "/v1/chat/completions", &json!({})).await;
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["code"].is_string(), "{}", r.text());
    // No worker ran any of them.
    assert_eq!(
        work(&s).await,
        before,
        "a refused request reached the worker"
    );
    s.finish().await;
}

const CLIENT: &str = r#"
import json, os, anthropic
client = anthropic.Anthropic(base_url=os.environ["BASE_URL"], api_key=os.environ["API_KEY"],
                             max_retries=0)
model = "tiny"
# Greedy: the SDK's create() no longer takes `temperature`, so it goes in the body.
greedy = {"temperature": 0.0}
m = client.messages.create(model=model, max_tokens=8, extra_body=greedy,
                           system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
assert m.type == "message" and m.content[0].type == "text", m
assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1, m

# A stream, through the SDK's own accumulator: the same text as the whole message.
with client.messages.stream(model=model, max_tokens=8, extra_body=greedy, system="Be brief.",
                            messages=[{"role": "user", "content": "Hi"}]) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text == m.content[0].text == final.content[0].text, (text, m, final)
assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, final

# A forced call of a tool: a tool_use block whose input follows the schema.
tools = [{"name": "get_weather", "description": "Weather now",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"], "additionalProperties": False}}]
ask = [{"role": "user", "content": "Weather in Oslo?"}]
t = client.messages.create(model=model, max_tokens=100, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
call = t.content[0]
assert t.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather", t
assert isinstance(call.input["city"], str), call
# Its result goes back; the model answers in words.
follow = client.messages.create(
    model=model, max_tokens=5, tools=tools, tool_choice={"type": "none"},
    messages=ask + [{"role": "assistant", "content": t.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "sunny"}]}])
assert follow.content[0].type == "text" and follow.stop_reason != "tool_use", follow
# Streamed, the call comes as an input_json_delta the SDK assembles.
with client.messages.stream(model=model, max_tokens=100, tools=tools,
                            tool_choice={"type": "any"}, messages=ask) as stream:
    streamed_call = stream.get_final_message()
assert streamed_call.stop_reason == "tool_use", streamed_call
assert isinstance(streamed_call.content[0].input["city"], str), streamed_call

# Structured output: JSON that validates against the schema.
city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
j = client.messages.create(model=model, max_tokens=100, messages=ask,
                           output_config={"format": {"type": "json_schema", "schema": city}})
assert isinstance(json.loads(j.content[0].text)["city"], str), j

n = client.messages.count_tokens(model=model, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), (n, m)

# Errors, as the SDK's classes.
try:
    client.messages.create(model=model, max_tokens=0, messages=ask)
    raise SystemExit("max_tokens 0 was accepted")
except anthropic.BadRequestError as e:
    assert e.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.message, e
try:
    client.messages.create(model="claude-none", max_tokens=4, messages=ask)
    raise SystemExit("an unknown model was served")
except anthropic.NotFoundError:
    pass
try:
    anthropic.Anthropic(base_url=os.environ["BASE_URL"], api_key="hk_wrong", max_retries=0).messages.create(
        model=model, max_tokens=4, messages=ask)
    raise SystemExit("a wrong key was accepted")
except anthropic.AuthenticationError:
    pass
print(json.dumps({"text": text, "call": call.input}))
"#;

#[tokio::test]
async fn the_unmodified_anthropic_python_client_works() {
    let s = Stack::start("anthropicpy", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let base = format!("http://{}", s.addr());
    let v = hearth_e2e::client::run_python("anthropic", CLIENT, &base, &k).await;
    assert!(
        v["text"].is_string() && v["call"]["city"].is_string(),
        "{v}"
    );
    s.finish().await;
}
