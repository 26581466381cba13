//! Stop strings: end generation when the text contains one, without ever showing any part of it.
//!
//! A stop string can span tokens, so text that might be the start of one is held back until the
//! next piece shows whether it is.

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
    /// The stop string found, once one is.
    matched: Option<String>,
}

/// The result of feeding text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fed {
    /// Text that is safe to show.
    pub text: String,
    /// A stop string was found; `text` ends where it began and nothing more will be emitted.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty strings are ignored (they would match at once).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// Whether a stop string has been found.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The stop string found (the first in the text; of two that begin there, the first
    /// given), once one is.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    pub fn push(&mut self, text: &str) -> Fed {
        if self.done {
            return Fed {
                text: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| Some((self.held.find(s.as_str())?, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            self.done = true;
            self.matched = Some(stop.clone());
            let text = self.held[..at].to_string();
            self.held.clear();
            return Fed {
                text,
                stopped: true,
            };
        }
        // Keep the longest tail that is the beginning of some stop string.
        let keep = (1..=self.held.len())
            .rev()
            .filter(|&k| self.held.is_char_boundary(self.held.len() - k))
            .find(|&k| {
                let tail = &self.held[self.held.len() - k..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0);
        let emit = self.held.len() - keep;
        let text = self.held[..emit].to_string();
        self.held.drain(..emit);
        Fed {
            text,
            stopped: false,
        }
    }

    /// At the end of generation: what was held back, since no stop string completed.
    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for p in pieces {
            let f = m.push(p);
            out.push_str(&f.text);
            if f.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_spanning_pieces_are_found_and_never_shown() {
        assert_eq!(
            run(&["\nUser:"], &["Hi", " there\nUs", "er: more"]),
            ("Hi there".into(), true)
        );
        assert_eq!(
            run(&["END"], &["abcE", "N", "D tail"]),
            ("abc".into(), true)
        );
        // The earliest of several stop strings wins.
        assert_eq!(run(&["yz", "c"], &["abcxyz"]), ("ab".into(), true));
        // A false start is released once it cannot be a stop string.
        assert_eq!(run(&["END"], &["EN", "x"]), ("ENx".into(), false));
        // Held text is released at the end.
        assert_eq!(run(&["END"], &["done E"]), ("done E".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a"]), ("a".into(), false));
    }

    #[test]
    fn the_stop_string_found_is_told() {
        let mut m = StopMatcher::new(["yz", "c", "cx"].map(String::from));
        assert_eq!(m.push("ab").text, "ab");
        assert_eq!(m.matched(), None);
        assert!(m.push("cxyz").stopped);
        // The earliest in the text; of two that begin there, the first given.
        assert_eq!(m.matched(), Some("c"));
        let mut m = StopMatcher::new(["END".to_string()]);
        m.push("no stop here");
        m.flush();
        assert_eq!(m.matched(), None);
    }

    #[test]
    fn multibyte_text_is_split_only_on_character_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "é", "!x"]),
            ("café".into(), true)
        );
        assert_eq!(run(&["🙂🙃"], &["a🙂", "b"]), ("a🙂b".into(), false));
    }
}
