//! The mask threads' work, shared fairly between users.
//!
//! Every constrained sequence asks for its next mask after each token, and a step's sampling
//! waits for the masks of the sequences in it. With one queue for all, a user with many
//! constrained sequences (or heavy grammars) would put their masks in front of everyone
//! else's, and every other user's steps would wait behind them. Here each user has a queue of
//! their own and the threads take from the users in turn, so one user's many masks wait
//! behind each other, not in front of another user's one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};

/// A unit of work for a mask thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The jobs waiting for a mask thread, a queue per user.
#[derive(Default)]
pub(crate) struct FairQueue {
    state: Mutex<State>,
    more: Condvar,
}

#[derive(Default)]
struct State {
    queues: HashMap<String, VecDeque<Job>>,
    /// The users with jobs waiting, in the order they are served next.
    turns: VecDeque<String>,
    closed: bool,
}

impl std::fmt::Debug for FairQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("FairQueue")
            .field("users_waiting", &s.turns.len())
            .field("closed", &s.closed)
            .finish()
    }
}

impl FairQueue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job` for `user`. Once the queue is closed the job is dropped at once (and with
    /// it whatever it would have answered on, which tells its waiter).
    pub(crate) fn push(&self, user: &str, job: Job) {
        let mut s = self.lock();
        if s.closed {
            return;
        }
        let queue = s.queues.entry(user.to_string()).or_default();
        let first = queue.is_empty();
        queue.push_back(job);
        if first {
            s.turns.push_back(user.to_string());
        }
        drop(s);
        self.more.notify_one();
    }

    /// The next job, from the user whose turn it is, waiting for one; None once closed.
    pub(crate) fn pop(&self) -> Option<Job> {
        let mut s = self.lock();
        loop {
            if s.closed {
                return None;
            }
            if let Some(user) = s.turns.pop_front() {
                let Some(queue) = s.queues.get_mut(&user) else {
                    continue;
                };
                let job = queue.pop_front();
                if queue.is_empty() {
                    s.queues.remove(&user);
                } else {
                    s.turns.push_back(user);
                }
                if job.is_some() {
                    return job;
                }
                continue;
            }
            s = self.more.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stops the threads (each returns from [`Self::pop`]) and drops every job still waiting.
    pub(crate) fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.queues.clear();
        s.turns.clear();
        drop(s);
        self.more.notify_all();
    }
}

/// How many mask threads a model's grammar engine runs: half the cores, 2 to 8. A mask takes
/// one core for its computation; on a GPU worker the cores are otherwise idle, and on a CPU
/// worker the forward pass's own threads need the rest.
pub fn mask_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| (n.get() / 2).clamp(2, 8))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A job that records `tag` in `log`.
    fn job(log: &Arc<Mutex<Vec<String>>>, tag: &str) -> Job {
        let (log, tag) = (log.clone(), tag.to_string());
        Box::new(move || log.lock().expect("log").push(tag))
    }

    #[test]
    fn users_are_served_in_turn_not_in_the_order_their_jobs_came() {
        let q = FairQueue::default();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..4 {
            q.push("alice", job(&log, &format!("a{i}")));
        }
        q.push("bob", job(&log, "b0"));
        q.push("carol", job(&log, "c0"));
        q.push("bob", job(&log, "b1"));
        for _ in 0..7 {
            (q.pop().expect("a job"))();
        }
        let order = log.lock().expect("log").clone();
        assert_eq!(order, ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]);
    }

    #[test]
    fn closing_wakes_the_threads_and_drops_what_waits() {
        let q = Arc::new(FairQueue::default());
        let waiting = {
            let q = q.clone();
            std::thread::spawn(move || q.pop().is_none())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        q.close();
        assert!(waiting.join().expect("thread"), "a waiting thread returns");
        q.push(
            "alice",
            Box::new(move || {
                let _ = tx.send(());
            }),
        );
        assert!(rx.recv().is_err(), "a job pushed after close is dropped");
        assert!(q.pop().is_none());
    }
}
