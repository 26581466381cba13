//! What discovery knows, as plain synchronous state: the addresses each name last resolved to,
//! how an answer changes them, and which workers the pool must gain or lose to match. The
//! task in [`super`] feeds it answers and applies its changes; the tests here drive it alone.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, SocketAddr};

use super::DnsWorkers;

/// What one record type (A or AAAA) of a name answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Records {
    /// These addresses (never none).
    Found(BTreeSet<IpAddr>),
    /// A definite "none": the name has no such record, or does not exist (NXDOMAIN).
    Empty,
    /// No answer (a timeout, SERVFAIL, a refused query): says nothing about the workers.
    Failed(String),
}

/// One look-up of a name: its A and its AAAA records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Answer {
    pub(super) v4: Records,
    pub(super) v6: Records,
}

/// What an answer did that the operator should hear of (the caller logs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Note {
    /// Neither record type was answered: the workers last found stay.
    Failed(String),
    /// One record type was not answered: its addresses last found stay, the other's are new.
    PartlyFailed(String),
    /// An empty answer the first time: the workers last found stay until the next look-up
    /// agrees (a name briefly without addresses, e.g. while every pod restarts, keeps them).
    EmptyOnce,
    /// The second empty answer in a row: the name's workers are gone.
    Emptied,
}

/// One `dns:` entry and the addresses it last resolved to.
#[derive(Debug)]
struct Name {
    dns: DnsWorkers,
    known: BTreeSet<IpAddr>,
    /// Empty answers in a row (failed look-ups between them neither count nor break the run).
    empties: u32,
}

/// Workers the pool must gain (`added`) and lose (`removed`), each as (address, DNS name).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Changes {
    pub(super) added: Vec<(String, String)>,
    pub(super) removed: Vec<(String, String)>,
}

/// Every name's known addresses, and the discovered workers the pool has.
#[derive(Debug)]
pub(super) struct Discovered {
    names: Vec<Name>,
    /// The `--worker host:port` addresses: a name that lists one leaves it to its own slot.
    fixed: HashSet<String>,
    /// The discovered workers in the pool now, each with the name that brought it.
    current: BTreeMap<String, String>,
}

impl Discovered {
    pub(super) fn new(names: &[DnsWorkers], fixed: &[String]) -> Self {
        Self {
            names: names
                .iter()
                .map(|dns| Name {
                    dns: dns.clone(),
                    known: BTreeSet::new(),
                    empties: 0,
                })
                .collect(),
            fixed: fixed.iter().cloned().collect(),
            current: BTreeMap::new(),
        }
    }

    /// Takes the `i`th name's answer; a note to log, if any.
    pub(super) fn answer(&mut self, i: usize, answer: Answer) -> Option<Note> {
        let name = &mut self.names[i];
        let (v4, v6) = (&answer.v4, &answer.v6);
        match (v4, v6) {
            (Records::Failed(a), Records::Failed(b)) => Some(Note::Failed(format!("{a}; {b}"))),
            (Records::Failed(e), Records::Empty) | (Records::Empty, Records::Failed(e)) => {
                // Half a "none" is no "none": keep everything.
                Some(Note::Failed(e.clone()))
            }
            (Records::Empty, Records::Empty) => {
                name.empties += 1;
                if name.empties < 2 {
                    return Some(Note::EmptyOnce);
                }
                let had = !name.known.is_empty();
                name.known.clear();
                had.then_some(Note::Emptied)
            }
            _ => {
                name.empties = 0;
                let mut known = family(&name.known, v4, IpAddr::is_ipv4);
                known.extend(family(&name.known, v6, IpAddr::is_ipv6));
                name.known = known;
                match (v4, v6) {
                    (Records::Failed(e), _) | (_, Records::Failed(e)) => {
                        Some(Note::PartlyFailed(e.clone()))
                    }
                    _ => None,
                }
            }
        }
    }

    /// The workers to add and remove so that the pool holds what the names resolve to now;
    /// from the call on, they count as done.
    pub(super) fn changes(&mut self) -> Changes {
        let mut wanted: BTreeMap<String, String> = BTreeMap::new();
        for n in &self.names {
            for ip in &n.known {
                let addr = SocketAddr::new(*ip, n.dns.port).to_string();
                if !self.fixed.contains(&addr) {
                    wanted.entry(addr).or_insert_with(|| n.dns.name.clone());
                }
            }
        }
        let removed = self
            .current
            .iter()
            .filter(|(addr, _)| !wanted.contains_key(*addr))
            .map(|(a, n)| (a.clone(), n.clone()))
            .collect();
        let added = wanted
            .iter()
            .filter(|(addr, _)| !self.current.contains_key(*addr))
            .map(|(a, n)| (a.clone(), n.clone()))
            .collect();
        self.current = wanted;
        Changes { added, removed }
    }
}

