//! Reductions over one row of logits: argmax, log-sum-exp and partial top-k
//! selection. All comparisons use `f32::total_cmp` so that a NaN produced by a
//! broken model cannot make a sort panic or loop.

use std::cmp::Ordering;

use super::exp::sum_exp_shifted;

/// Index of the largest value; ties go to the lowest index, as `torch.argmax`
/// does. NaNs are skipped; an all-NaN (or empty) row gives 0.
///
/// Two passes (a vectorised max, then a search for it) beat one pass that
/// tracks the index, which the compiler cannot vectorise.
pub fn argmax(values: &[f32]) -> usize {
    let max = max_value(values);
    values.iter().position(|&v| v == max).unwrap_or(0)
}

/// The largest non-NaN value, or -inf for an empty or all-NaN row.
pub fn max_value(values: &[f32]) -> f32 {
    values.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `ln(sum(exp(values)))`, computed stably around the maximum with f64
/// accumulators so that a 49152-entry sum does not lose small terms.
pub fn log_sum_exp(values: &[f32]) -> f32 {
    let max = max_value(values);
    if !max.is_finite() {
        return max;
    }
    max + sum_exp_shifted(values, max).ln() as f32
}

/// Order for "larger value first, then lower index": a strict total order, so
/// the result does not depend on the sort algorithm.
fn desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Writes the `k` largest `(index, value)` pairs of `values` into `out` in
/// index order; among values tied with the k-th largest, the lowest indices
/// are taken.
///
/// One scan keeps a buffer of at most `2k` candidates: whenever it fills, a
/// `select_nth_unstable` cuts it back to the best `k`, whose worst value
/// becomes the bar later values must beat. On real logits the bar rises fast
/// and the scan is a single compare per token; in the worst case (ascending
/// values) it is still O(n). `out` doubles as the buffer.
pub fn top_k_in_index_order(values: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    let k = k.min(values.len());
    if k == 0 {
        return;
    }
    let capacity = (2 * k).max(64);
    let mut bar: Option<f32> = None;
    for (i, &v) in values.iter().enumerate() {
        // A later value equal to the bar loses the tie on index.
        if bar.is_some_and(|b| v.total_cmp(&b) != Ordering::Greater) {
            continue;
        }
        out.push((i as u32, v));
        if out.len() == capacity {
            out.select_nth_unstable_by(k - 1, desc);
            out.truncate(k);
            bar = Some(out[k - 1].1);
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, desc);
        out.truncate(k);
    }
    out.sort_unstable_by_key(|&(i, _)| i);
}

/// The `k` largest `(index, value)` pairs sorted by descending value (ties:
/// lower index first), in O(n + k log k).
pub fn top_k_desc(values: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    top_k_in_index_order(values, k, out);
    out.sort_unstable_by(desc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn argmax_takes_first_of_ties_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn log_sum_exp_matches_naive_sum() {
        let v = [0.5f32, -1.0, 2.0, 0.0];
        let naive = v.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
        assert!((log_sum_exp(&v) as f64 - naive).abs() < 1e-6);
        // Large values would overflow a naive sum; the shifted one is exact.
        assert!((log_sum_exp(&[1000.0, 1000.0]) - (1000.0 + 2f32.ln())).abs() < 1e-3);
    }

    proptest! {
        #[test]
        fn top_k_equals_prefix_of_full_sort(
            values in prop::collection::vec(-4i8..4, 1..200),
            k in 0usize..210,
        ) {
            // Small integer values force many ties.
            let values: Vec<f32> = values.into_iter().map(f32::from).collect();
            let mut expected: Vec<(u32, f32)> =
                values.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            expected.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            expected.truncate(k);
            let mut out = Vec::new();
            top_k_desc(&values, k, &mut out);
            prop_assert_eq!(out, expected);
        }
    }
}
