//! API keys: how they are made, stored and checked.
//!
//! A key is `hk_` followed by 64 hex characters (256 random bits from the OS via UUIDv4s' random
//! source). Only its SHA-256 is stored, with its first 11 characters as a prefix that people can
//! recognise and that finds the candidate rows; the hash is then compared in constant time. A
//! revoked or expired key is refused like an unknown one.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::storage::{now_ms, Accounts, ApiKey, KeyRole, NewApiKey, StoreError, User};

/// `hk_` and the first 8 hex characters.
pub const PREFIX_LEN: usize = 11;
const KEY_LEN: usize = 3 + 64;

/// A key as shown to its owner, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedKey {
    pub key: String,
    pub record: ApiKey,
}

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub user: User,
    pub key: ApiKey,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// Deliberately the same for a malformed, unknown, revoked or expired key.
    #[error("invalid API key")]
    InvalidKey,
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub fn hash_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex64() -> String {
    // Two v4 UUIDs: 244 random bits from the operating system's generator.
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Limits and lifetime of a new key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyOptions {
    pub requests_per_minute: Option<i64>,
    pub tokens_per_day: Option<i64>,
    pub expires_at: Option<i64>,
    pub role: KeyRole,
}

/// Creates a key for `user_name` (and the user, if new).
pub async fn issue_key(
    store: &dyn Accounts,
    user_name: &str,
    options: KeyOptions,
) -> Result<IssuedKey, StoreError> {
    let user = store.ensure_user(user_name).await?;
    let key = format!("hk_{}", random_hex64());
    let record = store
        .insert_api_key(NewApiKey {
            user_id: user.id,
            prefix: key[..PREFIX_LEN].to_string(),
            key_hash: hash_key(&key),
            requests_per_minute: options.requests_per_minute,
            tokens_per_day: options.tokens_per_day,
            expires_at: options.expires_at,
            role: options.role,
        })
        .await?;
    Ok(IssuedKey { key, record })
}

/// Checks a presented key (the bearer token) and returns its owner.
pub async fn authenticate(store: &dyn Accounts, presented: &str) -> Result<Caller, AuthError> {
    let well_formed = presented.len() == KEY_LEN
        && presented.starts_with("hk_")
        && presented[3..].bytes().all(|b| b.is_ascii_hexdigit());
    if !well_formed {
        return Err(AuthError::InvalidKey);
    }
    let hash = hash_key(presented);
    let now = now_ms();
    for (key, user) in store.api_keys_by_prefix(&presented[..PREFIX_LEN]).await? {
        let matches: bool = key.key_hash.as_bytes().ct_eq(hash.as_bytes()).into();
        if matches {
            let live = key.revoked_at.is_none() && key.expires_at.is_none_or(|t| t > now);
            return if live {
                Ok(Caller { user, key })
            } else {
                Err(AuthError::InvalidKey)
            };
        }
    }
    Err(AuthError::InvalidKey)
}

/// Checks of presented keys, one database lookup for all the requests that present the same
/// key at the same moment: a client that opens a thousand streams at once costs one query, not
/// a thousand queued on the connection pool (where the last would time out). A lookup is shared
/// only while it runs (and never past [`JOIN_WINDOW`]), so a revoked key is refused by the
/// next request that comes after.
#[derive(Debug, Default)]
pub struct KeyChecks {
    inflight: std::sync::Mutex<HashMap<String, Arc<Lookup>>>,
}

/// Longest a lookup is joined by requests that come after it began.
const JOIN_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug)]
struct Lookup {
    began: std::time::Instant,
    result: tokio::sync::OnceCell<Result<Caller, AuthError>>,
}

impl KeyChecks {
    /// As [`authenticate`], sharing a lookup in flight for the same key.
    pub async fn authenticate(
        &self,
        store: &dyn Accounts,
        presented: &str,
    ) -> Result<Caller, AuthError> {
        let hash = hash_key(presented);
        let lookup = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            inflight.retain(|_, l| l.began.elapsed() < JOIN_WINDOW);
            inflight
                .entry(hash.clone())
                .or_insert_with(|| {
                    Arc::new(Lookup {
                        began: std::time::Instant::now(),
                        result: tokio::sync::OnceCell::new(),
                    })
                })
                .clone()
        };
        let result = lookup
            .result
            .get_or_init(|| authenticate(store, presented))
            .await
            .clone();
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        if inflight.get(&hash).is_some_and(|l| Arc::ptr_eq(l, &lookup)) {
            inflight.remove(&hash);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_sha256_hex() {
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn keys_are_long_random_and_distinct() {
        let a = random_hex64();
        let b = random_hex64();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