/// One address family's addresses after an answer: the new ones, none, or (when its look-up
/// failed) those of `known` in the family.
fn family(known: &BTreeSet<IpAddr>, r: &Records, is: fn(&IpAddr) -> bool) -> BTreeSet<IpAddr> {
    match r {
        Records::Found(ips) => ips.clone(),
        Records::Empty => BTreeSet::new(),
        Records::Failed(_) => known.iter().copied().filter(is).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns(name: &str, port: u16) -> DnsWorkers {
        DnsWorkers {
            name: name.to_string(),
            port,
        }
    }

    fn found(ips: &[&str]) -> Records {
        Records::Found(ips.iter().map(|i| i.parse().expect("an IP")).collect())
    }

    fn failed() -> Records {
        Records::Failed("request timed out".to_string())
    }

    fn answer(v4: Records, v6: Records) -> Answer {
        Answer { v4, v6 }
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, n)| (a.to_string(), n.to_string()))
            .collect()
    }

    #[test]
    fn workers_that_appear_are_added_and_those_that_vanish_removed() {
        let mut d = Discovered::new(&[dns("w.test", 50051)], &[]);
        let both = answer(found(&["10.0.0.1", "10.0.0.2"]), found(&["fd00::1"]));
        assert_eq!(d.answer(0, both), None);
        let c = d.changes();
        assert_eq!(
            c.added,
            pairs(&[
                ("10.0.0.1:50051", "w.test"),
                ("10.0.0.2:50051", "w.test"),
                ("[fd00::1]:50051", "w.test"),
            ])
        );
        assert!(c.removed.is_empty());
        // Nothing new: nothing to do.
        let same = answer(found(&["10.0.0.2", "10.0.0.1"]), found(&["fd00::1"]));
        d.answer(0, same);
        assert_eq!(d.changes(), Changes::default());
        // One replaced by another, the IPv6 one gone.
        d.answer(0, answer(found(&["10.0.0.2", "10.0.0.3"]), Records::Empty));
        let c = d.changes();
        assert_eq!(c.added, pairs(&[("10.0.0.3:50051", "w.test")]));
        assert_eq!(
            c.removed,
            pairs(&[("10.0.0.1:50051", "w.test"), ("[fd00::1]:50051", "w.test")])
        );
    }

    #[test]
    fn a_failed_look_up_keeps_the_workers_last_found() {
        let mut d = Discovered::new(&[dns("w.test", 7)], &[]);
        d.answer(0, answer(found(&["10.0.0.1"]), found(&["fd00::1"])));
        assert_eq!(d.changes().added.len(), 2);
        let note = d.answer(0, answer(failed(), failed()));
        assert!(matches!(note, Some(Note::Failed(_))), "{note:?}");
        assert_eq!(d.changes(), Changes::default());
        // A failure beside an empty answer is no "none" either.
        let note = d.answer(0, answer(Records::Empty, failed()));
        assert!(matches!(note, Some(Note::Failed(_))), "{note:?}");
        assert_eq!(d.changes(), Changes::default());
        // AAAA unanswered: its address stays, A's are new.
        let note = d.answer(0, answer(found(&["10.0.0.9"]), failed()));
        assert!(matches!(note, Some(Note::PartlyFailed(_))), "{note:?}");
        let c = d.changes();
        assert_eq!(c.added, pairs(&[("10.0.0.9:7", "w.test")]));
        assert_eq!(c.removed, pairs(&[("10.0.0.1:7", "w.test")]));
    }

    #[test]
    fn only_a_second_empty_answer_in_a_row_removes_a_name_s_workers() {
        let mut d = Discovered::new(&[dns("w.test", 7)], &[]);
        d.answer(0, answer(found(&["10.0.0.1"]), Records::Empty));
        d.changes();
        let empty = || answer(Records::Empty, Records::Empty);
        assert_eq!(d.answer(0, empty()), Some(Note::EmptyOnce));
        assert_eq!(d.changes(), Changes::default());
        // An answer with addresses between two empty ones starts the count again…
        d.answer(0, answer(found(&["10.0.0.1"]), Records::Empty));
        assert_eq!(d.answer(0, empty()), Some(Note::EmptyOnce));
        // …and a failure between them neither counts nor breaks the run.
        d.answer(0, answer(failed(), failed()));
        assert_eq!(d.changes(), Changes::default());
        assert_eq!(d.answer(0, empty()), Some(Note::Emptied));
        assert_eq!(d.changes().removed, pairs(&[("10.0.0.1:7", "w.test")]));
        // Still empty: nothing more to say.
        assert_eq!(d.answer(0, empty()), None);
    }

    #[test]
    fn an_address_listed_twice_or_also_given_fixed_gets_one_slot() {
        let names = [dns("a.test", 7), dns("b.test", 7)];
        let mut d = Discovered::new(&names, &["10.0.0.5:7".to_string()]);
        d.answer(0, answer(found(&["10.0.0.1", "10.0.0.5"]), Records::Empty));
        d.answer(1, answer(found(&["10.0.0.1", "10.0.0.2"]), Records::Empty));
        let c = d.changes();
        assert_eq!(
            c.added,
            pairs(&[("10.0.0.1:7", "a.test"), ("10.0.0.2:7", "b.test")])
        );
        // The first name drops it; the second still lists it, so it stays.
        d.answer(0, answer(found(&["10.0.0.5"]), Records::Empty));
        assert_eq!(d.changes(), Changes::default());
        d.answer(1, answer(found(&["10.0.0.2"]), Records::Empty));
        assert_eq!(d.changes().removed, pairs(&[("10.0.0.1:7", "b.test")]));
    }
}
