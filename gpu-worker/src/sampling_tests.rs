use super::*;

#[test]
fn a_masked_greedy_pick_is_the_first_maximum_among_allowed_tokens() {
    let n = 1000;
    let row: Vec<f32> = crate::fixtures::noise(n, 5, 3.0);
    let mut rng = Rng::seeded(9);
    for case in 0..50 {
        let mut mask = SimpleVob::alloc(n);
        for t in 0..n {
            if rng.next_u64().is_multiple_of(7) || case == 0 {
                mask.allow_token(t as u32);
            }
        }
        let mut masked = row.clone();
        apply_mask(&mask, &mut masked);
        let want = first_index_of(&masked, max_of(&masked));
        let mut s = Sampler::new(SamplingParams::default());
        let got = s.sample_masked(&mut row.clone(), &[], None, Some(&mask)).0;
        assert_eq!(got, want, "case {case}");
        assert!(mask.is_allowed(got));
    }
}

fn logits() -> Vec<f32> {
    (0..1000)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect()
}

#[test]
fn greedy_takes_the_argmax_with_its_logprob() {
    let mut s = Sampler::new(SamplingParams::greedy());
    let mut l = vec![0.0, 2.0, 1.0];
    let (t, lp) = s.sample(&mut l, &[], None);
    assert_eq!(t, 1);
    let want = 2.0 - (1f32 + 2f32.exp() + 1f32.exp()).ln();
    assert!((lp - want).abs() < 1e-5);
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let params = |seed| SamplingParams {
        temperature: 1.5,
        seed: Some(seed),
        ..Default::default()
    };
    let run = |seed| {
        let mut s = Sampler::new(params(seed));
        (0..50)
            .map(|_| s.sample(&mut logits(), &[], None).0)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    // A continuation that skips the first 20 draws picks what the uncut run picked next.
    let mut cont = Sampler::continuing(params(42), 20);
    let rest: Vec<u32> = (0..30)
        .map(|_| cont.sample(&mut logits(), &[], None).0)
        .collect();
    assert_eq!(rest, run(42)[20..]);
}

#[test]
fn top_k_one_is_greedy_and_top_k_limits_choices() {
    let l = logits();
    let best = first_index_of(&l, max_of(&l));
    let mut s = Sampler::new(SamplingParams {
        temperature: 5.0,
        top_k: 1,
        seed: Some(1),
        ..Default::default()
    });
    assert_eq!(s.sample(&mut l.clone(), &[], None).0, best);
    let mut sorted = l.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let threshold = sorted[4];
    let mut s = Sampler::new(SamplingParams {
        temperature: 5.0,
        top_k: 5,
        seed: Some(2),
        ..Default::default()
    });
    for _ in 0..200 {
        let (t, _) = s.sample(&mut l.clone(), &[], None);
        assert!(l[t as usize] >= threshold);
    }
}

#[test]
fn top_p_and_min_p_cut_the_tail() {
    // One dominant token holds > 90% of the mass.
    let mut l = vec![0.0f32; 100];
    l[7] = 10.0;
    for params in [
        SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(3),
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            min_p: 0.01,
            seed: Some(3),
            ..Default::default()
        },
    ] {
        let mut s = Sampler::new(params);
        for _ in 0..200 {
            assert_eq!(s.sample(&mut l.clone(), &[], None).0, 7);
        }
    }
}

#[test]
fn a_summary_made_piece_by_piece_is_the_rows_maximum_first_argmax_and_log_sum_exp() {
    // Three pieces and a short fourth; the maximum appears first in the third piece, again
    // later in it and in the last, and the pieces arrive out of order and mixed with another
    // row's.
    let vocab = 3 * PIECE + 100;
    let row = |shift: f32| -> Vec<f32> {
        (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - shift)
            .collect()
    };
    let (mut a, b) = (row(0.0), row(3.0));
    for at in [2 * PIECE + 17, 2 * PIECE + 900, 3 * PIECE + 5] {
        a[at] = 12.5;
    }
    let logits: Vec<f32> = a.iter().chain(&b).copied().collect();
    let mut pieces: Vec<(usize, Piece)> = [(1, &b), (0, &a)]
        .iter()
        .flat_map(|&(r, xs)| Piece::all_of(0, xs).map(move |p| (r, p)))
        .collect();
    pieces.reverse();
    let got = LogitSummary::of_pieces(pieces, &logits, vocab);
    for (s, xs) in got.iter().zip([&a, &b]) {
        assert_eq!(*s, LogitSummary::of(xs));
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(xs[s.argmax as usize], max);
        assert_eq!(
            s.argmax as usize,
            xs.iter().position(|&v| v == max).unwrap()
        );
        let lse = max as f64
            + xs.iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln();
        assert!((s.lse as f64 - lse).abs() < 1e-5, "{} vs {lse}", s.lse);
    }
    assert_eq!(got[0].argmax as usize, 2 * PIECE + 17);
    // Sampling with the summary picks and scores as it does without one; greedy needs only
    // the summary (its row may stay on the device: here, an empty one).
    let mut with = Sampler::new(SamplingParams::greedy());
    let mut without = Sampler::new(SamplingParams::greedy());
    assert!(!with.needs_row());
    let want = without.sample(&mut a.clone(), &[], None);
    assert_eq!(with.sample(&mut a.clone(), &[], Some(got[0])), want);
    assert_eq!(with.sample(&mut [], &[], Some(got[0])), want);
    let penalized = Sampler::new(SamplingParams {
        repetition_penalty: 1.1,
        ..SamplingParams::greedy()
    });
    assert!(penalized.needs_row());
}

