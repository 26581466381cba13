//! A value out of range or of the wrong kind, and the request field it is in: what every layer's
//! validation error carries, so that the API answers with OpenAI's `param` (the field, for
//! programs) beside a message that also names it (for people).

use std::fmt;

/// A bad value: the field it is in, when one is (`temperature`, `messages[2].content`,
/// `params.top_p`), and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub param: Option<String>,
    pub why: String,
}

impl Invalid {
    /// A bad value in field `param`.
    pub fn field(param: impl Into<String>, why: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            why: why.into(),
        }
    }

    /// A request that is wrong as a whole, not in one field.
    pub fn request(why: impl Into<String>) -> Self {
        Self {
            param: None,
            why: why.into(),
        }
    }

    /// The same problem, in the field `outer` holds this one in (`messages[2]` and `content`
    /// make `messages[2].content`).
    pub fn within(self, outer: &str) -> Self {
        let param = match self.param {
            Some(p) if p.starts_with('[') => format!("{outer}{p}"),
            Some(p) => format!("{outer}.{p}"),
            None => outer.to_string(),
        };
        Self {
            param: Some(param),
            why: self.why,
        }
    }
}

/// `param: why`, or `why` alone: the message names the field.
impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.param {
            Some(p) => write!(f, "{p}: {}", self.why),
            None => f.write_str(&self.why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_field_the_param_holds() {
        let e = Invalid::field("temperature", "must be between 0 and 2");
        assert_eq!(e.to_string(), "temperature: must be between 0 and 2");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let whole = Invalid::request("a command is a JSON object");
        assert_eq!(
            (whole.to_string().as_str(), whole.param),
            ("a command is a JSON object", None)
        );
        let inner = Invalid::field("content", "must not be empty").within("messages[2]");
        assert_eq!(inner.param.as_deref(), Some("messages[2].content"));
        let index = Invalid::field("[0]", "too long").within("stop");
        assert_eq!(index.param.as_deref(), Some("stop[0]"));
    }
}
