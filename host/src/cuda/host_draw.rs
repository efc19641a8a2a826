//! The device sampler's draw computed on the host: the same kept set as the
//! CPU sampler (its own min-p, top-k and top-p functions) and the same
//! Philox Gumbel-max as `sample_rows`, so a row gets the token the device
//! would give it, up to float rounding at a cut-off or between two scores.
//!
//! Why: the device draw has the CPU's distribution but not its stream. A GPU
//! worker that samples a step on the host (one row was not
//! [`device_eligible`](super::sampler::device_eligible)) draws the eligible
//! rows with [`draw_like_device`], and a seeded request keeps its tokens
//! whatever its neighbours; the device check uses it as the reference.

use super::philox::gumbel;
use super::sampler::DeviceRow;
use crate::sampling::exp::fill_weights;
use crate::sampling::nucleus::apply_top_p;
use crate::sampling::select::{argmax, max_value, top_k_in_index_order};
use crate::sampling::GREEDY_TEMPERATURE_EPS;

/// The largest Gumbel noise a 24-bit uniform gives, -ln(-ln(1 - 2^-25)),
/// rounded up: a token more than this below the best score cannot win.
const MAX_NOISE: f64 = 17.33;

/// The tokens a sampled `row` may draw from `logits` (one row, edits
/// applied), in id order: the CPU sampler's min-p, top-k (exactly k, ties
/// by lowest id) and top-p, in `RequestSampler`'s order. Empty when no
/// distribution exists (every token banned, or an infinite logit).
pub fn device_support(logits: &[f32], row: &DeviceRow) -> Vec<u32> {
    let max = max_value(logits);
    if !max.is_finite() {
        return Vec::new();
    }
    let cutoff = if row.min_p > 0.0 {
        max + row.temperature * row.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let mut candidates = Vec::new();
    let top_k = usize::try_from(row.top_k)
        .ok()
        .filter(|&k| k >= 1 && k < logits.len());
    let mut weights = Vec::new();
    match top_k {
        Some(k) => {
            top_k_in_index_order(logits, k, &mut candidates);
            let values: Vec<f32> = candidates.iter().map(|c| c.1).collect();
            fill_weights(&values, max, 1.0 / row.temperature, cutoff, &mut weights);
        }
        None => {
            candidates.extend((0..logits.len() as u32).zip(logits.iter().copied()));
            fill_weights(logits, max, 1.0 / row.temperature, cutoff, &mut weights);
        }
    }
    if row.top_p < 1.0 {
        apply_top_p(&mut weights, row.top_p, &mut Vec::new());
    }
    candidates
        .iter()
        .zip(&weights)
        .filter(|&(_, &w)| w > 0.0)
        .map(|(c, _)| c.0)
        .collect()
}

/// The token `sample_rows` draws for `row` from `logits`: the argmax when
/// greedy (or when no distribution exists), else the highest
/// `logit / T + gumbel(seed, position, token)` over [`device_support`].
pub fn draw_like_device(logits: &[f32], row: &DeviceRow) -> u32 {
    if row.temperature < GREEDY_TEMPERATURE_EPS {
        return argmax(logits) as u32;
    }
    let support = device_support(logits, row);
    let inv_t = 1.0 / f64::from(row.temperature);
    let scaled = |t: u32| f64::from(logits[t as usize]) * inv_t;
    // Start from the likeliest token, so that most of a peaked row is
    // skipped without computing its noise.
    let Some(&first) = support
        .iter()
        .max_by(|&&a, &&b| logits[a as usize].total_cmp(&logits[b as usize]))
    else {
        return argmax(logits) as u32;
    };
    let (mut best, mut best_score) = (first, scaled(first) + gumbel(row.seed, row.position, first));
    for &t in &support {
        let x = scaled(t);
        if x + MAX_NOISE < best_score {
            continue;
        }
        let score = x + gumbel(row.seed, row.position, t);
        // Equal scores: the lower id, as the kernel's reduction.
        if score > best_score || (score == best_score && t < best) {
            (best, best_score) = (t, score);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32, top_k: i32, top_p: f32, min_p: f32, seed: u64) -> DeviceRow {
        DeviceRow {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            position: 0,
        }
    }

    /// A small xorshift for test logits.
    fn logits(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    #[test]
    fn the_noise_bound_is_the_largest_noise() {
        // u = 1 - 2^-25 is the largest uniform (philox.rs).
        let u: f64 = 1.0 - 1.0 / 33_554_432.0;
        let largest = -(-(-(1.0 - u)).ln_1p()).ln();
        assert!(
            largest < MAX_NOISE && MAX_NOISE - largest < 0.01,
            "{largest}"
        );
    }

    #[test]
    fn top_k_keeps_exactly_k_with_ties_by_lowest_id() {
        let mut l = vec![-5.0f32; 3000];
        for t in [2999, 1500, 1024, 1023, 10] {
            l[t] = 2.0;
        }
        l[2000] = 3.0;
        assert_eq!(
            device_support(&l, &row(1.0, 3, 1.0, 0.0, 0)),
            [10, 1023, 2000]
        );
        // top-p keeps the ties at its own cut: the three 2.0s of the four.
        let s = device_support(&l, &row(1.0, 4, 0.99, 0.0, 0));
        assert_eq!(s, [10, 1023, 1024, 2000]);
        // min-p first: only the 3.0 is within a factor 0.5 of the top.
        assert_eq!(device_support(&l, &row(1.0, 4, 1.0, 0.5, 0)), [2000]);
        let mut drawn: Vec<u32> = (0..400)
            .map(|seed| draw_like_device(&l, &row(1.0, 3, 1.0, 0.0, seed)))
            .collect();
        drawn.sort_unstable();
        drawn.dedup();
        assert_eq!(drawn, [10, 1023, 2000]);
    }

    #[test]
    fn greedy_and_degenerate_rows_take_the_cpus_argmax() {
        let l = logits(3, 500, 4.0);
        let want = argmax(&l) as u32;
        assert_eq!(draw_like_device(&l, &row(0.0, 5, 0.5, 0.1, 9)), want);
        let banned = vec![f32::NEG_INFINITY; 7];
        assert_eq!(draw_like_device(&banned, &row(1.0, 0, 1.0, 0.0, 9)), 0);
        assert!(device_support(&banned, &row(1.0, 0, 1.0, 0.0, 9)).is_empty());
        let mut inf = l.clone();
        inf[42] = f32::INFINITY;
        assert_eq!(draw_like_device(&inf, &row(1.0, 0, 1.0, 0.0, 9)), 42);
    }

    #[test]
    fn the_pruned_scan_is_the_full_gumbel_max() {
        for seed in 0..200u64 {
            let l = logits(seed, 2000, 12.0);
            let r = DeviceRow {
                position: seed as u32 * 7,
                ..row(0.6, 0, 1.0, 0.0, seed)
            };
            let full = (0..2000u32)
                .map(|t| {
                    (
                        f64::from(l[t as usize]) / 0.6 + gumbel(seed, r.position, t),
                        t,
                    )
                })
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .unwrap()
                .1;
            assert_eq!(draw_like_device(&l, &r), full, "seed {seed}");
        }
    }

    #[test]
    fn draws_follow_the_tempered_softmax_of_the_support() {
        // At T = 2 over ln(1..=5) * 2 the weights are 1..=5; top-k 3 keeps
        // 3, 4, 5 (of 12).
        let l: Vec<f32> = (1..=5).map(|i| (i as f32).ln() * 2.0).collect();
        let n = 24_000u32;
        let mut counts = [0u32; 5];
        for pos in 0..n {
            let r = DeviceRow {
                position: pos,
                ..row(2.0, 3, 1.0, 0.0, 77)
            };
            counts[draw_like_device(&l, &r) as usize] += 1;
        }
        assert_eq!(counts[..2], [0, 0]);
        for (t, want) in [(2, 3.0 / 12.0), (3, 4.0 / 12.0), (4, 5.0 / 12.0)] {
            let got = f64::from(counts[t]) / f64::from(n);
            // Standard error about 0.003.
            assert!((got - want).abs() < 0.015, "token {t}: {got} vs {want}");
        }
    }
}