#[test]
fn repetition_penalty_steers_greedy_away_from_seen_tokens() {
    let mut s = Sampler::new(SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    });
    let mut l = vec![1.0, 3.0, 2.0];
    let (t, lp) = s.sample(&mut l, &[1], None);
    assert_eq!(t, 2);
    // The logprob is the model's, before the penalty.
    let want = 2.0 - (1f32.exp() + 3f32.exp() + 2f32.exp()).ln();
    assert!((lp - want).abs() < 1e-5);
}

#[test]
fn presence_and_frequency_penalties_count_the_reply_only() {
    let params = SamplingParams {
        presence_penalty: 1.0,
        frequency_penalty: 0.5,
        ..Default::default()
    };
    // Token 1 twice in the reply, token 2 only in the prompt.
    let s = Sampler::new(params).for_sequence(2, Vec::new());
    let mut l = vec![0.0, 3.0, 3.0, 0.0];
    s.adjust(&mut l, &[2, 2, 1, 1]);
    assert_eq!(l, vec![0.0, 1.0, 3.0, 0.0]);
}

#[test]
fn logit_bias_bans_and_forces_tokens_and_reports_the_models_logprob() {
    let mut s = Sampler::new(SamplingParams {
        logit_bias: [(1, -100.0), (0, 5.0)].into(),
        ..Default::default()
    });
    assert!(s.needs_row());
    let mut l = vec![1.0, 3.0, 2.0];
    let (t, lp) = s.sample(&mut l, &[], None);
    assert_eq!(t, 0);
    let want = 1.0 - (1f32.exp() + 3f32.exp() + 2f32.exp()).ln();
    assert!((lp - want).abs() < 1e-5);
}

#[test]
fn dry_finds_the_longest_run_each_token_would_continue() {
    // "a b c x a b c ?": continuing with x repeats "a b c x" (run of 3 before it).
    let ctx = [1, 2, 3, 9, 1, 2, 3];
    assert_eq!(dry_runs(&ctx, &[], 2), vec![(9, 3)]);
    assert!(dry_runs(&ctx, &[], 4).is_empty(), "3 is below 4");
    // Two earlier continuations: the longer run counts for each token.
    let mut runs = dry_runs(&[5, 1, 2, 7, 3, 1, 2, 8, 1, 2], &[], 2);
    runs.sort_unstable();
    assert_eq!(runs, vec![(7, 2), (8, 2)]);
    // A breaker inside the ending run caps it: nothing reaches back past the 3.
    assert!(dry_runs(&ctx, &[3], 1).is_empty());
    assert_eq!(dry_runs(&[1, 2, 4, 1, 2], &[4], 2), vec![(4, 2)]);
    // A repeated token: the run is as long as the repeat allows.
    assert_eq!(dry_runs(&[6, 6, 6, 6], &[], 2), vec![(6, 3)]);
}

#[test]
fn dry_steers_greedy_off_a_loop_that_the_model_would_repeat() {
    let params = SamplingParams {
        dry_multiplier: 0.8,
        dry_base: 2.0,
        dry_allowed_length: 2,
        ..Default::default()
    };
    let mut s = Sampler::new(params).for_sequence(0, Vec::new());
    // The model prefers 9, which would repeat "1 2 3 9" for the third time.
    let history = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3];
    let mut l = vec![0.0; 10];
    l[9] = 2.0;
    l[4] = 1.0;
    let (t, _) = s.sample(&mut l, &history, None);
    // The run before 9 is 7 tokens: 0.8 * 2^5 = 25.6 off its logit.
    assert_eq!(t, 4);
    assert!((l[9] - (2.0 - 25.6)).abs() < 1e-4, "{}", l[9]);
    // Limited to the last 3 tokens, the loop is out of sight, and 9 stays first.
    let mut s = Sampler::new(SamplingParams {
        dry_penalty_last_n: 3,
        ..s.params.clone()
    });
    let mut l = vec![0.0; 10];
    l[9] = 2.0;
    l[4] = 1.0;
    assert_eq!(s.sample(&mut l, &history, None).0, 9);
}

#[test]
fn top_logprobs_are_the_likeliest_tokens_of_the_models_own_distribution() {
    let s = Sampler::new(SamplingParams {
        logit_bias: [(0, 50.0)].into(),
        ..Default::default()
    })
    .with_top_logprobs(2);
    assert!(s.needs_row());
    let l = vec![1.0, 3.0, 2.0, -1.0];
    let top = s.top_logprobs(&l, None);
    let lse = l.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!((top[0].1 - (3.0 - lse)).abs() < 1e-5 && (top[1].1 - (2.0 - lse)).abs() < 1e-5);
    assert!(Sampler::new(SamplingParams::default())
        .top_logprobs(&l, None)
        .is_empty());
}
