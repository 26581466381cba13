//! Tool calling on the native API, end to end with the tiny random-weight model. A forced call
//! is constrained to the tool's schema, so even this model makes a call that parses and
//! validates. The reply keeps the text that made the call and gains `tool_calls`; the results
//! are posted as `tool_results`, stored as `tool` messages, and answered by the next reply,
//! whose prompt extends the session's cached one. Requests that do not answer the last reply's
//! calls are refused by name and store nothing.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{history, new_session, post, Db, Stack};
use serde_json::{json, Value};

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": false}}},
           {"type": "function", "function": {"name": "now"}}])
}

fn named(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name}})
}

/// The city a `get_weather` call's arguments name; panics unless they validate.
fn city(call: &Value) -> String {
    assert_eq!(call["type"], "function", "{call}");
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    let args = call["function"]["arguments"].as_str().expect("arguments");
    let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {args}"));
    assert_eq!(o.keys().collect::<Vec<_>>(), vec!["city"], "{args}");
    let c = o["city"].as_str().unwrap_or_else(|| panic!("{args}"));
    assert!(c.chars().count() <= 12, "{args}");
    c.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_calls_a_tool_stores_its_result_and_answers_it() {
    let s = Stack::start("native_tools", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let path = format!("/v1/sessions/{sid}/messages");

    // A named call, streamed: the text streams as tokens, and `message_end` carries the call.
    let mut sse = Req::new("POST", &path)
        .key(Some(&k))
        .json(&json!({"content": "Weather in Oslo?", "max_tokens": 160, "tools": weather_tools(),
                      "tool_choice": named("get_weather"), "params": {"temperature": 1.0, "seed": 5}}))
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let events = sse.rest().await;
    let end = events.last().expect("events");
    assert_eq!(end.event, "message_end", "{events:?}");
    let end = end.json();
    assert_eq!(end["finish_reason"], "tool_calls", "{end}");
    let calls = end["tool_calls"].as_array().expect("tool_calls").clone();
    assert_eq!(calls.len(), 1, "{end}");
    city(&calls[0]);
    let call_id = calls[0]["id"].as_str().expect("id").to_string();
    let streamed: String = events
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().expect("text").to_string())
        .collect();

    // Stored: the text that made the call, and the call itself.
    let stored = history(s.addr(), &k, &sid).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1]["content"], streamed.as_str());
    assert_eq!(stored[1]["finish_reason"], "tool_calls");
    assert_eq!(stored[1]["tool_calls"], json!(calls));
    assert_eq!(stored[0]["tool_calls"], Value::Null);
    let first_prompt = stored[1]["prompt_tokens"].as_i64().expect("prompt tokens");

    // The result, posted: stored as a `tool` message, and answered.
    let r = post(
        s.addr(),
        &k,
        &path,
        &json!({"tool_results": [{"tool_call_id": call_id, "content": "{\"temp_c\": 12}"}],
                "tools": weather_tools(), "stream": false, "max_tokens": 8}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reply = r.json();
    assert_ne!(reply["finish_reason"], "tool_calls", "{reply}");
    let stored = history(s.addr(), &k, &sid).await;
    let roles: Vec<&str> = stored
        .iter()
        .map(|m| m["role"].as_str().expect("role"))
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(stored[2]["tool_call_id"], call_id.as_str());
    assert_eq!(stored[2]["content"], "{\"temp_c\": 12}");
    assert_eq!(reply["user_message_id"], stored[2]["id"], "{reply}");
    assert_eq!(reply["message_id"], stored[3]["id"]);
    // The history as rendered extends the session's first prompt, which the worker kept.
    let cached = stored[3]["cached_tokens"].as_i64().expect("cached tokens");
    assert!(cached >= first_prompt, "{cached} < {first_prompt}");

    // Regenerate answers the result again, in place.
    let r = post(
        s.addr(),
        &k,
        &format!("/v1/sessions/{sid}/regenerate"),
        &json!({"tools": weather_tools(), "stream": false, "max_tokens": 8}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["user_message_id"], stored[2]["id"]);
    let after = history(s.addr(), &k, &sid).await;
    assert_eq!(after.len(), 4);
    assert_eq!(after[2], stored[2]);
    assert_ne!(after[3]["id"], stored[3]["id"]);

    // `required` among two tools, not streamed: the call is in the answer itself.
    let r = post(
        s.addr(),
        &k,
        &path,
        &json!({"content": "And in Rome?", "tools": weather_tools(), "tool_choice": "required",
                "stream": false, "max_tokens": 160, "params": {"temperature": 1.0, "seed": 9}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["finish_reason"], "tool_calls", "{v}");
    let name = v["tool_calls"][0]["function"]["name"]
        .as_str()
        .expect("name");
    assert!(name == "get_weather" || name == "now", "{v}");
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_that_do_not_answer_the_last_calls_are_refused_and_store_nothing() {
    let s = Stack::start("native_tools_refusals", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let sid = new_session(s.addr(), &k).await;
    let path = format!("/v1/sessions/{sid}/messages");
    let result = |id: &str| json!([{"tool_call_id": id, "content": "12"}]);

    // No reply has made a call yet.
    let r = post(
        s.addr(),
        &k,
        &path,
        &json!({"tool_results": result("call_x")}),
    )
    .await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(r.text().contains("made no tool calls"), "{}", r.text());

    // A reply of two calls at once (a forced call is one call, so a grammar of the array form
    // makes this one).
    let two = json!({"type": "array", "minItems": 2, "maxItems": 2, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "now"},
                        "parameters": {"type": "object", "properties": {}, "additionalProperties": false}},
         "required": ["name", "parameters"], "additionalProperties": false}]}});
    let r = post(
        s.addr(),
        &k,
        &path,
        &json!({"content": "Time twice?", "tools": weather_tools(), "stream": false,
                "max_tokens": 160, "grammar": {"type": "json_schema", "schema": two}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["finish_reason"], "tool_calls", "{v}");
    let ids: Vec<String> = v["tool_calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| c["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{v}");
    let before = history(s.addr(), &k, &sid).await;

    let both =
        json!([{"tool_call_id": ids[0], "content": "1"}, {"tool_call_id": ids[1], "content": "2"}]);
    let twice =
        json!([{"tool_call_id": ids[0], "content": "1"}, {"tool_call_id": ids[0], "content": "2"}]);
    for (body, status, says) in [
        (
            json!({"tool_results": result("call_nope")}),
            422,
            "names no call of the last reply",
        ),
        (
            json!({"tool_results": result(&ids[0])}),
            422,
            "no result for call",
        ),
        (json!({"tool_results": twice}), 422, "is answered twice"),
        (
            json!({"tool_results": []}),
            422,
            "tool_results: must not be empty",
        ),
        (
            json!({"tool_results": both.clone(), "content": "hi"}),
            422,
            "content: not accepted with",
        ),
        (
            json!({"tool_results": [{"tool_call_id": ids[0], "content": "a\u{0}"}, {"tool_call_id": ids[1], "content": ""}]}),
            422,
            "tool_results[0].content: must not contain NUL",
        ),
        (
            json!({"content": "hi", "tool_choice": "required"}),
            422,
            "tool_choice: needs `tools`",
        ),
        (
            json!({"content": "hi", "tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "objekt"}}}]}),
            400,
            "tools[0].function.parameters",
        ),
        (
            json!({"content": "hi", "tools": weather_tools(), "tool_choice": "required",
                "grammar": {"type": "regex", "pattern": "a"}}),
            422,
            "not compatible",
        ),
    ] {
        let r = post(s.addr(), &k, &path, &body).await;
        assert_eq!(r.status, status, "{body}: {}", r.text());
        assert!(r.text().contains(says), "{body}: {}", r.text());
    }
    let r = post(
        s.addr(),
        &k,
        &format!("/v1/sessions/{sid}/regenerate"),
        &json!({"tool_results": both}),
    )
    .await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(history(s.addr(), &k, &sid).await, before, "nothing stored");

    // Both answered, in either order: stored, and answered.
    let reversed =
        json!([{"tool_call_id": ids[1], "content": "2"}, {"tool_call_id": ids[0], "content": "1"}]);
    let r = post(
        s.addr(),
        &k,
        &path,
        &json!({"tool_results": reversed, "stream": false, "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let after = history(s.addr(), &k, &sid).await;
    assert_eq!(after.len(), before.len() + 3);
    assert_eq!(after[before.len()]["tool_call_id"], ids[1].as_str());
    s.finish().await;
}
