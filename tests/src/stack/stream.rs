//! Streamed replies read the way the tests read them: a reply's first tokens, the text of its
//! token events, and what a whole stream showed.

use crate::http::{Event, Sse};

/// Reads until `n` token events have arrived; every event read (`message_start` included).
/// Fails if the reply ends, or anything but a token arrives, first.
pub async fn read_tokens(sse: &mut Sse, n: usize) -> Vec<Event> {
    let mut seen = Vec::new();
    let mut tokens = 0;
    while tokens < n {
        let e = sse.next().await.expect("the stream ended early");
        assert!(
            e.event == "token" || e.event == "message_start",
            "the reply ended before {n} tokens: {e:?}"
        );
        tokens += usize::from(e.event == "token");
        seen.push(e);
    }
    seen
}

/// The text of the token events among `events`.
pub fn token_text(events: &[Event]) -> String {
    events
        .iter()
        .filter(|e| e.event == "token")
        .map(|e| e.json()["text"].as_str().expect("text").to_string())
        .collect()
}

/// What one streamed reply showed.
#[derive(Debug)]
pub struct Streamed {
    pub message_id: String,
    pub text: String,
    pub last: Event,
    /// Every event's id, in order.
    pub ids: Vec<String>,
}

/// A whole reply's events, from its `message_start`, folded.
pub fn fold(events: &[Event]) -> Streamed {
    let start = events.first().expect("events");
    assert_eq!(start.event, "message_start", "{events:?}");
    let message_id = start.json()["message_id"]
        .as_str()
        .expect("message id")
        .to_string();
    Streamed {
        message_id,
        text: token_text(events),
        last: events.last().expect("last").clone(),
        ids: events.iter().filter_map(|e| e.id.clone()).collect(),
    }
}

/// The rest of a stream: the text of its tokens and its last event.
pub async fn finish(sse: &mut Sse) -> (String, Event) {
    let events = sse.rest().await;
    let last = events.last().cloned().expect("the stream had no end");
    (token_text(&events), last)
}

/// The `<n>` of an event's id `<message id>:<n>`.
pub fn event_seq(e: &Event) -> u64 {
    let id = e.id.as_deref().expect("an event id");
    id.rsplit_once(':')
        .expect("<message>:<n>")
        .1
        .parse()
        .expect("n")
}
