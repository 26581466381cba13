//! Drafts for speculative decoding by prompt lookup: chat replies often repeat runs of their
//! prompt or of themselves (code being edited, names, quoted text, lists). When the last few
//! tokens of a sequence occurred before, the tokens that followed them then are a likely
//! continuation now. The engine feeds such a draft through the model in one step beside the
//! sequence's last token and keeps the drafted tokens that the model itself would have chosen,
//! so a verified draft costs one pass over the weights for several tokens.

/// Longest and shortest suffix looked up: longer matches are tried first (they predict better);
/// a single token matches too often to be worth a draft.
const MAX_NGRAM: usize = 4;
const MIN_NGRAM: usize = 2;

/// Up to `max` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `tokens` (of [`MAX_NGRAM`] down to [`MIN_NGRAM`] tokens) that occurred before; empty when none
/// did.
pub fn draft(tokens: &[u32], max: usize) -> &[u32] {
    let len = tokens.len();
    if max == 0 {
        return &[];
    }
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent first; the suffix itself (starting at len - n) is not a match.
        let found = (0..len - n).rev().find(|&at| &tokens[at..at + n] == suffix);
        if let Some(at) = found {
            let from = at + n;
            let to = (from + max).min(len);
            if from < to {
                return &tokens[from..to];
            }
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokens_after_the_latest_earlier_occurrence_of_the_longest_suffix_are_the_draft() {
        // "… 1 2 3 9 …  1 2 3 7 8 …  1 2 3": the latest earlier "1 2 3" is followed by 7 8.
        let t = [5, 1, 2, 3, 9, 6, 1, 2, 3, 7, 8, 4, 1, 2, 3];
        assert_eq!(draft(&t, 2), [7, 8]);
        assert_eq!(draft(&t, 10), [7, 8, 4, 1, 2, 3]);
        // A longer match wins over a more recent shorter one: "4 1 2 3" occurred once, at 11.
        let t = [4, 1, 2, 3, 50, 51, 2, 3, 60, 4, 1, 2, 3];
        assert_eq!(draft(&t, 2), [50, 51]);
    }

    #[test]
    fn no_draft_without_a_repeated_run_of_two_tokens() {
        assert!(draft(&[], 4).is_empty());
        assert!(draft(&[1], 4).is_empty());
        assert!(draft(&[1, 2, 3, 4], 4).is_empty());
        // Only the last token repeats: too weak a cue.
        assert!(draft(&[7, 1, 2, 3, 7], 4).is_empty());
        assert!(draft(&[1, 2, 1, 2], 0).is_empty());
        // The repeated run is the sequence's end: nothing followed it yet.
        assert_eq!(draft(&[1, 2, 1, 2], 4), [1, 2]);
        assert_eq!(draft(&[9, 9, 9], 4), [9]);
    }
}
