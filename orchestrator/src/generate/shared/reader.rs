//! Reading a reply's shared stream: a resume on a replica that does not run the reply gets the
//! events after its `Last-Event-ID`, then each as it is added, until the reply's last (see the
//! parent module's rules; a stream begun again elsewhere than the client is gets `stream_lost`).

use std::time::Duration;

use tokio_stream::Stream;

use super::{entry_number, stream_key, Entries, SharedReply, BLOCK, QUIET_LIMIT};
use crate::generate::wire::{self, NativeEvent};
use crate::ids::MessageId;

impl SharedReply {
    /// The events after the first `from` (0-based), then each as it comes, until the reply's
    /// last. None when the stream is gone or no longer holds event `from + 1` (trimmed: the
    /// client reads the stored message instead). A stream begun again by a replica that took
    /// the reply over without it (Redis lost it) serves only a client that has exactly the
    /// events before its first: any other gets one `error` event (`stream_lost`), as does a
    /// reader that finds the stream begun again under it.
    pub async fn events(
        self,
        from: usize,
    ) -> Result<Option<impl Stream<Item = NativeEvent> + Send + 'static>, redis::RedisError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Duration::from_millis(500))
            .set_response_timeout(BLOCK + Duration::from_secs(2));
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let key = stream_key(&self.message_id);
        let (lost, first) = match start(&mut conn, &key, from).await? {
            Start::Missing => return Ok(None),
            Start::Lost => (true, Vec::new()),
            Start::At(first) => (false, first),
        };
        let message_id = self.message_id.clone();
        Ok(Some(async_stream::stream! {
            if lost {
                yield stream_lost(&message_id, from);
                return;
            }
            let mut last = from;
            let mut entries = first;
            let mut quiet = tokio::time::Instant::now();
            loop {
                for (id, mut fields) in entries {
                    let n = entry_number(&id).unwrap_or_default();
                    // Begun again under this reader, elsewhere than where it is: what it
                    // showed is not what the stream now goes on from.
                    if last.checked_add(1) != Some(n) {
                        yield stream_lost(&message_id, last);
                        return;
                    }
                    let e = NativeEvent {
                        id: format!("{message_id}:{n}"),
                        name: fields.remove("e").unwrap_or_default().into(),
                        data: fields.remove("d").unwrap_or_default(),
                    };
                    last = n;
                    quiet = tokio::time::Instant::now();
                    let end = e.is_last();
                    yield e;
                    if end {
                        return;
                    }
                }
                if quiet.elapsed() > QUIET_LIMIT {
                    return;
                }
                // Redis went away: the client reconnects, and is served where it can be.
                let Ok(read) = read_after(&mut conn, &key, last).await else {
                    return;
                };
                entries = read;
            }
        }))
    }
}

/// The entries of stream `key` after event `last`, waiting up to [`BLOCK`] for some.
async fn read_after(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    last: usize,
) -> redis::RedisResult<Entries> {
    let read: Option<Vec<(String, Entries)>> = redis::cmd("XREAD")
        .arg("BLOCK")
        .arg(BLOCK.as_millis() as u64)
        .arg("STREAMS")
        .arg(key)
        .arg(format!("0-{last}"))
        .query_async(conn)
        .await?;
    Ok(read.into_iter().flatten().flat_map(|(_, e)| e).collect())
}

/// Where a reader after the first `from` events of a stream begins.
enum Start {
    /// The stream is gone, or no longer holds event `from + 1`.
    Missing,
    /// The stream was begun again after another number of events than the reader has.
    Lost,
    /// These entries, from event `from + 1` on.
    At(Entries),
}

async fn start(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    from: usize,
) -> redis::RedisResult<Start> {
    let oldest: Entries = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await?;
    // Empty: a replica that just took the reply over (its stream lost) writes its first
    // event soon.
    let oldest = match oldest.is_empty() {
        true => first_entry(conn, key).await?,
        false => oldest,
    };
    let Some((id, fields)) = oldest.first() else {
        return Ok(Start::Missing);
    };
    let origin = entry_number(id).unwrap_or(usize::MAX);
    // A reader's count comes from its client: no stream holds an event past `usize::MAX`.
    let Some(next) = from.checked_add(1) else {
        return Ok(Start::Missing);
    };
    if fields.contains_key("r") && origin != next {
        return Ok(Start::Lost);
    }
    if origin > next {
        return Ok(Start::Missing);
    }
    let first = redis::cmd("XRANGE")
        .arg(key)
        .arg(format!("0-{next}"))
        .arg("+")
        .query_async(conn)
        .await?;
    Ok(Start::At(first))
}

/// The stream's first entry, waited for (at most [`BLOCK`]) while there is none.
async fn first_entry(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> redis::RedisResult<Entries> {
    let read: Option<Vec<(String, Entries)>> = redis::cmd("XREAD")
        .arg("COUNT")
        .arg(1)
        .arg("BLOCK")
        .arg(BLOCK.as_millis() as u64)
        .arg("STREAMS")
        .arg(key)
        .arg("0-0")
        .query_async(conn)
        .await?;
    Ok(read.into_iter().flatten().flat_map(|(_, e)| e).collect())
}

/// The event a client gets when the stream cannot show it the rest of the reply as it was
/// shown so far (see [`SharedReply::events`]): the reply goes on, and is stored; the client
/// reads it from the session's messages. Its id repeats the client's last.
fn stream_lost(message_id: &MessageId, last: usize) -> NativeEvent {
    let data = serde_json::json!({
        "error_type": wire::STREAM_LOST,
        "message": "the replica running this reply stopped and its shared stream was lost: \
                    the rest of the reply cannot be shown here as it was begun; it goes on and \
                    is stored, so read it from the session's messages",
        "message_id": message_id,
        "content": "",
    });
    NativeEvent {
        id: format!("{message_id}:{last}"),
        name: "error".into(),
        data: data.to_string(),
    }
}
