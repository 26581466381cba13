//! Ids of sessions and messages: 32 lowercase hex characters (a UUID's simple form, as the
//! store makes them). Only [`SessionId::parse`] and [`MessageId::parse`] make one, so a value of
//! these types is well formed wherever it goes; anything else names nothing.

fn well_formed(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
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
