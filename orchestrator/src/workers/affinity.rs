//! Where sessions' KV caches and conversations' prefixes live: a session goes back to the worker
//! that holds its KV cache, and a stateless request to the worker that served the longest of its
//! leading token runs (see [`prefix_keys`]: it likely holds that prefix in its prefix cache).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::ids::{SessionId, UserId};

/// Where sessions' caches live: in this process, and shared through Redis when there is one.
/// The local map is written either way, so while Redis is down this replica still sends the
/// sessions it routed itself back to their caches (it learns nothing from other replicas then).
#[derive(Debug, Default)]
pub struct Affinity {
    local: Mutex<HashMap<Key, String>>,
    redis: Option<crate::limits::Redis>,
}

const AFFINITY_TTL_SECS: u64 = 86_400;

/// Tokens in the shortest prefix routed by affinity: one KV block of the worker.
const PREFIX_UNIT: usize = 16;

/// The affinity key of one leading run of a prompt's tokens (see [`prefix_keys`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PrefixKey(String);

/// What a worker is remembered for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Session(SessionId),
    Prefix(PrefixKey),
}

impl Key {
    /// The Redis key, the same in every replica.
    fn redis(&self) -> String {
        match self {
            Self::Session(s) => format!("hearth:affinity:{s}"),
            Self::Prefix(PrefixKey(p)) => format!("hearth:affinity:{p}"),
        }
    }
}

/// Affinity keys of `user`'s stateless prompt: a hash of each of its leading runs of 16, 32,
/// 64, … tokens (short of its last token, which a worker always computes), shortest first. A
/// conversation resent with one more turn shares its earlier keys; the user's prompts with a
/// common system prompt share the keys that fall inside it. Workers cache prefixes per user, so
/// the keys are per user too: another user's prompt is never routed by this one's. The
/// exception is the first `shared` tokens, an operator's shared system prompt that workers cache
/// for everyone: runs inside it are everyone's keys.
pub fn prefix_keys(user: &UserId, prompt: &[u32], shared: usize) -> Vec<PrefixKey> {
    use std::hash::{Hash, Hasher};
    let mut keys = Vec::new();
    let mut len = PREFIX_UNIT;
    while len < prompt.len() {
        // The same key in every orchestrator replica: DefaultHasher::new() has fixed keys.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        if len > shared {
            user.as_str().hash(&mut h);
        }
        prompt[..len].hash(&mut h);
        keys.push(PrefixKey(format!("prefix:{len}:{:016x}", h.finish())));
        len *= 2;
    }
    keys
}

impl Affinity {
    /// Remembered in this process only.
    pub fn local() -> Self {
        Self::default()
    }

    /// Shared through Redis, with this process's own memory when Redis cannot be reached.
    pub fn shared(redis: crate::limits::Redis) -> Self {
        Self {
            local: Mutex::default(),
            redis: Some(redis),
        }
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashMap<Key, String>> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The worker of the last of `keys` that has one.
    pub(super) async fn get_last(&self, keys: &[PrefixKey]) -> Option<String> {
        let keys: Vec<Key> = keys.iter().cloned().map(Key::Prefix).collect();
        if let (Some(c), false) = (&self.redis, keys.is_empty()) {
            let mut get = redis::cmd("MGET");
            for k in &keys {
                get.arg(k.redis());
            }
            if let Some(found) = c
                .cmd::<Vec<Option<String>>>(&get, "prefix affinity unknown")
                .await
            {
                return found.into_iter().rev().flatten().next();
            }
        }
        let m = self.remembered();
        keys.iter().rev().find_map(|k| m.get(k).cloned())
    }

    /// The worker that last served `session`.
    pub(super) async fn get(&self, session: &SessionId) -> Option<String> {
        let key = Key::Session(session.clone());
        if let Some(c) = &self.redis {
            let get = redis::cmd("GET").arg(key.redis()).clone();
            if let Some(found) = c
                .cmd::<Option<String>>(&get, "session affinity unknown")
                .await
            {
                return found;
            }
        }
        self.remembered().get(&key).cloned()
    }

    pub(super) async fn set_session(&self, session: &SessionId, addr: &str) {
        self.set(Key::Session(session.clone()), addr).await;
    }

    pub(super) async fn set_prefix(&self, prefix: &PrefixKey, addr: &str) {
        self.set(Key::Prefix(prefix.clone()), addr).await;
    }

    async fn set(&self, key: Key, addr: &str) {
        let redis_key = key.redis();
        {
            let mut m = self.remembered();
            if m.len() > 100_000 {
                m.clear();
            }
            m.insert(key, addr.to_string());
        }
        if let Some(c) = &self.redis {
            let set = redis::cmd("SET")
                .arg(redis_key)
                .arg(addr)
                .arg("EX")
                .arg(AFFINITY_TTL_SECS)
                .clone();
            c.cmd::<()>(&set, "session affinity not saved").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_keys_grow_by_doubling_and_a_longer_conversation_shares_them() {
        let turn1: Vec<u32> = (0..40).collect();
        let mut turn2 = turn1.clone();
        turn2.extend(100..200);
        let u = UserId::random();
        let (k1, k2) = (prefix_keys(&u, &turn1, 0), prefix_keys(&u, &turn2, 0));
        // 16 and 32 tokens fit before turn 1's last token; 64 and 128 also in turn 2's.
        assert_eq!(k1.len(), 2);
        assert_eq!(k2.len(), 4);
        assert_eq!(k2[..2], k1[..]);
        let mut other = turn1.clone();
        other[20] = 999;
        let k3 = prefix_keys(&u, &other, 0);
        assert_eq!(k3[0], k1[0], "the first 16 tokens are the same");
        assert_ne!(k3[1], k1[1]);
        assert!(prefix_keys(&u, &turn1[..16], 0).is_empty());
        let v = UserId::random();
        assert!(
            prefix_keys(&v, &turn1, 0).iter().all(|k| !k1.contains(k)),
            "another user's keys"
        );
        // With a 40-token shared prompt, runs inside it (16, 32) are everyone's; longer ones
        // are still each user's own.
        let (ku, kv) = (prefix_keys(&u, &turn2, 40), prefix_keys(&v, &turn2, 40));
        assert_eq!(ku[..2], kv[..2]);
        assert!(ku[2..].iter().all(|k| !kv.contains(k)));
        assert_ne!(ku[0], k2[0], "shared keys are not the user's own");
    }

    #[tokio::test]
    async fn the_longest_known_prefix_key_wins() {
        let a = Affinity::local();
        let keys = prefix_keys(&UserId::random(), &(0..100).collect::<Vec<u32>>(), 0);
        assert_eq!(a.get_last(&keys).await, None);
        a.set_prefix(&keys[0], "w1").await;
        a.set_prefix(&keys[2], "w2").await;
        assert_eq!(a.get_last(&keys).await.as_deref(), Some("w2"));
        assert_eq!(a.get_last(&keys[..2]).await.as_deref(), Some("w1"));
    }
}
