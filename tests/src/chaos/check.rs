//! The history checker: what every client received, against what the database stored. For
//! each turn: stored once, as `complete`; its text equal to what its client was shown (events
//! de-duplicated by id); the event ids without gaps or repeats; its client never left waiting.
//! And how long the clients mid-turn waited for their next token after each fault.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::client::{ClientLog, Ending, TurnLog};
use super::faults::Fault;

/// Counts of what went wrong, over every turn of the run. Every count but `turns`, `faults`,
/// `stream_lost` and `read_stored` must be 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    pub turns: usize,
    pub faults: usize,
    /// No reply stored for the turn.
    pub lost: usize,
    /// The user message stored more than once.
    pub duplicated: usize,
    /// Stored, but not `complete` (`error`, `stopped`, or still `streaming`).
    pub not_complete: usize,
    /// Stored as `error`.
    pub stored_error: usize,
    /// Stored text other than what the client was shown.
    pub differ: usize,
    /// A turn whose event ids skip one.
    pub gaps: usize,
    /// Events received twice (resumes must not send again what the client has).
    pub repeats: usize,
    /// The client's turn ended with an `error` event (other than `stream_lost`).
    pub client_errors: usize,
    /// The client gave up waiting.
    pub left_waiting: usize,
    /// Turns whose client was told its stream was lost (their reply went on and was stored).
    pub stream_lost: usize,
    /// Turns whose stream no replica had any more (Redis lost it after the reply ended), read
    /// by their client from the history.
    pub read_stored: usize,
    /// The longest any client waited for its next event, and the longest after the last fault
    /// was over.
    pub longest_wait: Duration,
    pub longest_wait_after_faults: Duration,
    /// Problems, one line each, for the report.
    pub notes: Vec<String>,
}

impl Verdict {
    /// Whether the run kept every promise.
    pub fn clean(&self, wait_limit: Duration) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.not_complete == 0
            && self.differ == 0
            && self.gaps == 0
            && self.repeats == 0
            && self.client_errors == 0
            && self.left_waiting == 0
            && self.longest_wait_after_faults <= wait_limit
    }

    pub fn to_json(&self) -> Value {
        json!({
            "turns": self.turns,
            "faults": self.faults,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "not_complete": self.not_complete,
            "stored_error": self.stored_error,
            "differ": self.differ,
            "gaps": self.gaps,
            "repeats": self.repeats,
            "client_errors": self.client_errors,
            "left_waiting": self.left_waiting,
            "stream_lost": self.stream_lost,
            "read_stored": self.read_stored,
            "longest_wait_s": self.longest_wait.as_secs_f64(),
            "longest_wait_after_faults_s": self.longest_wait_after_faults.as_secs_f64(),
        })
    }
}

/// A session's stored messages: (role, content, status) in order.
pub type Stored = Vec<(String, String, String)>;

/// Judges the run: `stored[i]` is client `i`'s session as the database holds it at the end.
pub fn check(clients: &[ClientLog], stored: &[Stored], faults: &[Fault]) -> Verdict {
    let mut v = Verdict {
        faults: faults.len(),
        ..Verdict::default()
    };
    let calm_from = faults.iter().map(|f| f.until).max().unwrap_or_default();
    for (c, (client, messages)) in clients.iter().zip(stored).enumerate() {
        for (t, turn) in client.turns.iter().enumerate() {
            v.turns += 1;
            let at = format!("client {c} turn {t}");
            check_stored(&mut v, &at, turn, messages);
            check_events(&mut v, &at, turn, calm_from);
        }
    }
    v
}

