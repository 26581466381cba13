//! Model versions, ordered the same way by the worker (which version `name` loads) and the
//! orchestrator (which version `name` routes to).

use std::cmp::Ordering;

/// Orders versions: part by part (split at `.`, `-` and `_`), numbers as numbers, numbers before
/// text, text as text.
pub fn compare_versions(a: &str, b: &str) -> Ordering {
    let parts = |s: &str| -> Vec<String> {
        s.split(['.', '-', '_'])
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (pa, pb) = (parts(a), parts(b));
    for (x, y) in pa.iter().zip(&pb) {
        let o = match (x.parse::<u64>(), y.parse::<u64>()) {
            (Ok(m), Ok(n)) => m.cmp(&n),
            (Ok(_), Err(_)) => Ordering::Less,
            (Err(_), Ok(_)) => Ordering::Greater,
            (Err(_), Err(_)) => x.cmp(y),
        };
        if o != Ordering::Equal {
            return o;
        }
    }
    pa.len().cmp(&pb.len()).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_part_by_part_numbers_as_numbers() {
        let mut v = vec![
            "10", "9", "1.10", "1.9", "2", "b", "a", "1", "2024-06", "2024-05",
        ];
        v.sort_by(|a, b| compare_versions(a, b));
        assert_eq!(
            v,
            ["1", "1.9", "1.10", "2", "9", "10", "2024-05", "2024-06", "a", "b"]
        );
    }
}
