//! Stop signals between orchestrator replicas, and replies handed over, over Redis pub/sub.
//!
//! A reply runs on the replica that accepted it; a `POST …/stop` may arrive at another one. That
//! replica subscribes to [`ENDED_CHANNEL`], then publishes the session id on [`STOP_CHANNEL`];
//! every replica listens there and stops its own running reply of that session, if it has one,
//! and once that reply is stored announces the session id on [`ENDED_CHANNEL`]. The stopping
//! replica waits for that announcement instead of polling the database.
//!
//! A replica that shuts down with replies still running hands them over: it publishes each
//! reply's message id on [`RELEASE_CHANNEL`], and every other replica's orphan sweep tries at
//! once to take it over (one wins), instead of waiting for the reply to fall silent.

use std::sync::Arc;
use std::time::Duration;

use tokio_stream::StreamExt;

use crate::generate::Streams;
use crate::ids::{MessageId, SessionId};
use crate::limits::Redis;

pub const STOP_CHANNEL: &str = "hearth:stop";
/// Session ids whose reply a stop ended, published once the reply is stored.
pub const ENDED_CHANNEL: &str = "hearth:stop:ended";
/// Message ids of replies a replica that shut down left for another to take over.
pub const RELEASE_CHANNEL: &str = "hearth:released";

#[derive(Debug, Clone)]
pub struct StopBus {
    conn: Redis,
    /// For the subscriptions: pub/sub takes a connection of its own.
    url: String,
}

/// A stop sent to the other replicas, whose end can be awaited.
pub struct StopSent {
    session_id: SessionId,
    ended: redis::aio::PubSub,
}

impl std::fmt::Debug for StopSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopSent")
            .field("session_id", &self.session_id)
            .finish_non_exhaustive()
    }
}

impl StopSent {
    /// Waits until the replica running the reply says it has stored it; false after `limit`
    /// (no replica ran it any more, or the one that did went away).
    pub async fn ended(mut self, limit: Duration) -> bool {
        let session_id = self.session_id;
        let mut messages = self.ended.on_message();
        let wait = async {
            while let Some(msg) = messages.next().await {
                if msg.get_payload::<String>().ok().as_deref() == Some(session_id.as_str()) {
                    return true;
                }
            }
            false
        };
        tokio::time::timeout(limit, wait).await.unwrap_or(false)
    }
}

impl StopBus {
    pub fn new(conn: Redis, url: String) -> Self {
        Self { conn, url }
    }

    /// Asks every replica to stop the session's running reply; false if Redis is unreachable.
    pub async fn publish(&self, session_id: &SessionId) -> bool {
        self.conn
            .cmd::<i64>(
                redis::cmd("PUBLISH")
                    .arg(STOP_CHANNEL)
                    .arg(session_id.as_str()),
                "stop not relayed",
            )
            .await
            .is_some()
    }

    /// Like [`publish`](Self::publish), listening first for the reply's end; `None` if Redis is
    /// unreachable.
    pub async fn stop(&self, session_id: &SessionId) -> Option<StopSent> {
        let subscribe = async {
            let client = redis::Client::open(self.url.as_str())?;
            let mut ended = client.get_async_pubsub().await?;
            ended.subscribe(ENDED_CHANNEL).await?;
            Ok::<_, redis::RedisError>(ended)
        };
        let ended = match tokio::time::timeout(Duration::from_secs(1), subscribe).await {
            Ok(Ok(ended)) => ended,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "stop not relayed: cannot subscribe");
                return None;
            }
            Err(_) => {
                tracing::warn!("stop not relayed: subscribing timed out");
                return None;
            }
        };
        self.publish(session_id).await.then(|| StopSent {
            session_id: session_id.clone(),
            ended,
        })
    }

    /// Tells the other replicas that the replies `ids` are theirs to take over now.
    pub async fn release(&self, ids: &[MessageId]) {
        for id in ids {
            let cmd = redis::cmd("PUBLISH")
                .arg(RELEASE_CHANNEL)
                .arg(id.as_str())
                .clone();
            self.conn
                .cmd::<i64>(&cmd, "handed-over reply not announced")
                .await;
        }
    }

    /// Listens for stop signals for as long as the process runs, reconnecting after outages,
    /// and passes the ids of replies handed over on to `released`.
    pub fn listen(
        self,
        streams: Arc<Streams>,
        released: tokio::sync::mpsc::UnboundedSender<MessageId>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                match self.listen_once(&streams, &released).await {
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

    async fn listen_once(
        &self,
        streams: &Streams,
        released: &tokio::sync::mpsc::UnboundedSender<MessageId>,
    ) -> redis::RedisResult<()> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub
            .subscribe(vec![STOP_CHANNEL, RELEASE_CHANNEL])
            .await?;
        let mut messages = pubsub.on_message();
        while let Some(msg) = messages.next().await {
            let payload = msg.get_payload::<String>().ok();
            if msg.get_channel_name() == RELEASE_CHANNEL {
                if let Some(id) = payload.as_deref().and_then(MessageId::parse) {
                    let _ = released.send(id);
                }
                continue;
            }
            // Anything but a session id names no reply.
            let Some(session_id) = payload.as_deref().and_then(SessionId::parse) else {
                continue;
            };
            let Some(live) = streams.get(&session_id).filter(|l| !l.is_finished()) else {
                continue;
            };
            tracing::info!(session = %session_id, "stopping a reply at another replica's request");
            live.stop();
            let conn = self.conn.clone();
            tokio::spawn(async move {
                // A reply's outcome is stored before it is announced.
                live.outcome().await;
                conn.cmd::<i64>(
                    redis::cmd("PUBLISH")
                        .arg(ENDED_CHANNEL)
                        .arg(session_id.as_str()),
                    "stop's end not announced",
                )
                .await;
            });
        }
        Ok(())
    }
}
