//! A scripted engine for load tests of the layers above the worker: no model, every request gets
//! one token per tick of a timer, echoing its own prompt tokens (so any tokenizer can decode
//! them), until `max_new_tokens`. A continuation (a prompt that ends with tokens sampled
//! before, `sampled_before`) goes on where the reply left off, as a greedy model would. It speaks the same commands and events as the real engine, so
//! the gRPC service, the orchestrator and their clients are exercised exactly as in production
//! while the worker's cost per token is fixed and tiny.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_shared::{FinishReason, RequestId};

use super::{Cancel, Command, EngineEvent, EventSender, SharedStats, Timings, ValidRequest};

struct Active {
    id: RequestId,
    prompt: Vec<u32>,
    /// The prompt's tokens before the reply's own (what is echoed).
    echoed: usize,
    /// The reply's tokens before this request's (sampled by an earlier request).
    before: usize,
    max_new: usize,
    sent: usize,
    arrived: Instant,
    first: Option<Instant>,
    tx: EventSender,
}

impl Active {
    fn finish(&self, reason: FinishReason) {
        let now = Instant::now();
        let ms = |t: Instant| t.duration_since(self.arrived).as_secs_f64() * 1000.0;
        let _ = self.tx.send(EngineEvent::Finished {
            reason,
            prompt_tokens: self.prompt.len(),
            cached_tokens: 0,
            completion_tokens: self.sent,
            timings: Timings {
                queue_ms: 0.0,
                time_to_first_token_ms: self.first.map_or(0.0, ms),
                total_ms: ms(now),
            },
        });
    }
}

pub(super) fn scripted_task(
    interval: Duration,
    rx: Receiver<Command>,
    cancels: Receiver<Cancel>,
    stats: Arc<SharedStats>,
    freeze_after: Option<u64>,
) {
    let mut active: Vec<Active> = Vec::new();
    let mut tokens_sent = 0u64;
    let mut shutting_down = false;
    let mut next_tick = Instant::now() + interval;
    loop {
        let wait = next_tick.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Command::Submit(req, tx)) => admit(&mut active, *req, tx),
            Ok(Command::DropSession(_, reply)) => {
                let _ = reply.send(Ok(()));
            }
            Ok(Command::Wake) => {}
            Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => shutting_down = true,
            Err(RecvTimeoutError::Timeout) => {}
        }
        while let Ok(c) = cancels.try_recv() {
            active.retain(|a| match c {
                Cancel::One(id) if a.id == id => {
                    a.finish(FinishReason::Cancelled);
                    false
                }
                Cancel::One(_) => true,
                // A shutdown, not the client: the caller continues the reply elsewhere.
                Cancel::All => {
                    let _ =
                        a.tx.send(EngineEvent::Error(super::EngineError::ShuttingDown));
                    false
                }
            });
        }
        if Instant::now() >= next_tick {
            next_tick += interval;
            tokens_sent += tick(&mut active);
            stats.steps.fetch_add(1, Ordering::Relaxed);
            if freeze_after.is_some_and(|n| tokens_sent >= n) {
                tracing::warn!(
                    tokens_sent,
                    "scripted engine frozen on purpose (stall test)"
                );
                stats.running.store(active.len(), Ordering::Relaxed);
                loop {
                    std::thread::park();
                }
            }
        }
        stats.running.store(active.len(), Ordering::Relaxed);
        if shutting_down && active.is_empty() {
            break;
        }
    }
    tracing::info!("scripted engine stopped");
}

fn admit(active: &mut Vec<Active>, req: ValidRequest, tx: EventSender) {
    let _ = tx.send(EngineEvent::Started {
        cached_tokens: 0,
        queue_ms: 0.0,
    });
    let r = req.inner;
    let before = (r.sampled_before as usize).min(r.prompt.len().saturating_sub(1));
    active.push(Active {
        id: r.id,
        echoed: r.prompt.len() - before,
        before,
        prompt: r.prompt,
        max_new: r.max_new_tokens as usize,
        sent: 0,
        arrived: req.arrived,
        first: None,
        tx,
    });
}

/// One token for every request; finished ones leave. Returns the tokens sent.
fn tick(active: &mut Vec<Active>) -> u64 {
    let now = Instant::now();
    let mut sent = 0;
    active.retain_mut(|a| {
        if a.tx.is_closed() {
            return false;
        }
        let id = echo(&a.prompt[..a.echoed], a.before + a.sent);
        let _ = a.tx.send(EngineEvent::Token {
            id,
            logprob: 0.0,
            top: Vec::new(),
        });
        a.sent += 1;
        sent += 1;
        a.first.get_or_insert(now);
        if a.sent >= a.max_new {
            a.finish(FinishReason::Length);
            return false;
        }
        true
    });
    sent
}

/// The reply's `n`-th token (from 0): the prompt's tokens over and over.
fn echo(prompt: &[u32], n: usize) -> u32 {
    prompt[n % prompt.len()]
}

#[cfg(test)]
mod tests {
    use super::echo;

    #[test]
    fn a_continuation_goes_on_as_the_uncut_reply() {
        let prompt = [1, 2, 3];
        let uncut: Vec<u32> = (0..7).map(|n| echo(&prompt, n)).collect();
        assert_eq!(uncut, [1, 2, 3, 1, 2, 3, 1]);
        // Cut after 5 tokens: the echoed part of the prompt, then the 5 already sent.
        let rest: Vec<u32> = (5..7).map(|n| echo(&prompt, n)).collect();
        assert_eq!(rest, uncut[5..]);
    }
}
