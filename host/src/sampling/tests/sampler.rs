//! The sampler against independent expectations: argmax, softmax frequencies
//! (chi-square with fixed seeds, so the tests are deterministic), the support
//! of top-k / top-p / min-p written out by hand, and scalar penalty formulas.

use crate::sampling::rng::Xoshiro256StarStar;
use crate::sampling::{sample_batch, RequestSampler, SampledToken, SamplingParams};

/// Reproducible pseudo-random logits in [-scale, scale).
fn random_logits(seed: u64, vocab: usize, scale: f32) -> Vec<f32> {
    let mut g = Xoshiro256StarStar::from_seed(seed);
    (0..vocab)
        .map(|_| (g.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// Logits whose softmax is exactly `probs`.
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

/// softmax(logits / t) in f64, the textbook formula.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let e: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / t).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// Draws `n` tokens with a seeded sampler from fresh copies of `logits`.
/// Penalties are off in these tests, so the recorded history does not matter.
fn histogram(logits: &[f32], params: &SamplingParams, n: usize) -> Vec<u64> {
    let mut s = RequestSampler::new(params, &[], None);
    let mut counts = vec![0u64; logits.len()];
    for _ in 0..n {
        let t = s.sample(&mut logits.to_vec(), params).token;
        counts[t as usize] += 1;
    }
    counts
}

/// Pearson's chi-square statistic; fails if a zero-probability bin was hit.
fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "token with probability 0 was sampled");
                0.0
            } else {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}

/// Renormalises `probs` over `keep`, zero elsewhere.
fn restrict(probs: &[f64], keep: &[usize]) -> Vec<f64> {
    let z: f64 = keep.iter().map(|&i| probs[i]).sum();
    (0..probs.len())
        .map(|i| if keep.contains(&i) { probs[i] / z } else { 0.0 })
        .collect()
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

// 99.9% quantiles of chi-square: with fixed seeds a correct sampler passes
// deterministically, while a wrong distribution overshoots by orders of
// magnitude at 20k draws.
const CHI2_999_DF1: f64 = 10.83;
const CHI2_999_DF2: f64 = 13.82;
const CHI2_999_DF7: f64 = 24.32;

#[test]
fn greedy_is_argmax_and_ignores_filters() {
    for seed in 0..20 {
        let logits = random_logits(seed, 1000, 5.0);
        let expected = (0..logits.len())
            .max_by(|&a, &b| logits[a].partial_cmp(&logits[b]).unwrap())
            .unwrap() as u32;
        for temperature in [0.0, 1e-6] {
            let params = SamplingParams {
                temperature,
                top_k: 3,
                top_p: 0.1,
                min_p: 0.5,
                ..seeded(seed)
            };
            let mut s = RequestSampler::new(&params, &[], None);
            assert_eq!(s.sample(&mut logits.clone(), &params).token, expected);
        }
    }
}

#[test]
fn same_seed_same_sequence_different_seed_differs() {
    let logits = random_logits(1, 500, 1.0);
    let run = |seed| {
        let params = seeded(seed);
        let mut s = RequestSampler::new(&params, &[], None);
        (0..64)
            .map(|_| s.sample(&mut logits.clone(), &params).token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn temperature_sampling_follows_softmax_of_scaled_logits() {
    let logits = [1.0f32, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2];
    for (seed, t) in [(11, 1.0), (12, 0.5), (13, 2.0)] {
        let params = SamplingParams {
            temperature: t,
            ..seeded(seed)
        };
        let counts = histogram(&logits, &params, 20_000);
        let chi2 = chi_square(&counts, &softmax(&logits, f64::from(t)));
        assert!(chi2 < CHI2_999_DF7, "T={t}: chi2 {chi2}, counts {counts:?}");
    }
}

#[test]
fn top_k_never_leaves_the_k_best_and_keeps_their_ratios() {
    let logits = random_logits(3, 50, 2.0);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
    let params = SamplingParams {
        top_k: 3,
        temperature: 1.5,
        ..seeded(21)
    };
    let counts = histogram(&logits, &params, 20_000);
    let expected = restrict(&softmax(&logits, 1.5), &order[..3]);
    let chi2 = chi_square(&counts, &expected);
    assert!(chi2 < CHI2_999_DF2, "chi2 {chi2}");
}

#[test]
fn top_p_draws_only_from_the_smallest_nucleus() {
    // Masses 0.5, 0.25, 0.15, 0.1: top_p 0.7 needs the first two (0.75).
    let probs = [0.15, 0.5, 0.1, 0.25];
    let logits = logits_of(&probs);
    let params = SamplingParams {
        top_p: 0.7,
        ..seeded(31)
    };
    let counts = histogram(&logits, &params, 20_000);
    let chi2 = chi_square(&counts, &restrict(&probs, &[1, 3]));
    assert!(chi2 < CHI2_999_DF1, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn top_p_nucleus_larger_than_first_guess_over_big_vocab() {
    // A flat distribution over 5000 tokens: the 0.5 nucleus holds ~2500
    // tokens, forcing the candidate search to grow several times.
    let logits = random_logits(4, 5000, 0.5);
    let probs = softmax(&logits, 1.0);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap());
    let mut cum = 0.0;
    let size = order
        .iter()
        .position(|&i| {
            cum += probs[i];
            cum >= 0.5
        })
        .unwrap()
        + 1;
    let nucleus: std::collections::HashSet<usize> = order[..size].iter().copied().collect();
    let params = SamplingParams {
        top_p: 0.5,
        ..seeded(41)
    };
    let counts = histogram(&logits, &params, 5_000);
    let mut beyond_first_guess = 0;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 {
            assert!(
                nucleus.contains(&i),
                "token {i} outside the nucleus of {size}"
            );
            if order.iter().position(|&j| j == i).unwrap() >= 64 {
                beyond_first_guess += c;
            }
        }
    }
    assert!(size > 1000, "test premise: nucleus of {size}");
    assert!(beyond_first_guess > 3_000, "{beyond_first_guess}");
}

#[test]
fn min_p_drops_tokens_below_the_scaled_threshold() {
    // min_p 0.2 of the top probability 0.5 is 0.1: token 3 (0.05) goes.
    let probs = [0.5, 0.3, 0.15, 0.05];
    let logits = logits_of(&probs);
    let params = SamplingParams {
        min_p: 0.2,
        ..seeded(51)
    };
    let counts = histogram(&logits, &params, 20_000);
    let chi2 = chi_square(&counts, &restrict(&probs, &[0, 1, 2]));
    assert!(chi2 < CHI2_999_DF2, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn min_p_threshold_is_on_the_tempered_distribution() {
    // At T = 0.5 the masses become p^2 / sum = 0.685, 0.247, 0.062, 0.007;
    // min_p 0.2 (threshold 0.137) keeps {0, 1}. On the untempered masses it
    // would also keep token 2.
    let probs = [0.5, 0.3, 0.15, 0.05];
    let params = SamplingParams {
        temperature: 0.5,
        min_p: 0.2,
        ..seeded(54)
    };
    let logits = logits_of(&probs);
    let counts = histogram(&logits, &params, 20_000);
    let chi2 = chi_square(&counts, &restrict(&softmax(&logits, 0.5), &[0, 1]));
    assert!(chi2 < CHI2_999_DF1, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn min_p_applies_before_top_p_as_in_vllm() {
    // min_p 0.3 keeps {0,1,2}, renormalised to 0.444/0.333/0.222, so top_p
    // 0.75 then keeps {0,1}. Top-p on the original masses would keep {0,1,2}.
    let probs = [0.4, 0.3, 0.2, 0.1];
    let params = SamplingParams {
        min_p: 0.3,
        top_p: 0.75,
        ..seeded(52)
    };
    let counts = histogram(&logits_of(&probs), &params, 20_000);
    let chi2 = chi_square(&counts, &restrict(&probs, &[0, 1]));
    assert!(chi2 < CHI2_999_DF1, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn top_k_and_top_p_combine() {
    // top_k 3 keeps masses 0.4/0.3/0.2 -> 0.444/0.333/0.222; top_p 0.5 then
    // needs two of them.
    let probs = [0.1, 0.2, 0.3, 0.4];
    let params = SamplingParams {
        top_k: 3,
        top_p: 0.5,
        ..seeded(53)
    };
    let counts = histogram(&logits_of(&probs), &params, 20_000);
    let chi2 = chi_square(&counts, &restrict(&probs, &[2, 3]));
    assert!(chi2 < CHI2_999_DF1, "chi2 {chi2}, counts {counts:?}");
}

#[test]
fn penalties_match_scalar_formula() {
    let vocab = 40;
    let raw = random_logits(5, vocab, 3.0);
    let prompt = [1u32, 2, 3, 2, 30];
    let outputs = [3u32, 4, 4, 4, 7, 1];
    let params = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        presence_penalty: 0.3,
        ..Default::default()
    };
    let mut s = RequestSampler::new(&params, &prompt, None);
    for &t in &outputs {
        s.accept(t);
    }
    let mut logits = raw.clone();
    let out = s.sample(&mut logits, &params);

    for i in 0..vocab {
        let id = i as u32;
        let count = outputs.iter().filter(|&&t| t == id).count() as f32;
        let mut expected = raw[i];
        if prompt.contains(&id) || count > 0.0 {
            expected = if expected > 0.0 {
                expected / 1.3
            } else {
                expected * 1.3
            };
        }
        expected -= 0.5 * count;
        if count > 0.0 {
            expected -= 0.3;
        }
        assert!(
            (logits[i] - expected).abs() < 1e-5,
            "token {i}: {} vs {expected}",
            logits[i]
        );
    }
    let argmax = (0..vocab)
        .max_by(|&a, &b| logits[a].partial_cmp(&logits[b]).unwrap())
        .unwrap();
    assert_eq!(out.token as usize, argmax);
    assert_eq!(s.num_output_tokens(), outputs.len() + 1);
}

#[test]
fn logprobs_are_of_the_raw_output() {
    let vocab = 100;
    let raw = random_logits(6, vocab, 4.0);
    let raw_probs = softmax(&raw, 1.0);
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| raw[b].partial_cmp(&raw[a]).unwrap());
    // Penalise the raw favourite so that a processed logprob would differ.
    let params = SamplingParams {
        temperature: 0.7,
        repetition_penalty: 2.0,
        logprobs: Some(5),
        ..seeded(61)
    };
    let mut s = RequestSampler::new(&params, &[order[0] as u32], None);
    let SampledToken {
        token,
        logprob,
        top_logprobs,
    } = s.sample(&mut raw.clone(), &params);
    assert!((f64::from(logprob) - raw_probs[token as usize].ln()).abs() < 1e-4);
    assert_eq!(top_logprobs.len(), 5);
    for ((id, lp), &want) in top_logprobs.iter().zip(&order) {
        assert_eq!(*id as usize, want);
        assert!((f64::from(*lp) - raw_probs[want].ln()).abs() < 1e-4);
    }
    let none = SamplingParams {
        logprobs: None,
        ..params.clone()
    };
    assert!(s.sample(&mut raw.clone(), &none).top_logprobs.is_empty());
}

#[test]
fn min_tokens_masks_eos_and_stop_tokens() {
    let eos = 0u32;
    // EOS dominates, then the stop token 1, then token 2.
    let mut logits = vec![-5.0f32; 10];
    logits[0] = 10.0;
    logits[1] = 8.0;
    logits[2] = 6.0;
    let params = SamplingParams {
        temperature: 0.0,
        min_tokens: 3,
        stop_token_ids: vec![1],
        ..Default::default()
    };
    let mut s = RequestSampler::new(&params, &[], Some(eos));
    let tokens: Vec<u32> = (0..4)
        .map(|_| s.sample(&mut logits.clone(), &params).token)
        .collect();
    assert_eq!(tokens, vec![2, 2, 2, eos]);

    // Random sampling must not slip through either.
    let random = SamplingParams {
        temperature: 1.0,
        seed: Some(3),
        ..params.clone()
    };
    let mut s = RequestSampler::new(&random, &[], Some(eos));
    for _ in 0..3 {
        let t = s.sample(&mut logits.clone(), &random).token;
        assert!(t != 0 && t != 1, "{t}");
    }

    // With ignore_eos, EOS is not a stop token, so it is not masked.
    let ignore = SamplingParams {
        ignore_eos: true,
        ..params
    };
    let mut s = RequestSampler::new(&ignore, &[], Some(eos));
    assert_eq!(s.sample(&mut logits.clone(), &ignore).token, eos);
}

#[test]
fn batch_rows_match_individual_sampling_and_seeded_rows_ignore_neighbours() {
    let vocab = 64;
    let rows = [random_logits(7, vocab, 2.0), random_logits(8, vocab, 2.0)];
    let seeded_row = seeded(71);
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let other_random = seeded(72);

    let mut alone = RequestSampler::new(&seeded_row, &[], None);
    let expected: Vec<u32> = (0..10)
        .map(|_| alone.sample(&mut rows[0].clone(), &seeded_row).token)
        .collect();

    for neighbour in [&greedy, &other_random] {
        let mut a = RequestSampler::new(&seeded_row, &[], None);
        let mut b = RequestSampler::new(neighbour, &[], None);
        let mut got = Vec::new();
        for _ in 0..10 {
            let mut batch: Vec<f32> = rows.concat();
            let mut entries = [(&seeded_row, &mut a), (neighbour, &mut b)];
            let out = sample_batch(&mut batch, vocab, &mut entries);
            assert_eq!(out.len(), 2);
            got.push(out[0].token);
        }
        assert_eq!(got, expected);
    }
}

#[test]
fn fully_masked_row_does_not_panic() {
    let params = SamplingParams {
        min_tokens: 1,
        stop_token_ids: vec![1],
        ..seeded(1)
    };
    let mut s = RequestSampler::new(&params, &[], Some(0));
    let mut logits = vec![0.0f32, 0.0];
    let t = s.sample(&mut logits, &params).token;
    assert!(t < 2);
}

#[test]
fn top_candidates_are_the_tempered_softmax_of_the_penalised_row() {
    let logits = random_logits(11, 300, 4.0);
    let params = SamplingParams {
        temperature: 0.7,
        repetition_penalty: 1.3,
        ..seeded(4)
    };
    let mut s = RequestSampler::new(&params, &[5, 9], None);
    let mut row = logits.clone();
    s.prepare(&mut row, &params);
    let mut out = Vec::new();
    s.top_candidates(&row, &params, 5, &mut out);
    // Expected: the textbook softmax of the penalised row at T = 0.7.
    let probs = softmax(&row, 0.7);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    assert_eq!(out.len(), 5);
    for (c, &i) in out.iter().zip(&order) {
        assert_eq!(c.0 as usize, i);
        assert!((f64::from(c.1) - probs[i].ln()).abs() < 1e-4, "{c:?}");
    }
    // The penalty reached the prompt tokens.
    assert!(row[5] < logits[5] && row[9] < logits[9]);
}

/// A sampler plugin's fallback: the row is prepared, its candidates taken
/// and its uniform drawn for the plugin, then the host draws with that
/// uniform; the tokens and logprobs are what plain sampling gives.
#[test]
fn the_fallback_with_the_plugins_uniform_samples_as_the_host_would() {
    let logits = random_logits(12, 500, 3.0);
    for temperature in [0.0, 0.9] {
        let params = SamplingParams {
            temperature,
            logprobs: Some(3),
            ..seeded(8)
        };
        let mut host = RequestSampler::new(&params, &[], None);
        let mut fallback = RequestSampler::new(&params, &[], None);
        let mut candidates = Vec::new();
        for _ in 0..20 {
            let want = host.sample(&mut logits.clone(), &params);
            let mut row = logits.clone();
            let prepared = fallback.prepare(&mut row, &params);
            fallback.top_candidates(&row, &params, 20, &mut candidates);
            let u = fallback.next_uniform();
            let token = fallback.choose(&row, &params, Some(u));
            assert_eq!(fallback.finish(&row, token, prepared), want);
        }
    }
}
