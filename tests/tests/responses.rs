//! OpenAI's Responses API through the whole stack: raw HTTP (the `response` object, its usage,
//! a forced function call and its output sent back, the stream's events and their sequence
//! numbers, refusals by name) and unmodified clients (the `openai` client, kept responses
//! continued, listed, read again and deleted through it, the OpenAI Agents SDK with its default
//! model and a function tool, LangChain's `use_responses_api`).

use hearth_e2e::http::{Reply, Req};
use hearth_e2e::stack::{Db, Stack};
use serde_json::{json, Value};

async fn post(s: &Stack, key: &str, body: &Value) -> Reply {
    Req::new("POST", "/v1/responses")
        .key(Some(key))
        .json(body)
        .send(s.addr())
        .await
}

fn weather_tool() -> Value {
    json!([{"type": "function", "name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"], "additionalProperties": false}}])
}

#[tokio::test]
async fn a_response_a_function_call_and_the_stream_of_events() {
    let s = Stack::start("responses", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let body = json!({"model": "tiny", "input": "Name a colour.", "instructions": "Be brief.",
                      "max_output_tokens": 12, "temperature": 0.0, "metadata": {"run": "1"}});
    let r = post(&s, &k, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "response", "{v}");
    assert!(
        v["id"].as_str().is_some_and(|id| id.starts_with("resp_")),
        "{v}"
    );
    assert_eq!(v["store"], true, "{v}");
    assert_eq!(v["metadata"]["run"], "1", "{v}");
    assert_eq!(v["instructions"], "Be brief.", "{v}");
    let item = &v["output"][0];
    assert_eq!(item["type"], "message", "{v}");
    assert_eq!(item["content"][0]["type"], "output_text", "{v}");
    let text = item["content"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    let usage = &v["usage"];
    let output = usage["output_tokens"].as_u64().expect("output");
    assert!(usage["input_tokens"].as_u64() > Some(8), "{v}");
    assert!(
        usage["input_tokens_details"]["cached_tokens"].is_u64(),
        "{v}"
    );
    match v["status"].as_str() {
        Some("incomplete") => {
            assert_eq!(output, 12, "{v}");
            assert_eq!(
                v["incomplete_details"]["reason"], "max_output_tokens",
                "{v}"
            );
        }
        Some("completed") => assert!(v["incomplete_details"].is_null(), "{v}"),
        other => panic!("status {other:?}: {v}"),
    }

    // Streamed: numbered events in the documented order, the deltas adding up to the text.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let mut sse = Req::new("POST", "/v1/responses")
        .key(Some(&k))
        .json(&stream_body)
        .events(s.addr())
        .await;
    let (mut names, mut streamed, mut last) = (Vec::<String>::new(), String::new(), None);
    let (mut seq, mut done) = (0, false);
    while let Some(e) = sse.next().await {
        assert!(!done, "an event after [DONE]: {e:?}");
        if e.data == "[DONE]" {
            done = true;
            continue;
        }
        let data: Value = serde_json::from_str(&e.data).expect("JSON data");
        assert_eq!(data["type"].as_str(), Some(e.event.as_str()), "{data}");
        assert_eq!(data["sequence_number"], seq, "{data}");
        seq += 1;
        if e.event == "response.output_text.delta" {
            streamed.push_str(data["delta"].as_str().expect("delta"));
        }
        if names.last() != Some(&e.event) {
            names.push(e.event.clone());
        }
        last = Some(data);
    }
    assert!(done, "the stream ends with [DONE]");
    let end = if v["status"] == "completed" {
        "response.completed"
    } else {
        "response.incomplete"
    };
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            end,
        ]
    );
    assert_eq!(streamed, text);
    let last = last.expect("events");
    assert_eq!(
        last["response"]["output"][0]["content"][0]["text"],
        text.as_str()
    );
    assert_eq!(last["response"]["usage"]["output_tokens"], output);

    // A forced call: a function_call item whose arguments follow the schema; its output goes
    // back with the call in `input`, and the model answers in words.
    let ask =
        json!({"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]});
    let body = json!({"model": "tiny", "input": [ask], "tools": weather_tool(),
                      "tool_choice": {"type": "function", "name": "get_weather"},
                      "max_output_tokens": 100});
    let v = post(&s, &k, &body).await.json();
    let call = &v["output"][0];
    assert_eq!(call["type"], "function_call", "{v}");
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: Value =
        serde_json::from_str(call["arguments"].as_str().expect("args")).expect("JSON");
    assert!(args["city"].is_string(), "{v}");
    let output =
        json!({"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"});
    let body = json!({"model": "tiny", "input": [ask, call, output], "tools": weather_tool(),
                      "tool_choice": "none", "max_output_tokens": 4});
    let r = post(&s, &k, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["output"][0]["type"], "message", "{}", r.text());

    // Streamed, the call comes as its item, its arguments and their end.
    let mut body = body.clone();
    body["input"] = json!([ask]);
    body["tool_choice"] = json!("required");
    body["max_output_tokens"] = json!(100);
    body["stream"] = json!(true);
    let mut sse = Req::new("POST", "/v1/responses")
        .key(Some(&k))
        .json(&body)
        .events(s.addr())
        .await;
    let mut arguments = None;
    while let Some(e) = sse.next().await {
        if e.event == "response.function_call_arguments.done" {
            let d: Value = serde_json::from_str(&e.data).expect("JSON");
            arguments = d["arguments"].as_str().map(str::to_string);
        }
    }
    let arguments: Value = serde_json::from_str(&arguments.expect("a call")).expect("JSON");
    assert!(arguments["city"].is_string(), "{arguments}");
    s.finish().await;
}

#[tokio::test]
async fn what_cannot_be_honoured_is_refused_by_name() {
    let s = Stack::start(
        "responseserr",
        Db::Sqlite,
        1,
        &["--max-sessions-per-user", "1"],
    )
    .await;
    let k = s.key("alice").await;
    let cases = [
        (json!({"background": true, "store": false}), "background"),
        (
            json!({"previous_response_id": "resp_1", "store": false}),
            "previous_response_id",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}),
            "input[0].call_id",
        ),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (
            json!({"text": {"format": {"type": "xml"}}}),
            "text.format.type",
        ),
        (json!({"input": 7}), "input"),
        (json!({"max_output_tokens": 0}), "max_output_tokens"),
    ];
    for (extra, field) in cases {
        let mut body = json!({"model": "tiny", "input": "Hi"});
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        let r = post(&s, &k, &body).await;
        assert_eq!(r.status, 422, "{field}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], field, "{}", r.text());
    }
    // A kept response is a session, and counts against the key's cap on them; one not kept
    // does not.
    let kept = json!({"model": "tiny", "input": "Hi", "max_output_tokens": 2});
    assert_eq!(post(&s, &k, &kept).await.status, 200);
    let r = post(&s, &k, &kept).await;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "too_many_sessions",
        "{}",
        r.text()
    );
    let mut not_kept = kept.clone();
    not_kept["store"] = json!(false);
    assert_eq!(post(&s, &k, &not_kept).await.status, 200);
    s.finish().await;
}

