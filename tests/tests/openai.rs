//! The OpenAI-compatible API through the whole stack: raw HTTP, the unmodified `openai` Python
//! client, and cancellation when the client goes away.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    assert_cancelled_before, chat_completion, history, slow_spec, wait_idle, worker_in_flight,
    worker_metric, Db, Stack,
};
use hearth_orchestrator::ids::SessionId;
use hearth_orchestrator::storage::{Accounts, SessionPatch, Sessions};

use serde_json::{json, Value};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": content}
        ],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test]
async fn completions_stream_and_not_with_usage() {
    let s = Stack::start("openai", Db::Postgres, 1, &[]).await;
    let k = s.key("alice").await;

    let r = Req::new("GET", "/v1/models")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let model = r.json()["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();

    let r = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&chat("Hi", json!({"max_tokens": 5, "ignore_eos": true})))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], json!(model));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let prompt = v["usage"]["prompt_tokens"].as_u64().expect("prompt");
    assert_eq!(v["usage"]["total_tokens"], prompt + 5);
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut sse = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&chat(
            "Hi",
            json!({"max_tokens": 6, "ignore_eos": true, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ))
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let events = sse.rest().await;
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| e.json())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].clone();
    assert!(chunks
        .iter()
        .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk"));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);

    // What Hearth cannot honour is refused by name, not ignored.
    for (extra, field) in [
        (json!({"n": 17}), "n"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools",
        ),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"logit_bias": {"7": 101}}), "logit_bias"),
        (json!({"dry_multiplier": -1}), "dry_multiplier"),
        (json!({"temperature": -2}), "temperature"),
        (json!({"max_tokens": 0}), "max_tokens"),
    ] {
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&k))
            .json(&chat("Hi", extra.clone()))
            .send(s.addr())
            .await;
        assert_eq!(r.status, 422, "{extra}: {}", r.text());
        let msg = r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains(field), "{extra}: {msg}");
    }
    for body in [
        json!({"model": "tiny", "messages": []}),
        json!({"model": "tiny"}),
        json!({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}),
        json!({"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}),
    ] {
        let r = Req::new("POST", "/v1/chat/completions")
            .key(Some(&k))
            .json(&body)
            .send(s.addr())
            .await;
        assert_eq!(r.status, 422, "{body}: {}", r.text());
    }
    let r = Req::new("POST", "/v1/chat/completions")
        .json(&chat("Hi", json!({})))
        .send(s.addr())
        .await;
    assert_eq!(r.status, 401);

    // A model no worker serves is OpenAI's 404 `model_not_found`, on every route that names
    // one, and a native session for it is not created; without `model`, the served one answers.
    let not_found = |r: &hearth_e2e::http::Reply, what: &str| {
        assert_eq!(r.status, 404, "{what}: {}", r.text());
        let e = r.json()["error"].clone();
        assert_eq!(e["code"], "model_not_found", "{what}: {e}");
        assert_eq!(e["type"], "invalid_request_error", "{what}: {e}");
        let m = e["message"].as_str().unwrap_or_default();
        assert!(
            m.contains("`gpt-4o`") && m.contains("`tiny`"),
            "{what}: {m}"
        );
    };
    let post = |path: &'static str, body: Value| {
        let k = k.clone();
        let addr = s.addr();
        async move {
            Req::new("POST", path)
                .key(Some(&k))
                .json(&body)
                .send(addr)
                .await
        }
    };
    let mut other = chat("Hi", json!({"max_tokens": 2}));
    other["model"] = json!("gpt-4o");
    not_found(&post("/v1/chat/completions", other).await, "chat");
    let legacy = json!({"model": "gpt-4o", "prompt": "Hi", "max_tokens": 2});
    not_found(&post("/v1/completions", legacy).await, "completions");
    let r = Req::new("GET", "/v1/models/gpt-4o")
        .key(Some(&k))
        .send(s.addr())
        .await;
    not_found(&r, "retrieve");
    let before = post("/v1/sessions", json!({})).await;
    assert_eq!(before.status, 201);
    not_found(
        &post("/v1/sessions", json!({"model": "gpt-4o", "title": "x"})).await,
        "session",
    );
    let listed = Req::new("GET", "/v1/sessions?q=x")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(listed.json()["data"], json!([]), "no session was created");
    let pinned = post("/v1/sessions", json!({"model": "tiny"})).await;
    assert_eq!(pinned.status, 201, "{}", pinned.text());
    assert_eq!(pinned.json()["model"], "tiny");
    // A session made for a model that is no longer served: its turns are refused, storing
    // nothing, until its model is cleared.
    let sid = pinned.json()["id"].as_str().expect("id").to_string();
    let user = s
        .store
        .user_by_name("alice")
        .await
        .expect("store")
        .expect("alice");
    let id = SessionId::parse(&sid).expect("id");
    let gone = SessionPatch {
        model: Some(Some("gemma-1".into())),
        ..Default::default()
    };
    s.store
        .update_session(&user.id, &id, gone)
        .await
        .expect("patch");
    let path = format!("/v1/sessions/{sid}/messages");
    let turn = Req::new("POST", &path)
        .key(Some(&k))
        .json(&json!({"content": "Hi", "stream": false, "max_tokens": 2}))
        .send(s.addr())
        .await;
    assert_eq!(turn.status, 404, "{}", turn.text());
    assert_eq!(turn.json()["error"]["code"], "model_not_found");
    assert!(history(s.addr(), &k, &sid).await.is_empty());
    let patch = Req::new("PATCH", &format!("/v1/sessions/{sid}"))
        .key(Some(&k))
        .json(&json!({"model": null}))
        .send(s.addr())
        .await;
    assert_eq!(patch.status, 200, "{}", patch.text());
    let turn = Req::new("POST", &path)
        .key(Some(&k))
        .json(&json!({"content": "Hi", "stream": false, "max_tokens": 2}))
        .send(s.addr())
        .await;
    assert_eq!(turn.status, 200, "{}", turn.text());
    let mut served = chat("Hi", json!({"max_tokens": 2}));
    served.as_object_mut().expect("object").remove("model");
    assert_eq!(post("/v1/chat/completions", served).await.status, 200);
    s.finish().await;
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_its_generation() {
    let s = Stack::start_with("oaicancel", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let mut sse = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&chat(
            "Talk",
            json!({"max_tokens": 900, "ignore_eos": true, "stream": true}),
        ))
        .events(s.addr())
        .await;
    for _ in 0..3 {
        sse.next().await.expect("chunk");
    }
    assert_eq!(worker_in_flight(&s.workers[0]).await, 1.0);
    drop(sse);
    // 900 tokens take seconds on this model; the cancel reaches the worker long before. A reply
    // that ran to its end would also leave the worker idle, so the decoded-token counter is what
    // proves the cancel: it stops, far short of 900.
    assert_eq!(
        wait_idle(&s.workers[0]).await,
        0.0,
        "the generation kept running"
    );
    assert_cancelled_before(&s.workers[0], 900).await;
    s.finish().await;
}

const CLIENT: &str = r#"
import json, os, sys
from openai import OpenAI

client = OpenAI(base_url=os.environ["BASE_URL"], api_key=os.environ["API_KEY"])
model = client.models.list().data[0].id
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Hello"}],
    max_tokens=7,
    extra_body={"ignore_eos": True},
)
assert r.choices[0].message.role == "assistant", r
assert r.usage.completion_tokens == 7, r.usage
text = ""
usage = None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Hello"}],
    max_completion_tokens=9,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
