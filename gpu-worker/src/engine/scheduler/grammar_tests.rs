//! Constrained decoding in the step: grammars in a mixed batch, a grammar ending at the last
//! allowed token, and masks that come late holding back their own sequence, not the step.

use super::*;

/// Constrained sequences batched with a free one: every constrained reply is text the grammar
/// matches and ends with `Stop` once the grammar is complete; the free one is untouched.
#[test]
fn constrained_sequences_follow_their_grammar_in_a_mixed_batch() {
    let (mut s, grammars) = tiny_constrained();
    let grammar = hearth_shared::Grammar::Regex {
        pattern: "(yes|no)-[0-9]{2}".into(),
    };
    let mut streams = Vec::new();
    for (id, temperature) in [(1u64, 0.0f32), (2, 1.5), (3, 1.5)] {
        let mut r = GenerateRequest::new(id, prompt(20, id as u32), 30);
        r.params.temperature = temperature;
        r.params.seed = Some(id);
        streams.push(submit_constrained(&mut s, &grammars, r, &grammar));
    }
    let free = submit(&mut s, 4, prompt(20, 9), 30, None);
    drain(&mut s, |_| {});
    let names = crate::fixtures::tiny_vocab_text(VOCAB as usize);
    let text = |ids: &[u32]| {
        let mut bytes = Vec::new();
        for &t in ids {
            let n = &names[t as usize];
            match n.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                Some(h) => bytes.push(u8::from_str_radix(h, 16).unwrap()),
                None => bytes.extend_from_slice(n.as_bytes()),
            }
        }
        String::from_utf8(bytes).unwrap()
    };
    for mut rx in streams {
        let (mut ids, mut end) = (Vec::new(), None);
        while let Ok(e) = rx.try_recv() {
            match e {
                EngineEvent::Token { id, .. } => ids.push(id),
                EngineEvent::Finished { reason, .. } => end = Some(reason),
                other @ EngineEvent::Error(_) => panic!("{other:?}"),
                EngineEvent::Started { .. } => {}
            }
        }
        let t = text(&ids);
        let (word, digits) = t.split_once('-').unwrap_or_else(|| panic!("{t:?}"));
        assert!(word == "yes" || word == "no", "{t:?}");
        assert!(
            digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{t:?}"
        );
        assert_eq!(end, Some(FinishReason::Stop), "{t:?}");
    }
    let mut free = free;
    let mut n = 0;
    while let Ok(e) = free.try_recv() {
        n += usize::from(matches!(e, EngineEvent::Token { .. }));
    }
    assert_eq!(n, 30, "the free sequence generates its 30 tokens");
}

/// A reply whose last allowed token completes its grammar is whole: `Stop`, not `Length`.
#[test]
fn a_grammar_completed_by_the_last_allowed_token_ends_with_stop() {
    let (mut s, grammars) = tiny_constrained();
    let abc = hearth_shared::Grammar::Regex {
        pattern: "abc".into(),
    };
    let mut ends = Vec::new();
    for (id, max_new) in [(1u64, 3u32), (2, 2)] {
        let r = GenerateRequest::new(id, prompt(12, id as u32), max_new);
        ends.push(submit_constrained(&mut s, &grammars, r, &abc));
    }
    drain(&mut s, |_| {});
    let mut got = Vec::new();
    for mut rx in ends {
        let mut end = None;
        while let Ok(e) = rx.try_recv() {
            if let EngineEvent::Finished {
                reason,
                completion_tokens,
                ..
            } = e
            {
                end = Some((reason, completion_tokens));
            }
        }
        got.push(end);
    }
    // "abc" takes three tokens of the tiny vocabulary (one per character).
    assert_eq!(
        got[0],
        Some((FinishReason::Stop, 3)),
        "completed at its limit"
    );
    assert_eq!(
        got[1],
        Some((FinishReason::Length, 2)),
        "cut before the end"
    );
}

/// Tokens received on `rx` since last asked, and how it finished if it did.
fn tokens_now(rx: &mut Events) -> (Vec<u32>, Option<FinishReason>) {
    let (mut n, mut end) = (Vec::new(), None);
    while let Ok(e) = rx.try_recv() {
        match e {
            EngineEvent::Token { id, .. } => n.push(id),
            EngineEvent::Finished { reason, .. } => end = Some(reason),
            other @ EngineEvent::Error(_) => panic!("{other:?}"),
            EngineEvent::Started { .. } => {}
        }
    }
    (n, end)
}

/// Occupies both mask threads (the tests' two) until the returned senders are dropped or sent
/// to (or 5 s pass).
fn busy_mask_threads(grammars: &Grammars) -> Vec<std::sync::mpsc::Sender<()>> {
    let (started_tx, started) = std::sync::mpsc::channel();
    let mut release = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let started_tx = started_tx.clone();
        release.push(tx);
        grammars.push_job(
            "someone else",
            Box::new(move || {
                started_tx.send(()).unwrap();
                let _ = rx.recv_timeout(std::time::Duration::from_secs(5));
            }),
        );
    }
    started.recv().unwrap();
    started.recv().unwrap();
    release
}

