//! Ids in request paths, validated as they are extracted: a handler that takes a [`SessionId`]
//! or a [`MessageId`] holds a well-formed one. Ids are 32 lowercase hex characters (a UUID's
//! simple form, as the store makes them); anything else names nothing, so it is a 404 like an
//! unknown or another user's id, and never reaches the database.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;

use super::ApiError;

fn well_formed(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

macro_rules! path_id {
    ($(#[$doc:meta])* $name:ident, $param:literal, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $name(String);

        impl $name {
            /// The id, if `id` is one.
            pub fn parse(id: &str) -> Option<Self> {
                well_formed(id).then(|| Self(id.to_string()))
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        /// The route's `{
        #[doc = $param]
        /// }` segment.
        impl<S: Send + Sync> FromRequestParts<S> for $name {
            type Rejection = ApiError;

            async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
                let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, state)
                    .await
                    .map_err(|_| ApiError::NotFound($what))?;
                params
                    .get($param)
                    .and_then(|id| Self::parse(id))
                    .ok_or(ApiError::NotFound($what))
            }
        }
    };
}

path_id!(
    /// A session's id, from a route's `{id}`.
    SessionId,
    "id",
    "session"
);
path_id!(
    /// A message's id, from a route's `{message_id}`.
    MessageId,
    "message_id",
    "message"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_32_lowercase_hex_characters_are_an_id() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            SessionId::parse(id).map(|i| i.to_string()).as_deref(),
            Some(id)
        );
        for bad in [
            "",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0",
            "0123456789ABCDEF0123456789abcdef",
            "0123456789abcdef0123456789abcdeg",
            "../../../etc/passwd/0123456789abc",
            "0123456789abcdef 123456789abcdef",
        ] {
            assert!(SessionId::parse(bad).is_none(), "{bad:?}");
            assert!(MessageId::parse(bad).is_none(), "{bad:?}");
        }
    }
}
