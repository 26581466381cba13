//! Rate limits per API key: requests per minute and generated tokens per day, in fixed windows
//! (the current UTC minute and the current UTC day).
//!
//! With Redis the counters are shared by every orchestrator replica; without it they live in
//! this process. When Redis cannot be reached the limits are not enforced (requests pass and a
//! warning is logged, and Redis is left alone for a moment between tries): an outage of the
//! limiter must not take the chat service down with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use crate::redis_conn::Redis;

use crate::storage::now_ms;

/// The limits that apply to one caller, and the counter bucket they are kept in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// The API key's id (or the local user's id when auth is off).
    pub bucket: String,
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
}

/// A limit was reached; retry after this many seconds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}; retry in {retry_after_secs} s")]
pub struct Limited {
    pub what: String,
    pub retry_after_secs: u64,
}

/// The counters and the clock whose minutes and days are the windows.
#[derive(Debug)]
pub struct Limiter {
    counters: Counters,
    clock: Clock,
}

#[derive(Debug)]
enum Counters {
    Local(Mutex<HashMap<String, (i64, i64)>>),
    Redis(Redis),
}

/// Milliseconds since the Unix epoch: the system clock, or a test's.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    pub fn system() -> Self {
        Self(Arc::new(now_ms))
    }

    /// A clock that reads `f` (tests: a fixed or stepped time).
    pub fn from_fn(f: impl Fn() -> i64 + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    fn now(&self) -> i64 {
        (self.0)()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({})", self.now())
    }
}

const MINUTE_MS: i64 = 60_000;
const HOUR_MS: i64 = 3_600_000;
const UNENFORCED: &str = "rate limits are not enforced";
const DAY_MS: i64 = 86_400_000;

fn retry_after(window_ms: i64, now: i64) -> u64 {
    let left = window_ms - now.rem_euclid(window_ms);
    (left as u64).div_ceil(1000).max(1)
}

/// Stops one key may send a minute (a stop costs a database read and, across replicas, a Redis
/// message; a client has no reason to send more than a few).
pub const STOPS_PER_MINUTE: i64 = 120;

/// How long a day's token counter is kept.
const DAY_TTL_SECS: i64 = 2 * 86_400;

/// Tokens set aside from a key's daily budget for one reply, from admission until the reply
/// ends; [`Budget::settle`] then charges what it really generated. Replies running at once
/// each hold their share, so together they cannot spend more than the budget allows (the one
/// admitted while some budget was left may take its whole `max_tokens`). Dropped unsettled (the
/// turn failed before it started), it gives its tokens back.
#[derive(Debug)]
pub struct Budget {
    limiter: Arc<Limiter>,
    key: String,
    reserved: i64,
    settled: bool,
}

impl Budget {
    /// The reservation as `parts` budgets (the first takes the remainder), one per choice of a
    /// request with several: each settles what its own choice used.
    pub fn split(mut self, parts: usize) -> Vec<Budget> {
        let n = parts.max(1) as i64;
        let each = self.reserved / n;
        let first = self.reserved - each * (n - 1);
        // The parts carry the reservation now.
        self.settled = true;
        (0..n)
            .map(|i| Budget {
                limiter: self.limiter.clone(),
                key: self.key.clone(),
                reserved: if i == 0 { first } else { each },
                settled: false,
            })
            .collect()
    }

    /// Charges `used` tokens in place of the reservation.
    pub async fn settle(mut self, used: u64) {
        self.settled = true;
        let delta = used as i64 - self.reserved;
        if delta != 0 {
            self.limiter.add(&self.key, delta, DAY_TTL_SECS).await;
        }
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        if self.settled || self.reserved == 0 {
            return;
        }
        let (limiter, key, n) = (self.limiter.clone(), self.key.clone(), self.reserved);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                limiter.add(&key, -n, DAY_TTL_SECS).await;
            });
        }
    }
}

impl Limiter {
    /// Counters in this process, on the system clock.
    pub fn local() -> Self {
        Self::local_with(Clock::system())
    }

    pub fn local_with(clock: Clock) -> Self {
        Self {
            counters: Counters::Local(Mutex::new(HashMap::new())),
            clock,
        }
    }

    /// Counters in Redis, shared by every replica, on the system clock.
    pub fn redis(conn: Redis) -> Self {
        Self {
            counters: Counters::Redis(conn),
            clock: Clock::system(),
        }
    }

