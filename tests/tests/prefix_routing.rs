//! Stateless (OpenAI API) conversations go back to the worker that holds their prefix, and get
//! it from that worker's prefix cache.

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    chat_completion, serving_worker, slow_spec, worker_in_flight, worker_metric, Db, Stack,
};
use serde_json::{json, Value};

#[tokio::test]
async fn a_resent_conversation_returns_to_the_worker_holding_its_prefix() {
    let s = Stack::start_with("prefix", &slow_spec(), Db::Sqlite, 2, &[]).await;
    let k = s.key("alice").await;
    let question = "tell me a long story about a small town by the sea where every evening the \
                    lights of the harbour come on one by one and the boats return home";
    let mut messages = vec![json!({"role": "user", "content": question})];
    let (key, addr) = (k.as_str(), s.addr());
    let turn = |messages: Vec<Value>| async move {
        let body =
            json!({"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": true});
        chat_completion(addr, key, &body).await
    };
    // Turn one: both workers idle, the first takes it.
    let one = turn(messages.clone()).await;
    assert!(one["usage"]["prompt_tokens"].as_u64() > Some(32), "{one}");
    messages.push(json!({"role": "assistant",
                         "content": one["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "and then?"}));

    // An unrelated long reply keeps that worker busy: least-loaded routing alone would now pick
    // the other, idle one.
    let mut busy = Req::new("POST", "/v1/chat/completions")
        .key(Some(&k))
        .json(
            &json!({"model": "tiny", "stream": true, "max_tokens": 400, "ignore_eos": true,
                      "messages": [{"role": "user", "content": "something else entirely"}]}),
        )
        .events(s.addr())
        .await;
    assert_eq!(busy.status, 200);
    assert!(busy.next().await.is_some());
    let home = serving_worker(&s).await;
    let loads = [
        worker_in_flight(&s.workers[0]).await,
        worker_in_flight(&s.workers[1]).await,
    ];
    assert_eq!((loads[home], loads[1 - home]), (1.0, 0.0), "{loads:?}");

    // Turn two resends turn one: it goes to the busy worker that holds the prefix.
    let two = turn(messages).await;
    let cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 32, "{two}");
    let hits = worker_metric(
        &s.workers[home],
        "hearth_worker_prefix_cache_hits_tokens_total",
    )
    .await;
    assert_eq!(hits, cached as f64);
    drop(busy);
}

#[tokio::test]
async fn another_users_prompt_is_never_served_from_the_prefix_cache() {
    let s = Stack::start_with("prefix_users", &slow_spec(), Db::Sqlite, 1, &[]).await;
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    let secret = "the launch code for the harbour lights is seven four one, and the spare key to \
                  the lighthouse is under the third stone from the gate";
    let ask = |key: String| {
        let addr = s.addr();
        async move {
            let body = json!({"model": "tiny", "max_tokens": 2, "ignore_eos": true,
                              "messages": [{"role": "user", "content": secret}]});
            let r = chat_completion(addr, &key, &body).await;
            let prompt = r["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");
            let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached tokens");
            (prompt, cached)
        }
    };
    let (prompt, cached) = ask(alice.clone()).await;
    assert!(prompt > 32, "long enough for whole cache blocks: {prompt}");
    assert_eq!(cached, 0);
    // Bob sends Alice's exact prompt: the cache must not tell him she sent it.
    assert_eq!(
        ask(bob.clone()).await,
        (prompt, 0),
        "bob saw alice's prefix"
    );
    // Alice's own prefix is still cached for her, so the cache itself works.
    let (_, again) = ask(alice).await;
    assert!(again >= 32, "alice's resend was not cached: {again}");
    // And bob's second send finds his own.
    let (_, bobs) = ask(bob).await;
    assert!(bobs >= 32, "bob's resend was not cached: {bobs}");
}

#[tokio::test]
async fn an_operators_shared_prompt_is_cached_for_everyone_and_nothing_after_it() {
    let file = std::env::temp_dir().join(format!("hearth-desk-{}.txt", std::process::id()));
    let system = "You are the harbour office's assistant. Answer questions about moorings, tides, \
                  the ferry timetable and the fish market politely, briefly and in plain words, \
                  and never invent a timetable that you were not given.";
    std::fs::write(&file, system).expect("write the shared prompt");
    let flag = format!("desk={}", file.display());
    let s = Stack::start_with(
        "prefix_shared",
        &slow_spec(),
        Db::Sqlite,
        1,
        &["--shared-prompt", &flag],
    )
    .await;
    let (alice, bob) = (s.key("alice").await, s.key("bob").await);
    let secret = "my boat is the blue one on mooring forty two and the padlock code is nine \
                  nine three one, please tell me when the tide is high enough to leave";
    let ask = |key: String, text: &'static str| {
        let addr = s.addr();
        async move {
            let body = json!({"model": "tiny", "max_tokens": 2, "ignore_eos": true,
                              "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": text}]});
            let r = chat_completion(addr, &key, &body).await;
            let usage = &r["usage"];
            let prompt = usage["prompt_tokens"].as_u64().expect("prompt tokens");
            let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            (prompt, cached.expect("cached tokens"))
        }
    };
    let (prompt, first) = ask(alice.clone(), secret).await;
    assert_eq!(first, 0, "nothing was cached yet");
    // Alice's resend finds her whole prompt but its last partial block.
    let (_, alices) = ask(alice, secret).await;
    assert!(
        alices + 16 > prompt - 1,
        "alice's resend: {alices} of {prompt}"
    );
    // Bob sends her exact conversation: he finds the operator's prompt, and nothing of hers.
    let (bob_prompt, bobs) = ask(bob.clone(), secret).await;
    assert_eq!(bob_prompt, prompt);
    assert!(bobs >= 32, "the shared prompt was not shared: {bobs}");
    let (system_only, _) = ask(bob, "hi").await;
    assert!(
        bobs <= system_only && bobs < alices,
        "bob saw alice's text: {bobs} cached, the system prompt renders to {system_only}"
    );
    let _ = std::fs::remove_file(&file);
}
