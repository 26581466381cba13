//! Users and their API keys.

use async_trait::async_trait;

use super::types::{ApiKey, KeyId, NewApiKey, User};
use super::StoreResult;

#[async_trait]
pub trait Accounts: Send + Sync + std::fmt::Debug {
    async fn create_user(&self, name: &str) -> StoreResult<User>;

    /// The user `name`, created unless it exists: several replicas starting at once all get
    /// the same user.
    async fn ensure_user(&self, name: &str) -> StoreResult<User>;

    async fn user_by_name(&self, name: &str) -> StoreResult<Option<User>>;

    async fn insert_api_key(&self, key: NewApiKey) -> StoreResult<ApiKey>;

    /// Keys whose prefix matches, with their users; the caller compares hashes in constant time
    /// and checks revocation and expiry.
    async fn api_keys_by_prefix(&self, prefix: &str) -> StoreResult<Vec<(ApiKey, User)>>;

    async fn revoke_api_key(&self, key_id: &KeyId, at_ms: i64) -> StoreResult<()>;
}