assert usage is not None and usage.completion_tokens == 9, usage

# Log-probabilities: each a probability of at most 1, the greedy pick the likeliest of its
# alternatives, the same streamed and not, and the text the tokens' own.
ask = dict(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
           temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
g = client.chat.completions.create(**ask)
content = g.choices[0].logprobs.content
assert len(content) == 8, content
for t in content:
    assert t.logprob <= 0 and len(t.top_logprobs) == 5, t
    assert all(a.logprob <= 0 for a in t.top_logprobs), t
    assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6, t
    assert t.bytes == list(t.token.encode()), t
    ranked = [a.logprob for a in t.top_logprobs]
    assert ranked == sorted(ranked, reverse=True), ranked
assert "".join(t.token for t in content) == g.choices[0].message.content
streamed_lp = []
for chunk in client.chat.completions.create(stream=True, **ask):
    for c in chunk.choices:
        if c.logprobs is not None and c.logprobs.content:
            streamed_lp += c.logprobs.content
assert [(t.token, t.logprob) for t in streamed_lp] == [(t.token, t.logprob) for t in content]

# Several choices: each its own, the prompt counted once.
m = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                   max_tokens=6, n=3, temperature=1.5, seed=7,
                                   extra_body={"ignore_eos": True})
assert [c.index for c in m.choices] == [0, 1, 2], m.choices
assert m.usage.completion_tokens == 18 and m.usage.prompt_tokens == r.usage.prompt_tokens, m.usage
assert len({c.message.content for c in m.choices}) > 1, m.choices

