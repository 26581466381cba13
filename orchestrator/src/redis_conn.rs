//! The shared Redis connection, with a short circuit breaker: after a failed call, Redis is not
//! asked again for [`SKIP_AFTER_FAILURE`], so an outage costs requests nothing instead of a
//! timeout each. Callers treat `None` as "Redis cannot say" and carry on without it.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::FromRedisValue;

use crate::storage::now_ms;

/// How long Redis is left alone after a failure.
pub const SKIP_AFTER_FAILURE: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct Redis {
    conn: ConnectionManager,
    /// Unix ms until which Redis counts as down; 0 when up.
    down_until: Arc<AtomicI64>,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Redis")
    }
}

impl Redis {
    /// Connects with short timeouts and no retries (a retry would wait a second or more).
    pub async fn connect(url: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_millis(500))
            .set_response_timeout(Duration::from_millis(500))
            .set_number_of_retries(0);
        Ok(Self {
            conn: client.get_connection_manager_with_config(config).await?,
            down_until: Arc::new(AtomicI64::new(0)),
        })
    }

    pub async fn cmd<T: FromRedisValue>(&self, cmd: &redis::Cmd, what: &str) -> Option<T> {
        let mut c = self.available()?;
        self.settle(cmd.query_async(&mut c).await, what)
    }

    pub async fn pipe<T: FromRedisValue>(&self, pipe: &redis::Pipeline, what: &str) -> Option<T> {
        let mut c = self.available()?;
        self.settle(pipe.query_async(&mut c).await, what)
    }

    pub async fn script<T: FromRedisValue>(
        &self,
        run: &redis::ScriptInvocation<'_>,
        what: &str,
    ) -> Option<T> {
        let mut c = self.available()?;
        self.settle(run.invoke_async(&mut c).await, what)
    }

    /// As [`Redis::script`], tried even while Redis counts as down: for background work that
    /// retries on its own and must know the moment Redis is back (a reply's publisher, whose
    /// clients wait for it).
    pub async fn script_now<T: FromRedisValue>(
        &self,
        run: &redis::ScriptInvocation<'_>,
        what: &str,
    ) -> Option<T> {
        let mut c = self.conn.clone();
        self.settle(run.invoke_async(&mut c).await, what)
    }

    fn available(&self) -> Option<ConnectionManager> {
        (self.down_until.load(Ordering::Relaxed) <= now_ms()).then(|| self.conn.clone())
    }

    fn settle<T>(&self, r: redis::RedisResult<T>, what: &str) -> Option<T> {
        match r {
            Ok(v) => {
                if self.down_until.swap(0, Ordering::Relaxed) != 0 {
                    tracing::info!("redis is reachable again");
                }
                Some(v)
            }
            Err(e) => {
                let until = now_ms() + SKIP_AFTER_FAILURE.as_millis() as i64;
                if self.down_until.swap(until, Ordering::Relaxed) == 0 {
                    tracing::warn!(error = %e, "redis unavailable: {what}");
                }
                None
            }
        }
    }
}
