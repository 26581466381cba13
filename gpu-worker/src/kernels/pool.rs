//! A small fork-join pool for the forward pass's parallel loops.
//!
//! A decode step makes about a hundred parallel calls, each only tens of microseconds of work.
//! A general pool's workers fall asleep between such calls and take tens of microseconds to wake,
//! which at that granularity halves throughput. Here helper threads spin briefly between calls
//! (parking after a short idle period, so an idle worker costs nothing) and the caller works
//! alongside them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle helper spins before parking.
const SPIN: Duration = Duration::from_micros(300);

type Job<'a> = &'a (dyn Fn(usize) + Sync);

/// `state` packs the job generation (high 24 bits), the next task to claim (middle 20 bits) and
/// the number of tasks (low 20 bits), so a claim is one compare-and-swap that also checks the
/// generation.
fn pack(generation: u64, next: u64, tasks: u64) -> u64 {
    (generation << 40) | (next << 20) | tasks
}

fn unpack(s: u64) -> (u64, u64, u64) {
    (s >> 40, (s >> 20) & 0xF_FFFF, s & 0xF_FFFF)
}

/// Most tasks one call may have (20 bits of `state`).
const MAX_TASKS: usize = (1 << 20) - 1;

struct Shared {
    state: AtomicU64,
    /// The current job's `&dyn Fn` as its two machine words; read only after a successful claim.
    job: [AtomicUsize; 2],
    done: AtomicUsize,
    /// Set when a task of the current call panicked.
    panicked: AtomicBool,
}

#[derive(Debug)]
pub struct SpinPool {
    shared: Arc<SharedHandle>,
    /// Serializes calls from several threads: one job is published at a time.
    calls: Mutex<()>,
    helpers: Vec<Thread>,
    _threads: Vec<JoinHandle<()>>,
}

struct SharedHandle(Shared);

impl std::fmt::Debug for SharedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpinPool")
    }
}

impl SpinPool {
    /// A pool of `threads` workers: the caller plus `threads - 1` helpers.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(SharedHandle(Shared {
            state: AtomicU64::new(0),
            job: [AtomicUsize::new(0), AtomicUsize::new(0)],
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        }));
        let mut handles = Vec::new();
        for i in 1..threads.max(1) {
            let s = shared.clone();
            if let Ok(h) = std::thread::Builder::new()
                .name(format!("hearth-kernel-{i}"))
                .spawn(move || helper(&s.0))
            {
                handles.push(h);
            }
        }
        Self {
            helpers: handles.iter().map(|h| h.thread().clone()).collect(),
            shared,
            calls: Mutex::new(()),
            _threads: handles,
        }
    }

    /// The process-wide pool, one worker per CPU.
    pub fn global() -> &'static SpinPool {
        static POOL: OnceLock<SpinPool> = OnceLock::new();
        POOL.get_or_init(|| {
            SpinPool::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
        })
    }

    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(0) .. f(tasks - 1)` across the pool and returns when all are done.
    /// Calls from several threads at once are serialized.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks == 1 || self.helpers.is_empty() || tasks > MAX_TASKS {
            (0..tasks).for_each(f);
            return;
        }
        let _guard = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared.0;
        // SAFETY: a `&dyn Fn` is two machine words. Helpers turn them back into the reference only
        // after claiming a task of this generation, which is possible only while this call still
        // waits for its tasks; we return only after every task is done, so `f` outlives every use.
        let words: [usize; 2] = unsafe { std::mem::transmute::<Job<'_>, [usize; 2]>(f) };
        let (generation, _, _) = unpack(sh.state.load(Ordering::Acquire));
        let generation = (generation + 1) & 0xFF_FFFF;
        sh.done.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.job[0].store(words[0], Ordering::Relaxed);
        sh.job[1].store(words[1], Ordering::Relaxed);
        sh.state
            .store(pack(generation, 0, tasks as u64), Ordering::Release);
        for t in &self.helpers {
            t.unpark();
        }
        work(sh, generation);
        while sh.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        if sh.panicked.load(Ordering::Acquire) {
            panic!("a parallel kernel task panicked");
        }
    }
}

/// Claims and runs tasks of `generation` until none are left.
fn work(sh: &Shared, generation: u64) {
    loop {
        let s = sh.state.load(Ordering::Acquire);
        let (g, next, tasks) = unpack(s);
        if g != generation || next >= tasks {
            return;
        }
        if sh
            .state
            .compare_exchange_weak(
                s,
                pack(g, next + 1, tasks),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            let words = [
                sh.job[0].load(Ordering::Relaxed),
                sh.job[1].load(Ordering::Relaxed),
            ];
            // SAFETY: the claim succeeded, so the call that published `generation` (and these
            // words, before its Release store of `state`) is still waiting: the job is alive.
            let job: Job<'_> = unsafe { std::mem::transmute::<[usize; 2], Job<'_>>(words) };
            // A panicking task must still count as done, or the caller would wait forever; the
            // caller re-raises it (the engine then fails that step's sequences, not the thread).
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(next as usize)))
                .is_err()
            {
                sh.panicked.store(true, Ordering::Release);
            }
            sh.done.fetch_add(1, Ordering::Release);
        }
    }
}

fn helper(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let (g, next, tasks) = unpack(sh.state.load(Ordering::Acquire));
            if g != seen && next < tasks {
                break g;
            }
            if g != seen {
                seen = g;
            }
            spins = spins.wrapping_add(1);
            // Reading the clock costs more than a spin: check it now and then.
            if spins.is_multiple_of(1024) && idle_since.elapsed() > SPIN {
                std::thread::park_timeout(Duration::from_millis(100));
            } else {
                std::hint::spin_loop();
            }
        };
        seen = generation;
        work(sh, generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_task_is_reported_to_the_caller_and_the_pool_keeps_working() {
        let pool = SpinPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| assert_ne!(i, 5, "task 5 fails"))
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn every_task_runs_exactly_once_across_many_calls() {
        let pool = SpinPool::new(3);
        for tasks in [1usize, 2, 7, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
        }
    }
}