# The legacy completions API.
c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0,
                              logprobs=2, extra_body={"ignore_eos": True})
assert c.object == "text_completion" and c.usage.completion_tokens == 4, c
assert len(c.choices[0].logprobs.tokens) == 4, c.choices[0].logprobs
assert client.models.retrieve(model).id == model

# Structured outputs: a pydantic model as the response format, parsed by the client.
from pydantic import BaseModel, Field
class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=1000000)
parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
p = parse(model=model, messages=[{"role": "user", "content": "A city?"}], response_format=City,
          max_tokens=200, temperature=1.0, seed=5)
assert p.choices[0].finish_reason == "stop" and isinstance(p.choices[0].message.parsed, City), p

# Tools: a required call parses and validates; its result goes back and the model answers.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}}]
ask = [{"role": "user", "content": "Weather in Oslo?"}]
t = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                   max_tokens=100, temperature=1.0, seed=2)
call = t.choices[0].message.tool_calls[0]
assert t.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", t
assert isinstance(json.loads(call.function.arguments)["city"], str), call
follow = client.chat.completions.create(
    model=model, messages=ask + [t.choices[0].message,
                                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
    tools=tools, tool_choice="none", max_tokens=5, extra_body={"ignore_eos": True})
assert follow.choices[0].message.tool_calls is None and follow.choices[0].message.content, follow
calls, finish = [], None
for chunk in client.chat.completions.create(
        stream=True, model=model, messages=ask, tools=tools, max_tokens=100, temperature=1.0,
        seed=4, tool_choice={"type": "function", "function": {"name": "get_weather"}}):
    for c in chunk.choices:
        calls += c.delta.tool_calls or []
        finish = c.finish_reason or finish
assert finish == "tool_calls" and calls[0].function.name == "get_weather", calls
assert "city" in json.loads("".join(c.function.arguments or "" for c in calls)), calls
print(json.dumps({"model": model, "text": r.choices[0].message.content, "streamed": text}))
"#;

#[tokio::test]
async fn the_unmodified_openai_python_client_works() {
    let s = Stack::start("oaipy", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let base = format!("http://{}/v1", s.addr());
    let v = hearth_e2e::client::run_python("openai", CLIENT, &base, &k).await;
    assert!(v["text"].is_string() && v["streamed"].is_string(), "{v}");
    s.finish().await;
}

#[tokio::test]
async fn several_choices_share_one_prefill_and_stream_by_index() {
    let s = Stack::start("choices", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let long = "tell me a long story about a small town by the sea where every evening the \
                lights of the harbour come on one by one and the boats return home";
    let body = chat(
        long,
        json!({"n": 3, "max_tokens": 4, "ignore_eos": true, "temperature": 1.0, "seed": 3}),
    );
    let before = worker_metric(
        &s.workers[0],
        "hearth_worker_prefix_cache_hits_tokens_total",
    )
    .await;
    let r = chat_completion(s.addr(), &k, &body).await;
    let choices = r["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{r}");
    let prompt = r["usage"]["prompt_tokens"].as_u64().expect("prompt");
    assert!(prompt > 32, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 12, "{r}");
    // The second and third choices found the first's prompt blocks in the prefix cache.
    let hits = worker_metric(
        &s.workers[0],
        "hearth_worker_prefix_cache_hits_tokens_total",
    )
    .await;
    assert!(
        hits - before >= 64.0,
        "prefix cache hits went from {before} to {hits}"
    );

    // Streamed: every choice's chunks, each tagged with its index, one finish each.
    let mut body = body;
    body["stream"] = json!(true);
    let mut sse = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(&body)
        .events(s.addr())
        .await;
    assert_eq!(sse.status, 200);
    let mut finished = [0; 3];
    for e in sse.rest().await {
        let v = e.json();
        for c in v["choices"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().expect("index") as usize;
            if !c["finish_reason"].is_null() {
                finished[i] += 1;
            }
        }
    }
    assert_eq!(finished, [1, 1, 1]);
    s.finish().await;
}

#[tokio::test]
async fn legacy_completions_take_text_or_token_ids_and_models_are_found_by_id() {
    let s = Stack::start("legacy", Db::Sqlite, 1, &[]).await;
    let k = s.key("alice").await;
    let post = |body: Value| {
        let (addr, key) = (s.addr(), k.clone());
        async move {
            Req::new("POST", "/v1/completions")
                .key(Some(&key))
                .json(&body)
                .send(addr)
                .await
        }
    };
    let greedy = json!({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5,
                        "temperature": 0, "ignore_eos": true});
    let r = post(greedy.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    let text = v["choices"][0]["text"].as_str().expect("text").to_string();
    assert!(!text.is_empty(), "{v}");

    // Echo puts the prompt first; logprobs come in the legacy shape, one per token.
    let mut echo = greedy.clone();
    echo["echo"] = json!(true);
    let e = post(echo).await.json();
    assert_eq!(
        e["choices"][0]["text"],
        format!("Once upon a time{text}"),
        "{e}"
    );
    let mut lp = greedy.clone();
    lp["logprobs"] = json!(2);
    let l = post(lp).await.json();
    let logprobs = &l["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"].as_array().map(Vec::len), Some(5), "{l}");
    assert_eq!(logprobs["token_logprobs"].as_array().map(Vec::len), Some(5));
    let offsets: Vec<u64> = logprobs["text_offset"]
        .as_array()
        .expect("offsets")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0,
        "{offsets:?}"
    );
    let tokens: String = logprobs["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(tokens, text, "the tokens spell the text");

    // Token ids work as the prompt; streamed text is the same as the finished one.
    let mut ids = greedy.clone();
    ids["prompt"] = json!([2, 300, 301, 302]);
    assert_eq!(post(ids).await.status, 200);
    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    let mut sse = Req::new("POST", "/v1/completions")
        .key(Some(&k))
        .json(&streamed)
        .events(s.addr())
        .await;
    let mut joined = String::new();
    for ev in sse.rest().await {
        let c = ev.json();
        if c["object"] == "text_completion" {
            joined.push_str(c["choices"][0]["text"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(joined, text);

    // What cannot be honoured is refused by name.
    for (extra, field) in [
        (json!({"suffix": "end"}), "suffix"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [2, 600]}), "prompt"),
        (json!({"echo": true, "logprobs": 1}), "echo"),
        (json!({"logprobs": 6}), "logprobs"),
        (json!({"best_of": 3}), "best_of"),
    ] {
        let mut body = greedy.clone();
        for (key, v) in extra.as_object().expect("object") {
            body[key] = v.clone();
        }
        let r = post(body).await;
        assert_eq!(r.status, 422, "{extra}: {}", r.text());
        assert!(r.text().contains(field), "{extra}: {}", r.text());
    }

    // /v1/models/{id}: the listed model, and 404 for any other.
    let list = Req::new("GET", "/v1/models")
        .key(Some(&k))
        .send(s.addr())
        .await
        .json();
    let id = list["data"][0]["id"]
        .as_str()
        .expect("model id")
        .to_string();
    assert_eq!(list["data"][0]["state"], "ready", "{list}");
    assert_eq!(list["data"][0]["workers"], 1, "{list}");
    let one = Req::new("GET", &format!("/v1/models/{id}"))
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!((one.status, one.json()["id"].clone()), (200, json!(id)));
    let other = Req::new("GET", "/v1/models/not-a-model")
        .key(Some(&k))
        .send(s.addr())
        .await;
    assert_eq!(other.status, 404, "{}", other.text());
    s.finish().await;
}