const CLIENTS: &str = r#"
import json, os
from openai import OpenAI, AsyncOpenAI
base, key = os.environ["BASE_URL"], os.environ["API_KEY"]
client = OpenAI(base_url=base, api_key=key, max_retries=0)

# The openai client itself: a response cut by its length, its events, and (a reply that
# completes: JSON to a small schema) a stream through its accumulator.
r = client.responses.create(model="tiny", input="Hi", max_output_tokens=8, temperature=0)
assert r.output[0].type == "message" and r.status == "incomplete", r
assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8, r
events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=8,
                                      temperature=0, stream=True))
assert events[-1].type == "response.incomplete", events[-1]
assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
flag = {"type": "json_schema", "name": "flag", "schema": {"type": "object",
        "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}
with client.responses.stream(model="tiny", input="Hi", max_output_tokens=40,
                             text={"format": flag}) as s:
    deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    final = s.get_final_response()
assert final.status == "completed" and deltas == final.output_text, (deltas, final)
assert isinstance(json.loads(final.output_text)["ok"], bool), final

# Kept (the default): continued by id from the worker's cache, listed, its events read again
# whole after it ran in the background, deleted.
from openai import NotFoundError
more = client.responses.create(model="tiny", input="Go on.", previous_response_id=r.id,
                               max_output_tokens=8, temperature=0)
assert more.previous_response_id == r.id, more
assert more.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens, more
assert [i.content[0].text for i in client.responses.input_items.list(more.id).data] == ["Go on."]
bg = client.responses.create(model="tiny", input="Count.", background=True, max_output_tokens=8)
assert bg.status == "in_progress" and bg.background, bg
replay = list(client.responses.retrieve(bg.id, stream=True))
assert [e.sequence_number for e in replay] == list(range(len(replay))), replay
assert replay[-1].type == "response.incomplete", replay[-1]
said = "".join(e.delta for e in replay if e.type == "response.output_text.delta")
assert client.responses.retrieve(bg.id).output_text == said
for gone in (more.id, r.id):
    assert client.responses.delete(gone) is None
try:
    client.responses.retrieve(r.id)
    raise AssertionError("a deleted response was found")
except NotFoundError:
    pass

# The Agents SDK with its default model (the Responses API) and a function tool it must call.
from agents import (Agent, FunctionTool, ModelSettings, Runner, set_default_openai_client,
                    set_tracing_disabled)
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=base, api_key=key, max_retries=0),
                          use_for_tracing=False)