    /// Counts a stop against [`STOPS_PER_MINUTE`].
    pub async fn admit_stop(&self, q: &Quota) -> Result<(), Limited> {
        let now = self.clock.now();
        let key = format!("hearth:rl:stop:{}:{}", q.bucket, now / MINUTE_MS);
        if self.add(&key, 1, 120).await > STOPS_PER_MINUTE {
            crate::telemetry::count_rate_limited("stops_per_minute");
            return Err(Limited {
                what: format!("more than {STOPS_PER_MINUTE} stops in this minute"),
                retry_after_secs: retry_after(MINUTE_MS, now),
            });
        }
        Ok(())
    }

    /// Counts a load on demand: one request against the per-minute limit, and one load against
    /// `per_hour` (`--max-loads-per-hour`) in the current UTC hour.
    pub async fn admit_load(&self, q: &Quota, per_hour: i64) -> Result<(), Limited> {
        let now = self.clock.now();
        let key = format!("hearth:rl:load:{}:{}", q.bucket, now / HOUR_MS);
        if self.add(&key, 1, 7200).await > per_hour {
            self.add(&key, -1, 7200).await;
            crate::telemetry::count_rate_limited("loads_per_hour");
            return Err(Limited {
                what: format!(
                    "this key started {per_hour} model loads in this hour, the most it may \
                     (--max-loads-per-hour); ask for a model that is loaded"
                ),
                retry_after_secs: retry_after(HOUR_MS, now),
            });
        }
        if let Err(e) = self.count_request(q, now).await {
            self.add(&key, -1, 7200).await;
            return Err(e);
        }
        Ok(())
    }

    /// Counts a request that generates nothing (tokenizing) against the per-minute limit.
    pub async fn admit_request(&self, q: &Quota) -> Result<(), Limited> {
        self.count_request(q, self.clock.now()).await
    }

    /// Counts one request in the key's current minute; refused once past its limit.
    async fn count_request(&self, q: &Quota, now: i64) -> Result<(), Limited> {
        let Some(limit) = q.requests_per_minute else {
            return Ok(());
        };
        if self.add(&minute_key(&q.bucket, now), 1, 120).await > limit {
            crate::telemetry::count_rate_limited("requests_per_minute");
            return Err(Limited {
                what: format!("more than {limit} requests in this minute"),
                retry_after_secs: retry_after(MINUTE_MS, now),
            });
        }
        Ok(())
    }

    /// Counts one request against the per-minute limit and, when the key has a daily token
    /// budget, sets `max_tokens` aside from it (refused once nothing is left).
    pub async fn admit(
        self: &Arc<Self>,
        q: &Quota,
        max_tokens: u64,
    ) -> Result<Option<Budget>, Limited> {
        let now = self.clock.now();
        let mut budget = None;
        if let Some(limit) = q.tokens_per_day {
            let key = day_key(&q.bucket, now);
            let reserve = max_tokens.max(1) as i64;
            let after = self.add(&key, reserve, DAY_TTL_SECS).await;
            // 0: Redis is unreachable, and limits lapse rather than take chat down.
            if after != 0 && after - reserve >= limit {
                self.add(&key, -reserve, DAY_TTL_SECS).await;
                crate::telemetry::count_rate_limited("tokens_per_day");
                return Err(Limited {
                    what: format!("the daily limit of {limit} generated tokens is used up"),
                    retry_after_secs: retry_after(DAY_MS, now),
                });
            }
            budget = Some(Budget {
                limiter: self.clone(),
                key,
                reserved: if after == 0 { 0 } else { reserve },
                settled: false,
            });
        }
        if let Err(e) = self.count_request(q, now).await {
            if let Some(b) = budget {
                b.settle(0).await;
            }
            return Err(e);
        }
        Ok(budget)
    }

    /// Adds `n` and returns the new count (0 when Redis is unavailable).
    async fn add(&self, key: &str, n: i64, ttl_secs: i64) -> i64 {
        match &self.counters {
            Counters::Local(m) => {
                let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                let now = self.clock.now();
                // Windows are in the key; forget the ones that have closed.
                if m.len() > 10_000 {
                    m.retain(|_, (expires, _)| *expires > now);
                }
                let e = m
                    .entry(key.to_string())
                    .or_insert((now + ttl_secs * 1000, 0));
                e.1 += n;
                e.1
            }
            Counters::Redis(c) => {
                let mut pipe = redis::pipe();
                pipe.atomic()
                    .cmd("INCRBY")
                    .arg(key)
                    .arg(n)
                    .cmd("EXPIRE")
                    .arg(key)
                    .arg(ttl_secs);
                c.pipe::<(i64, i64)>(&pipe, UNENFORCED)
                    .await
                    .map_or(0, |(v, _)| v)
            }
        }
    }
}