/// A scheduler decoding sequence 1, constrained to `grammar` with its next mask ready, beside
/// sequence 2, free; their events, and the grammar engine.
fn constrained_beside_free(
    grammar: &hearth_shared::Grammar,
) -> (Scheduler, Grammars, Events, Events) {
    let (mut s, grammars) = tiny_constrained();
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let constrained = submit_constrained(&mut s, &grammars, r, grammar);
    let free = submit(&mut s, 2, prompt(20, 2), 30, None);
    s.step();
    while s.running.iter().any(|q| q.tokens.len() - q.kv_len > 1) {
        s.step();
    }
    while !mask_ready(&mut s) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    (s, grammars, constrained, free)
}

fn mask_ready(s: &mut Scheduler) -> bool {
    let q = s.running.iter_mut().find(|q| q.id.0 == 1).unwrap();
    q.constraint.as_mut().unwrap().mask_ready()
}

fn twelve_letters() -> hearth_shared::Grammar {
    hearth_shared::Grammar::Regex {
        pattern: "[a-z]{12}".into(),
    }
}

/// The reply sequence 1 of the late-mask tests gives under `grammar` on its own.
fn constrained_alone(grammar: &hearth_shared::Grammar) -> Vec<u32> {
    let (mut s, grammars) = tiny_constrained();
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let mut rx = submit_constrained(&mut s, &grammars, r, grammar);
    drain(&mut s, audit);
    outcome(&mut rx).1
}

/// A grammar's mask that does not come in time holds back its own sequence, not the step: with
/// the mask threads busy, the free sequence decodes on and the constrained one waits, then both
/// finish whole, the constrained reply the one it gives on its own.
#[test]
fn a_sequence_whose_mask_is_late_sits_the_step_out_and_others_decode_on() {
    let grammar = twelve_letters();
    let alone = constrained_alone(&grammar);
    let (mut s, grammars, mut constrained, mut free) = constrained_beside_free(&grammar);
    let release = busy_mask_threads(&grammars);
    let (mut c, mut f) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
    // Its ready mask is used; the next one is queued behind the busy threads.
    s.step().unwrap();
    let (c1, f1) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
    assert_eq!(c1.len(), 1);
    assert!(!mask_ready(&mut s));
    // Its grammar kept up so far: it runs, and its sampling gives up on the mask (its position
    // runs again later). Then its mask is later than a forward pass, and it sits out.
    s.last_forward = std::time::Duration::from_secs(3600);
    for round in 0..3 {
        let summary = s.step().unwrap();
        audit(&s);
        let (c2, f2) = (tokens_now(&mut constrained).0, tokens_now(&mut free).0);
        assert_eq!(summary.decode_seqs, 1, "step {round}: {summary:?}");
        assert!(c2.is_empty(), "step {round} waited for the late mask");
        assert_eq!(f2.len(), 1, "the free sequence decoded on");
        f.extend(f2);
    }
    drop(release);
    drain(&mut s, audit);
    let ((c3, c_end), (f3, f_end)) = (tokens_now(&mut constrained), tokens_now(&mut free));
    c.extend(c1.into_iter().chain(c3));
    f.extend(f1.into_iter().chain(f3));
    assert_eq!((f.len(), f_end), (30, Some(FinishReason::Length)));
    assert_eq!(
        c_end,
        Some(FinishReason::Stop),
        "the grammar ended it after {c:?}"
    );
    assert_eq!(c, alone, "the reply it gives on its own");
}

/// A prompt whose first mask does not come in time holds up no step either: its last prompt
/// position runs again once the mask is there, and its reply is the one it gives on its own.
#[test]
fn a_prompt_whose_first_mask_is_late_holds_up_no_step() {
    let grammar = twelve_letters();
    let alone = constrained_alone(&grammar);
    let (mut s, grammars) = tiny_constrained();
    let mut free = submit(&mut s, 2, prompt(20, 2), 30, None);
    s.step();
    assert_eq!(tokens_now(&mut free).0.len(), 1);
    let release = busy_mask_threads(&grammars);
    let r = GenerateRequest::new(1, prompt(20, 1), 30);
    let mut constrained = submit_constrained(&mut s, &grammars, r, &grammar);
    s.last_forward = std::time::Duration::from_secs(3600);
    for step in 0..3 {
        s.step().unwrap();
        audit(&s);
        assert!(tokens_now(&mut constrained).0.is_empty(), "step {step}");
        assert_eq!(
            tokens_now(&mut free).0.len(),
            1,
            "step {step}: the free one decodes on"
        );
    }
    drop(release);
    drain(&mut s, audit);
    let (c, c_end) = tokens_now(&mut constrained);
    assert_eq!(c_end, Some(FinishReason::Stop));
    assert_eq!(c, alone, "the reply it gives on its own");
}

/// A mask still on its way holds nothing back while its grammar keeps up with the forward pass
/// (the usual case: masks are computed during the forward pass); one later than a forward pass
/// makes its sequence sit out.
#[test]
fn only_a_grammar_slower_than_the_forward_pass_sits_out() {
    let grammar = twelve_letters();
    let (mut s, grammars, _constrained, _free) = constrained_beside_free(&grammar);
    let release = busy_mask_threads(&grammars);
    s.step().unwrap();
    assert!(!mask_ready(&mut s), "its next mask is on its way");
    s.last_forward = std::time::Duration::from_secs(3600);
    assert!(s.masks_pending().is_empty(), "a forward pass takes longer");
    s.last_forward = std::time::Duration::ZERO;
    let held = s.masks_pending();
    assert_eq!(held.into_iter().map(|id| id.0).collect::<Vec<_>>(), [1]);
    drop(release);
    while !mask_ready(&mut s) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(s.masks_pending().is_empty(), "a mask that is there is used");
}