asked = []
async def weather(ctx, arguments):
    asked.append(json.loads(arguments)["city"])
    return "sunny"
tool = FunctionTool(name="get_weather", description="Weather now", on_invoke_tool=weather,
                    params_json_schema={"type": "object", "additionalProperties": False,
                                        "properties": {"city": {"type": "string", "maxLength": 12}},
                                        "required": ["city"]})
agent = Agent(name="weather", instructions="Be brief.", model="tiny", tools=[tool],
              tool_use_behavior="stop_on_first_tool",
              model_settings=ModelSettings(tool_choice="required", max_tokens=100))
result = Runner.run_sync(agent, "Weather in Oslo?")
assert result.final_output == "sunny" and len(asked) == 1, (result, asked)

# LangChain on the Responses API.
from langchain_openai import ChatOpenAI
llm = ChatOpenAI(model="tiny", base_url=base, api_key=key, use_responses_api=True,
                 max_tokens=8, temperature=0, max_retries=0)
m = llm.invoke("Hi")
assert m.usage_metadata["input_tokens"] > 0 and m.usage_metadata["output_tokens"] >= 1, m
print(json.dumps({"text": r.output_text, "city": asked[0], "langchain": m.text}))
"#;

#[tokio::test]
async fn the_openai_client_the_agents_sdk_and_langchain_speak_it_unmodified() {
    let s = Stack::start("responsespy", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let base = format!("http://{}/v1", s.addr());
    for package in ["agents", "langchain_openai"] {
        let probe = std::process::Command::new("python3")
            .args(["-c", &format!("import {package}")])
            .output();
        assert!(
            probe.is_ok_and(|o| o.status.success()),
            "this test needs openai-agents and langchain-openai: `python3 -m pip install \
             openai-agents langchain-openai`"
        );
    }
    let v = hearth_e2e::client::run_python("openai", CLIENTS, &base, &k).await;
    assert!(v["text"].is_string() && v["city"].is_string(), "{v}");
    s.finish().await;
}
