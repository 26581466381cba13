//! Ids of users, API keys, sessions and messages: 32 lowercase hex characters (a UUID's simple
//! form, as the store makes them). One type per kind, from the HTTP edge through the chat
//! service, the store, generation and routing, so a session id is never passed where a message
//! id is expected.
//!
//! Only [`parse`](SessionId::parse), [`random`](SessionId::random) (a fresh id, for the store) and
//! reading a row make one, each checking the form, so a value of these types is well formed
//! wherever it goes; anything else names nothing. They are stored and bound as text.
//!
//! The worker's gRPC API takes any string as a session or user id (its own `hearth_shared`
//! types); these convert at that edge, in [`crate::generate`].

use serde::Serialize;
use sqlx::any::{Any, AnyTypeInfo};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::{Database, Decode, Encode, Type};

fn well_formed(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// The id, if `id` is one.
            pub fn parse(id: &str) -> Option<Self> {
                well_formed(id).then(|| Self(id.to_string()))
            }

            /// A fresh, random id.
            pub fn random() -> Self {
                Self(uuid::Uuid::new_v4().simple().to_string())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Type<Any> for $name {
            fn type_info() -> AnyTypeInfo {
                <String as Type<Any>>::type_info()
            }
        }

        impl<'q> Encode<'q, Any> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut <Any as Database>::ArgumentBuffer<'q>,
            ) -> Result<IsNull, BoxDynError> {
                <String as Encode<'q, Any>>::encode_by_ref(&self.0, buf)
            }
        }

        /// A stored id that is not well formed is an error, not a value.
        impl<'r> Decode<'r, Any> for $name {
            fn decode(value: <Any as Database>::ValueRef<'r>) -> Result<Self, BoxDynError> {
                let id = <String as Decode<'r, Any>>::decode(value)?;
                if well_formed(&id) {
                    Ok(Self(id))
                } else {
                    Err(format!("a stored {} is not well formed: {id:?}", stringify!($name)).into())
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_type!(
    /// A session's id.
    SessionId
);
id_type!(
    /// A message's id.
    MessageId
);
id_type!(
    /// A user's id.
    UserId
);
id_type!(
    /// An API key's id (not its secret).
    KeyId
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
