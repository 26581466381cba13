//! Stop signals between orchestrator replicas, over Redis pub/sub.
//!
//! A reply runs on the replica that accepted it; a `POST …/stop` may arrive at another one. That
//! replica publishes the session id on [`STOP_CHANNEL`]; every replica listens and stops its own
//! running reply of that session, if it has one.

use std::sync::Arc;
use std::time::Duration;

use tokio_stream::StreamExt;

use crate::generate::Streams;
use crate::limits::Redis;

pub const STOP_CHANNEL: &str = "hearth:stop";

#[derive(Debug, Clone)]
pub struct StopBus {
    conn: Redis,
}

impl StopBus {
    pub fn new(conn: Redis) -> Self {
        Self { conn }
    }

    /// Asks every replica to stop the session's running reply; false if Redis is unreachable.
    pub async fn publish(&self, session_id: &str) -> bool {
        self.conn
            .cmd::<i64>(
                redis::cmd("PUBLISH").arg(STOP_CHANNEL).arg(session_id),
                "stop not relayed",
            )
            .await
            .is_some()
    }

    /// Listens for stop signals for as long as the process runs, reconnecting after outages.
    pub fn listen(url: String, streams: Arc<Streams>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                match listen_once(&url, &streams).await {
                    Err(e) if !failing => {
                        tracing::warn!(error = %e, "redis stop channel lost; reconnecting");
                        failing = true;
                    }
                    Err(_) => {}
                    Ok(()) => failing = false,
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    }
}

async fn listen_once(url: &str, streams: &Streams) -> redis::RedisResult<()> {
    let client = redis::Client::open(url)?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(STOP_CHANNEL).await?;
    let mut messages = pubsub.on_message();
    while let Some(msg) = messages.next().await {
        let Ok(session_id) = msg.get_payload::<String>() else {
            continue;
        };
        if let Some(live) = streams.get(&session_id).filter(|l| !l.is_finished()) {
            tracing::info!(session = %session_id, "stopping a reply at another replica's request");
            live.stop();
        }
    }
    Ok(())
}
