//! Faults around a running stack that must neither lose nor hang a reply.
//!
//! Workers: [`failover`], a worker that stops answering, drains with a reply longer than its
//! deadline, or whose engine sticks; [`identical`], a reply that fails over or is preempted is
//! the one it would have been uncut; [`queue`], queued clients that go away, a user whose
//! requests fill the queue, a daily token budget under concurrent replies.
//!
//! Sessions and connections: [`sessions`], a stream resumed at or past its end, a session
//! deleted while it replies, the orphan sweep under skewed clocks, and the history and session
//! caps; [`connections`], idle and half-open connections, the connection cap, a body that does
//! not arrive, and requests that other sites make to a server running without keys.
//!
//! Databases and signals: PostgreSQL stopped in the middle of a streaming reply and brought back
//! ([`database_outage`]), a transaction's caller gone while PostgreSQL was slow to begin it
//! ([`cancelled_begin`]), Redis gone ([`redis_outage`]), and SIGTERM on the orchestrator while
//! 50 replies stream ([`sigterm`]). Each of these ends with every stored history whole
//! ([`check_history`]).
//!
//! Most workers here run in scripted mode (one token per tick of a timer, no model), so how long
//! a reply lasts is set by the test rather than by how busy the machine is. PostgreSQL for the
//! outage test is a private server on a free port (`hearth_e2e::pg::PgServer`); Redis is a
//! private `redis-server` on a free port.

mod cancelled_begin;
mod connections;
mod database_outage;
mod failover;
mod identical;
mod queue;
mod redis_outage;
mod sessions;
mod sigterm;

use hearth_orchestrator::storage::{Message, MessageStatus, Role};

/// Nothing half-written: `seq` is 1, 2, 3… without gaps or duplicates, messages alternate user
/// and assistant, every user message has its reply, and every reply is final with the
/// accounting its status implies.
fn check_history(sid: &str, msgs: &[Message]) {
    assert_eq!(
        msgs.len() % 2,
        0,
        "{sid}: a user message without a reply: {msgs:#?}"
    );
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, i as i64 + 1, "{sid}: seq out of order: {msgs:#?}");
        let role = if i % 2 == 0 {
            Role::User
        } else {
            Role::Assistant
        };
        assert_eq!(m.role, role, "{sid}: roles do not alternate: {msgs:#?}");
        match m.role {
            Role::User => {
                assert_eq!(m.status, MessageStatus::Complete, "{sid}: {m:?}");
                assert!(!m.content.is_empty(), "{sid}: empty user message {m:?}");
            }
            Role::Assistant => match m.status {
                MessageStatus::Complete | MessageStatus::Stopped => {
                    assert!(
                        m.finish_reason.is_some()
                            && m.prompt_tokens.is_some()
                            && m.completion_tokens.is_some()
                            && m.duration_ms.is_some()
                            && m.worker.is_some(),
                        "{sid}: a final reply without its accounting: {m:?}"
                    );
                }
                MessageStatus::Error => {
                    assert!(m.finish_reason.is_some(), "{sid}: {m:?}");
                }
                MessageStatus::Streaming => panic!("{sid}: a reply left streaming: {m:?}"),
            },
            Role::Tool => panic!("{sid}: a tool message where none was posted: {m:?}"),
        }
    }
}
