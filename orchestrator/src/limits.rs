//! Rate limits per API key: requests per minute and generated tokens per day, in fixed windows
//! (the current UTC minute and the current UTC day).
//!
//! With Redis the counters are shared by every orchestrator replica; without it they live in
//! this process. When Redis cannot be reached the limits are not enforced (requests pass and a
//! warning is logged, and Redis is left alone for a moment between tries): an outage of the
//! limiter must not take the chat service down with it.

use std::collections::HashMap;
use std::sync::Mutex;

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

#[derive(Debug)]
pub enum Limiter {
    Local(Mutex<HashMap<String, (i64, i64)>>),
    Redis(Redis),
}

const MINUTE_MS: i64 = 60_000;
const UNENFORCED: &str = "rate limits are not enforced";
const DAY_MS: i64 = 86_400_000;

fn retry_after(window_ms: i64, now: i64) -> u64 {
    let left = window_ms - now.rem_euclid(window_ms);
    (left as u64).div_ceil(1000).max(1)
}

impl Limiter {
    pub fn local() -> Self {
        Self::Local(Mutex::new(HashMap::new()))
    }

    /// Counts one request against the per-minute limit and checks the daily token budget.
    pub async fn admit(&self, q: &Quota) -> Result<(), Limited> {
        let now = now_ms();
        if let Some(limit) = q.tokens_per_day {
            let used = self.read(&day_key(&q.bucket, now)).await;
            if used >= limit {
                crate::telemetry::count_rate_limited("tokens_per_day");
                return Err(Limited {
                    what: format!("the daily limit of {limit} generated tokens is used up"),
                    retry_after_secs: retry_after(DAY_MS, now),
                });
            }
        }
        if let Some(limit) = q.requests_per_minute {
            let n = self.add(&minute_key(&q.bucket, now), 1, 120).await;
            if n > limit {
                crate::telemetry::count_rate_limited("requests_per_minute");
                return Err(Limited {
                    what: format!("more than {limit} requests in this minute"),
                    retry_after_secs: retry_after(MINUTE_MS, now),
                });
            }
        }
        Ok(())
    }

    /// Charges generated tokens to the daily budget.
    pub async fn charge_tokens(&self, q: &Quota, tokens: u64) {
        if q.tokens_per_day.is_some() && tokens > 0 {
            self.add(&day_key(&q.bucket, now_ms()), tokens as i64, 2 * 86_400)
                .await;
        }
    }

    async fn read(&self, key: &str) -> i64 {
        match self {
            Self::Local(m) => {
                let m = m.lock().unwrap_or_else(|p| p.into_inner());
                m.get(key).map_or(0, |&(_, n)| n)
            }
            Self::Redis(c) => c
                .cmd::<Option<i64>>(redis::cmd("GET").arg(key), UNENFORCED)
                .await
                .flatten()
                .unwrap_or(0),
        }
    }

    /// Adds `n` and returns the new count (0 when Redis is unavailable).
    async fn add(&self, key: &str, n: i64, ttl_secs: i64) -> i64 {
        match self {
            Self::Local(m) => {
                let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                let now = now_ms();
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
            Self::Redis(c) => {
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
        let l = Limiter::local();
        let q = quota(Some(2), None);
        assert!(l.admit(&q).await.is_ok());
        assert!(l.admit(&q).await.is_ok());
        let e = l.admit(&q).await.expect_err("third request in a minute");
        assert!((1..=60).contains(&e.retry_after_secs), "{e:?}");
        // Another key has its own window.
        let other = Quota {
            bucket: "k2".into(),
            ..q
        };
        assert!(l.admit(&other).await.is_ok());
    }

    #[tokio::test]
    async fn daily_tokens_are_charged_after_use() {
        let l = Limiter::local();
        let q = quota(None, Some(10));
        assert!(l.admit(&q).await.is_ok());
        l.charge_tokens(&q, 9).await;
        assert!(l.admit(&q).await.is_ok());
        l.charge_tokens(&q, 1).await;
        let e = l.admit(&q).await.expect_err("budget used");
        assert!(e.retry_after_secs <= 86_400, "{e:?}");
    }

    #[tokio::test]
    async fn no_limits_means_no_counting() {
        let l = Limiter::local();
        let q = quota(None, None);
        for _ in 0..100 {
            assert!(l.admit(&q).await.is_ok());
        }
    }
}
