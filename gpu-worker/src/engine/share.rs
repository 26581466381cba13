//! Who holds how much of the K/V pool, and each user's equal share of it.
//!
//! A user holds the blocks of its running sequences and of its idle session caches. Memory is
//! only contested when a request finds too little free: then a user within its equal share may
//! take any idle cache, but a user over it (one huge prompt, or many at once) takes only its own
//! and those of users over theirs. So another tenant's long prompts never cost a user with a
//! modest session its cache, which would make each of its turns recompute the whole history.

use std::collections::HashMap;

use hearth_shared::UserId;

/// Blocks held per user, and the pool's equal share among them.
#[derive(Debug)]
pub(crate) struct Shares<'a> {
    held: HashMap<&'a UserId, usize>,
    equal: usize,
}

impl<'a> Shares<'a> {
    /// The shares of a pool of `total` blocks among the users of `holdings` (each a user and
    /// the blocks of one table of it) and `asking`, who may hold nothing yet.
    pub(crate) fn new(
        total: usize,
        holdings: impl IntoIterator<Item = (&'a UserId, usize)>,
        asking: Option<&'a UserId>,
    ) -> Self {
        let mut held: HashMap<&UserId, usize> = HashMap::new();
        for (user, blocks) in holdings {
            *held.entry(user).or_default() += blocks;
        }
        held.retain(|_, blocks| *blocks > 0);
        let asker_new = asking.is_some_and(|u| !held.contains_key(u));
        let users = held.len() + usize::from(asker_new);
        Self {
            equal: total / users.max(1),
            held,
        }
    }

    /// Whether `user`, holding `extra` more blocks, would hold more than an equal share.
    pub(crate) fn over(&self, user: &UserId, extra: usize) -> bool {
        self.held.get(user).copied().unwrap_or(0) + extra > self.equal
    }

    /// The users holding more than an equal share, the most first.
    pub(crate) fn over_share(&self) -> Vec<&'a UserId> {
        let mut over: Vec<(&UserId, usize)> = self
            .held
            .iter()
            .filter(|(_, &blocks)| blocks > self.equal)
            .map(|(&u, &blocks)| (u, blocks))
            .collect();
        over.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        over.into_iter().map(|(u, _)| u).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_equal_share_counts_every_holder_and_the_asker() {
        let (a, b, c) = (UserId::from("a"), UserId::from("b"), UserId::from("c"));
        let s = Shares::new(90, [(&a, 40), (&a, 20), (&b, 10)], Some(&c));
        // Three users: 30 blocks each.
        assert!(s.over(&a, 0), "60 blocks");
        assert!(!s.over(&b, 20), "30 blocks");
        assert!(s.over(&b, 21));
        assert!(!s.over(&c, 30));
        assert!(s.over(&c, 31));
        // A user holding nothing is not counted; without an asker two users share it.
        let s = Shares::new(90, [(&a, 50), (&b, 0)], None);
        assert!(!s.over(&a, 40), "alone, a holds up to the whole pool");
        let s = Shares::new(90, [(&a, 50), (&b, 1)], None);
        assert!(s.over(&a, 0), "50 of 90 is over half");
        let s = Shares::new(90, [(&a, 31), (&b, 40), (&c, 19)], None);
        assert_eq!(s.over_share(), [&b, &a], "the most first");
    }
}