/// The turn's reply as stored, against what its client was shown.
fn check_stored(v: &mut Verdict, at: &str, turn: &TurnLog, messages: &Stored) {
    let asked: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, (role, content, _))| role == "user" && *content == turn.content)
        .map(|(i, _)| i)
        .collect();
    if asked.len() > 1 {
        v.duplicated += 1;
        v.notes
            .push(format!("{at}: its message is stored {} times", asked.len()));
    }
    let Some((_, text, status)) = asked
        .first()
        .and_then(|&i| messages.get(i + 1))
        .filter(|(role, _, _)| role == "assistant")
    else {
        v.lost += 1;
        v.notes.push(format!("{at}: no reply stored"));
        return;
    };
    if status == "error" {
        v.stored_error += 1;
    }
    if status != "complete" {
        v.not_complete += 1;
        v.notes.push(format!("{at}: stored as {status}"));
    }
    // A client told its stream was lost, or that read the reply from the history, was shown a
    // beginning only.
    let shown = shown_text(turn);
    let same = match &turn.ending {
        Some(Ending::Error(kind)) if kind == "stream_lost" => text.starts_with(&shown),
        Some(Ending::ReadStored) => text.starts_with(&shown),
        _ => *text == shown,
    };
    if !same {
        v.differ += 1;
        let at_char = text
            .chars()
            .zip(shown.chars())
            .take_while(|(a, b)| a == b)
            .count();
        // The 20 characters on each side of the first difference, in each.
        let around = |s: &str| -> String {
            s.chars()
                .skip(at_char.saturating_sub(20))
                .take(40)
                .collect()
        };
        v.notes.push(format!(
            "{at}: stored {} characters, client shown {} (first difference at {at_char}: stored {:?}, shown {:?})",
            text.chars().count(),
            shown.chars().count(),
            around(text),
            around(&shown),
        ));
    }
}

/// The text of the `token` events a client received, each id once.
fn shown_text(turn: &TurnLog) -> String {
    let mut by_id: BTreeMap<u64, &str> = BTreeMap::new();
    for e in &turn.events {
        if e.name == "token" {
            by_id.entry(e.n).or_insert(&e.data);
        }
    }
    by_id
        .values()
        .map(|d| {
            let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
            v["text"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

/// The turn's events: ids from 1 without a gap, none twice, its end, and the waits.
fn check_events(v: &mut Verdict, at: &str, turn: &TurnLog, calm_from: Duration) {
    match &turn.ending {
        Some(Ending::Complete) => {}
        Some(Ending::Error(kind)) if kind == "stream_lost" => v.stream_lost += 1,
        Some(Ending::ReadStored) => v.read_stored += 1,
        Some(Ending::Error(kind)) => {
            v.client_errors += 1;
            v.notes
                .push(format!("{at}: ended with an error event ({kind})"));
        }
        Some(Ending::GaveUp) | None => {
            v.left_waiting += 1;
            v.notes.push(format!(
                "{at}: its client gave up waiting on {} after {} resumes; the last: {}",
                turn.message_id
                    .as_deref()
                    .unwrap_or("a reply it never learnt"),
                turn.resumes,
                turn.resume_log.join("; ")
            ));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for e in &turn.events {
        // A stream_lost error repeats the client's last id on purpose.
        if !seen.insert(e.n) && e.name != "error" {
            v.repeats += 1;
            v.notes.push(format!("{at}: event {} received twice", e.n));
        }
    }
    let top = seen.iter().next_back().copied().unwrap_or(0);
    if seen.len() as u64 != top || seen.first().is_some_and(|&n| n != 1) {
        v.gaps += 1;
        v.notes.push(format!(
            "{at}: event ids skip ({} ids up to {top})",
            seen.len()
        ));
    }
    for pair in turn.events.windows(2) {
        let wait = pair[1].at.saturating_sub(pair[0].at);
        v.longest_wait = v.longest_wait.max(wait);
        if pair[1].at > calm_from {
            let since = pair[1].at - pair[0].at.max(calm_from);
            v.longest_wait_after_faults = v.longest_wait_after_faults.max(since);
        }
    }
}

/// For each fault, each turn under way when it began: how long until its client's next token.
pub fn next_token_delays(clients: &[ClientLog], faults: &[Fault]) -> Vec<f64> {
    let mut delays = Vec::new();
    for f in faults {
        for turn in clients.iter().flat_map(|c| &c.turns) {
            let tokens: Vec<_> = turn.events.iter().filter(|e| e.name == "token").collect();
            let under_way = tokens.first().is_some_and(|e| e.at < f.at)
                && tokens.last().is_some_and(|e| e.at > f.at);
            if let Some(next) = tokens.iter().find(|e| e.at > f.at).filter(|_| under_way) {
                delays.push((next.at - f.at).as_secs_f64());
            }
        }
    }
    delays
}

/// The `q` quantile (0..=1) of `xs`, or 0 when empty.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    s[((q * s.len() as f64) as usize).min(s.len() - 1)]
}
