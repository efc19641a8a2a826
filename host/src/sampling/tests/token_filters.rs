//! `allowed_token_ids`, `bad_words` and `logit_bias` through the sampler:
//! rows worked out by hand, and properties checked against formulas written
//! here (the allowed set's best biased logit, a window scan for banned
//! sequences), not against the code under test.

use proptest::prelude::*;

use crate::sampling::{RequestSampler, SamplingParams};

const NEG: f32 = f32::NEG_INFINITY;

fn greedy(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    f(&mut p);
    p
}

#[test]
fn a_row_after_mask_bans_and_bias_is_the_hand_computed_one() {
    let raw = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let params = greedy(|p| {
        p.allowed_token_ids = Some(vec![1, 3, 4, 5, 3]);
        p.bad_words_token_ids = vec![vec![4]];
        p.logit_bias = vec![(1, 10.0), (5, -2.5), (0, 7.0)];
        p.logprobs = Some(1);
    });
    let mut s = RequestSampler::new(&params, &[], None);
    let mut row = raw.to_vec();
    let prepared = s.prepare(&mut row, &params);
    // 0: not allowed (a bias does not lift a masked token), 1: 2 + 10,
    // 2: not allowed, 3: kept, 4: a one-token bad word, 5: 6 - 2.5.
    assert_eq!(row, vec![NEG, 12.0, NEG, 4.0, NEG, 3.5]);
    let token = s.choose(&row, &params, None);
    assert_eq!(token, 1);
    let out = s.finish(&row, token, prepared);
    // The logprobs are the raw model output's: ln softmax(raw)[1], and the
    // top alternative is the raw argmax, 5, whatever the filters did.
    let lse = raw.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
    assert!(
        (f64::from(out.logprob) - (2.0 - lse)).abs() < 1e-5,
        "{out:?}"
    );
    assert_eq!(out.top_logprobs[0].0, 5);
    assert!((f64::from(out.top_logprobs[0].1) - (6.0 - lse)).abs() < 1e-5);
}

#[test]
fn a_longer_bad_word_bans_its_last_token_only_where_it_would_complete() {
    // Token 3 is always the argmax, token 2 the runner-up.
    let raw = [0.0f32, 1.0, 2.0, 3.0];
    let params = greedy(|p| p.bad_words_token_ids = vec![vec![1, 2, 3]]);
    let mut s = RequestSampler::new(&params, &[1, 2], None);
    let next = |s: &mut RequestSampler| s.sample(&mut raw.to_vec(), &params).token;
    // The prompt ends with 1 2, but bad words look at the output only.
    assert_eq!(next(&mut s), 3);
    s.accept(1);
    assert_eq!(next(&mut s), 3, "only 1 of the prefix 1 2 was generated");
    s.accept(1);
    s.accept(2);
    assert_eq!(next(&mut s), 2, "the output ends with 1 2: 3 is banned");
    // `next` recorded that 2; the output now ends 2 2.
    assert_eq!(next(&mut s), 3);
}

#[test]
fn the_bias_can_make_greedy_pick_any_token_and_ban_the_argmax() {
    let raw = [0.5f32, 9.0, -3.0, 2.0];
    for (bias, want) in [
        (vec![(2, 100.0)], 2),
        (vec![(1, -100.0)], 3),
        (vec![(1, -7.0), (0, 1.0)], 1),
        (vec![(1, -8.0), (0, 1.0)], 3),
    ] {
        let params = greedy(|p| p.logit_bias = bias.clone());
        let mut s = RequestSampler::new(&params, &[], None);
        assert_eq!(s.sample(&mut raw.to_vec(), &params).token, want, "{bias:?}");
    }
}

#[test]
fn ids_outside_the_row_are_ignored_without_panicking() {
    let params = greedy(|p| {
        p.logit_bias = vec![(99, 50.0)];
        p.allowed_token_ids = Some(vec![2, 99]);
        p.bad_words_token_ids = vec![vec![99], vec![99, 1]];
    });
    let mut s = RequestSampler::new(&params, &[], None);
    assert_eq!(s.sample(&mut [5.0, 4.0, 3.0], &params).token, 2);
}

/// Whether `out` holds `word` as consecutive tokens.
fn contains_run(out: &[u32], word: &[u32]) -> bool {
    out.windows(word.len()).any(|w| w == word)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random draws stay in the allowed set; greedy picks the allowed token
    /// with the largest biased logit (ties: lowest id).
    #[test]
    fn draws_stay_allowed_and_greedy_takes_the_best_biased_allowed_token(
        raw in prop::collection::vec(-5.0f32..5.0, 16),
        allowed in prop::collection::vec(0u32..16, 1..6),
        bias in prop::collection::vec((0u32..16, -100.0f32..100.0), 0..4),
        seed in any::<u64>(),
    ) {
        let mut unique_bias = bias.clone();
        unique_bias.sort_by_key(|&(t, _)| t);
        unique_bias.dedup_by_key(|&mut (t, _)| t);
        let random = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            allowed_token_ids: Some(allowed.clone()),
            logit_bias: unique_bias.clone(),
            ..Default::default()
        };
        let mut s = RequestSampler::new(&random, &[], None);
        for _ in 0..8 {
            let t = s.sample(&mut raw.clone(), &random).token;
            prop_assert!(allowed.contains(&t), "{t} not in {allowed:?}");
        }
        let biased = |t: u32| {
            raw[t as usize] + unique_bias.iter().find(|b| b.0 == t).map_or(0.0, |b| b.1)
        };
        let mut best = allowed.clone();
        best.sort_unstable();
        let want = best
            .iter()
            .copied()
            .fold(None::<u32>, |acc, t| match acc {
                Some(a) if biased(a) >= biased(t) => Some(a),
                _ => Some(t),
            })
            .unwrap();
        let g = SamplingParams { temperature: 0.0, ..random };
        let mut s = RequestSampler::new(&g, &[], None);
        prop_assert_eq!(s.sample(&mut raw.clone(), &g).token, want);
    }

    /// However the row looks, a seeded generation never writes a bad word
    /// out in full (the vocabulary is larger than the number of words, so
    /// some token is always left).
    #[test]
    fn no_bad_word_is_ever_completed(
        raw in prop::collection::vec(-2.0f32..2.0, 6),
        words in prop::collection::vec(prop::collection::vec(0u32..6, 1..4), 1..4),
        seed in any::<u64>(),
    ) {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            bad_words_token_ids: words.clone(),
            ..Default::default()
        };
        let mut s = RequestSampler::new(&params, &[], None);
        let out: Vec<u32> = (0..40).map(|_| s.sample(&mut raw.clone(), &params).token).collect();
        for w in &words {
            prop_assert!(!contains_run(&out, w), "{w:?} in {out:?}");
        }
    }
}