fn minute_key(bucket: &str, now: i64) -> String {
    format!("hearth:rl:req:{bucket}:{}", now / MINUTE_MS)
}

fn day_key(bucket: &str, now: i64) -> String {
    format!("hearth:rl:tok:{bucket}:{}", now / DAY_MS)
}

/// Connects to Redis with short timeouts, so an outage costs a request milliseconds, not a hang.
pub async fn connect_redis(url: &str) -> Result<Redis, redis::RedisError> {
    Redis::connect(url).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(rpm: Option<i64>, tpd: Option<i64>) -> Quota {
        Quota {
            bucket: "k1".into(),
            requests_per_minute: rpm,
            tokens_per_day: tpd,
        }
    }

    #[tokio::test]
    async fn requests_per_minute_are_counted() {
        let l = Arc::new(Limiter::local());
        let q = quota(Some(2), None);
        assert!(l.admit(&q, 1).await.is_ok());
        assert!(l.admit(&q, 1).await.is_ok());
        let e = l.admit(&q, 1).await.expect_err("third request in a minute");
        assert!((1..=60).contains(&e.retry_after_secs), "{e:?}");
        // Another key has its own window.
        let other = Quota {
            bucket: "k2".into(),
            ..q
        };
        assert!(l.admit(&other, 1).await.is_ok());
    }

    #[tokio::test]
    async fn daily_tokens_are_charged_after_use() {
        let l = Arc::new(Limiter::local());
        let q = quota(None, Some(10));
        let b = l.admit(&q, 4).await.expect("admitted").expect("a budget");
        b.settle(9).await;
        let b = l
            .admit(&q, 4)
            .await
            .expect("one token left")
            .expect("a budget");
        b.settle(1).await;
        let e = l.admit(&q, 4).await.expect_err("budget used");
        assert!(e.retry_after_secs <= 86_400, "{e:?}");
    }

    #[tokio::test]
    async fn replies_running_at_once_cannot_overspend_the_budget() {
        let l = Arc::new(Limiter::local());
        let q = quota(None, Some(100));
        // Ten replies of up to 30 tokens at once: four fit (the fourth crosses the budget), and
        // the rest are refused until something is given back.
        let mut held = Vec::new();
        let mut refused = 0;
        for _ in 0..10 {
            match l.admit(&q, 30).await {
                Ok(b) => held.push(b.expect("a budget")),
                Err(_) => refused += 1,
            }
        }
        assert_eq!((held.len(), refused), (4, 6));
        // Each used all 30: 120, one reply's max_tokens over at most.
        for b in held.drain(..) {
            b.settle(30).await;
        }
        assert!(l.admit(&q, 1).await.is_err());
        // A reservation that is dropped (the turn failed to start) gives its tokens back.
        let l = Arc::new(Limiter::local());
        let unused = l.admit(&q, 100).await.expect("ok").expect("budget");
        assert!(l.admit(&q, 1).await.is_err(), "all reserved");
        drop(unused);
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        assert!(l.admit(&q, 1).await.is_ok(), "given back");
    }

    #[tokio::test]
    async fn a_request_refused_per_minute_gives_its_tokens_back() {
        let l = Arc::new(Limiter::local());
        let q = quota(Some(1), Some(10));
        let first = l.admit(&q, 10).await.expect("first").expect("budget");
        first.settle(0).await;
        assert!(
            l.admit(&q, 10).await.is_err(),
            "second request in the minute"
        );
        let other_minute_q = Quota {
            requests_per_minute: None,
            ..q
        };
        assert!(
            l.admit(&other_minute_q, 10).await.is_ok(),
            "the budget was not spent"
        );
    }

    /// A clock the test sets.
    fn fixed(at: i64) -> (Clock, Arc<std::sync::atomic::AtomicI64>) {
        let t = Arc::new(std::sync::atomic::AtomicI64::new(at));
        let read = t.clone();
        let clock = Clock::from_fn(move || read.load(std::sync::atomic::Ordering::SeqCst));
        (clock, t)
    }

    /// 2026-11-24 10:17:00.000 UTC.
    const MINUTE_START: i64 = 1_795_515_420_000;

    #[tokio::test]
    async fn stops_are_limited_per_key_and_minute() {
        let (clock, t) = fixed(MINUTE_START + 59_000);
        let l = Limiter::local_with(clock);
        let q = quota(None, None);
        let mut allowed = 0;
        while l.admit_stop(&q).await.is_ok() && allowed <= STOPS_PER_MINUTE {
            allowed += 1;
        }
        assert_eq!(allowed, STOPS_PER_MINUTE);
        let e = l.admit_stop(&q).await.expect_err("over the limit");
        assert_eq!(e.retry_after_secs, 1, "{e:?}");
        let other = Quota {
            bucket: "k2".into(),
            ..q.clone()
        };
        assert!(
            l.admit_stop(&other).await.is_ok(),
            "another key has its own count"
        );
        // The next minute starts a new count.
        t.store(MINUTE_START + 60_000, std::sync::atomic::Ordering::SeqCst);
        assert!(l.admit_stop(&q).await.is_ok());
    }

    #[tokio::test]
    async fn loads_are_limited_per_key_and_hour_and_count_as_requests() {
        // 10:17 of the hour: 43 minutes left in it.
        let (clock, t) = fixed(MINUTE_START);
        let l = Limiter::local_with(clock);
        let q = quota(Some(3), None);
        assert!(l.admit_load(&q, 2).await.is_ok());
        assert!(l.admit_load(&q, 2).await.is_ok());
        let e = l.admit_load(&q, 2).await.expect_err("a third load");
        assert!(e.what.contains("--max-loads-per-hour"), "{e}");
        assert_eq!(e.retry_after_secs, 43 * 60, "{e:?}");
        // Each load was a request of the minute too: one more request fills it.
        let l = Arc::new(l);
        assert!(l.admit(&q, 1).await.is_ok());
        assert!(l.admit(&q, 1).await.is_err(), "3 requests in the minute");
        // A refused load took nothing: the next hour, and the next minute, have room again.
        t.store(
            MINUTE_START + 43 * 60_000,
            std::sync::atomic::Ordering::SeqCst,
        );
        assert!(l.admit_load(&q, 2).await.is_ok());
        let other = Quota {
            bucket: "k2".into(),
            ..q.clone()
        };
        assert!(l.admit_load(&other, 2).await.is_ok(), "its own count");
    }

    #[tokio::test]
    async fn retry_after_counts_the_seconds_left_in_the_window_rounded_up() {
        let (clock, t) = fixed(MINUTE_START + 45_200);
        let l = Arc::new(Limiter::local_with(clock));
        let q = quota(Some(2), None);
        assert!(l.admit(&q, 1).await.is_ok());
        assert!(l.admit(&q, 1).await.is_ok());
        let e = l
            .admit(&q, 1)
            .await
            .expect_err("third request in the minute");
        assert_eq!(
            e.retry_after_secs, 15,
            "14.8 s are left in the minute: {e:?}"
        );
        // At the minute's last millisecond the answer is still at least a second.
        t.store(MINUTE_START + 59_999, std::sync::atomic::Ordering::SeqCst);
        let e = l.admit(&q, 1).await.expect_err("still this minute");
        assert_eq!(e.retry_after_secs, 1);
        // The first millisecond of the next minute admits again.
        t.store(MINUTE_START + 60_000, std::sync::atomic::Ordering::SeqCst);
        assert!(l.admit(&q, 1).await.is_ok());

        // A day's budget: refused until the next UTC day, which starts 13 h 43 min after
        // 10:17:00.
        let q = quota(None, Some(5));
        t.store(MINUTE_START, std::sync::atomic::Ordering::SeqCst);
        l.admit(&q, 5)
            .await
            .expect("ok")
            .expect("budget")
            .settle(5)
            .await;
        let e = l.admit(&q, 1).await.expect_err("budget spent");
        assert_eq!(e.retry_after_secs, 13 * 3600 + 43 * 60, "{e:?}");
        t.store(
            MINUTE_START + 49_380_000,
            std::sync::atomic::Ordering::SeqCst,
        );
        assert!(l.admit(&q, 1).await.is_ok(), "a new day, a new budget");
    }

    #[tokio::test]
    async fn no_limits_means_no_counting() {
        let l = Arc::new(Limiter::local());
        let q = quota(None, None);
        for _ in 0..100 {
            assert!(l.admit(&q, 1).await.expect("ok").is_none());
        }
    }
}
