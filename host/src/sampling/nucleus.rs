//! Top-p (nucleus) restriction without sorting the vocabulary.
//!
//! The nucleus is the smallest set of most likely tokens whose probability
//! mass reaches `top_p`. vLLM sorts the whole row to find it. Here one pass
//! sums the mass per bucket of the weights' float bits (monotonic for
//! positive floats, 16 buckets per octave), a walk down the buckets finds the
//! one where the cumulative mass crosses `top_p`, and a weighted quickselect
//! over that bucket alone finds the smallest weight `w*` in the nucleus. Every
//! weight below `w*` is zeroed. Tokens tied with `w*` are all kept (a sort
//! would keep an arbitrary subset of them).

use super::exp::sum_f64;

/// Bucket of a positive weight: its float bits without the low mantissa
/// bits, i.e. the exponent and the top 4 mantissa bits.
const BUCKET_SHIFT: u32 = 19;

/// Number of buckets covering (0, 1], the range of weights relative to the
/// most likely token.
const BUCKETS: usize = (0x3F80_0000u32 >> BUCKET_SHIFT) as usize + 1;

/// The bucket index of weight `w`; NaN and values above 1 land in the top one.
fn bucket(w: f32) -> usize {
    ((w.to_bits() >> BUCKET_SHIFT) as usize).min(BUCKETS - 1)
}

/// Zeroes every weight outside the `top_p` nucleus of `weights` (unnormalised
/// probabilities in [0, 1]; zeros are tokens already excluded). `scratch` is
/// reused between calls.
pub fn apply_top_p(weights: &mut [f32], top_p: f32, scratch: &mut Vec<f32>) {
    let mut mass = [0.0f64; BUCKETS];
    for &w in weights.iter() {
        mass[bucket(w)] += f64::from(w);
    }
    let total: f64 = mass.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return;
    }
    let target = f64::from(top_p) * total;
    let mut above = 0.0;
    let boundary = (1..BUCKETS).rev().find(|&b| {
        if above + mass[b] >= target {
            return true;
        }
        above += mass[b];
        false
    });
    // No boundary above bucket 0 (which holds only zeros and subnormals)
    // means rounding: keep everything.
    let Some(boundary) = boundary else { return };
    // Branch-free compaction: the boundary bucket's members are scattered
    // unpredictably, so a filtering branch would mispredict constantly.
    scratch.clear();
    scratch.resize(weights.len(), 0.0);
    let mut len = 0;
    for &w in weights.iter() {
        scratch[len] = w;
        len += usize::from(bucket(w) == boundary);
    }
    scratch.truncate(len);
    let floor = nucleus_floor(scratch, target - above);
    for w in weights.iter_mut() {
        if *w < floor {
            *w = 0.0;
        }
    }
}

/// The smallest weight `w*` with `mass(w >= w*) >= target` — i.e. the
/// largest threshold whose kept mass still reaches the target. `ws` holds
/// positive weights and is reordered.
fn nucleus_floor(ws: &mut [f32], target: f64) -> f32 {
    let (mut lo, mut hi, mut need) = (0, ws.len(), target);
    let mut floor = f32::INFINITY;
    while lo < hi {
        let part = &mut ws[lo..hi];
        let pivot = median_of_three(part);
        let (gt, eq) = partition3(part, pivot);
        let mass_gt = sum_f64(&part[..gt]);
        if gt > 0 && mass_gt >= need {
            hi = lo + gt;
            continue;
        }
        floor = pivot;
        let mass_ge = mass_gt + sum_f64(&part[gt..gt + eq]);
        if mass_ge >= need {
            break;
        }
        // Everything at or above the pivot is in; look lower for the rest.
        need -= mass_ge;
        lo += gt + eq;
    }
    // Leaving through `lo == hi` means rounding kept `need` above zero after
    // every weight was taken: the nucleus is everything, `floor` the minimum.
    floor
}

/// Median of the first, middle and last element: a cheap pivot that avoids
/// the quadratic case on already sorted rows.
fn median_of_three(v: &[f32]) -> f32 {
    let (a, b, c) = (v[0], v[v.len() / 2], v[v.len() - 1]);
    a.max(b).min(a.min(b).max(c))
}

/// Three-way partition around `pivot` (Dijkstra's Dutch flag): afterwards
/// `v` is `[> pivot | == pivot | < pivot]`; returns the first two lengths.
fn partition3(v: &mut [f32], pivot: f32) -> (usize, usize) {
    let (mut gt_end, mut i, mut lt_start) = (0, 0, v.len());
    while i < lt_start {
        if v[i] > pivot {
            v.swap(i, gt_end);
            gt_end += 1;
            i += 1;
        } else if v[i] < pivot {
            lt_start -= 1;
            v.swap(i, lt_start);
        } else {
            i += 1;
        }
    }
    (gt_end, lt_start - gt_end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference: sort descending, keep the shortest prefix reaching the mass,
    /// plus any ties with its last element.
    fn reference(weights: &[f32], top_p: f32) -> Vec<f32> {
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let mut sorted: Vec<f32> = weights.iter().copied().filter(|&w| w > 0.0).collect();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let mut cum = 0.0;
        let floor = sorted
            .iter()
            .copied()
            .find(|&w| {
                cum += f64::from(w);
                cum >= f64::from(top_p) * total
            })
            .unwrap_or(*sorted.last().unwrap());
        weights
            .iter()
            .map(|&w| if w >= floor { w } else { 0.0 })
            .collect()
    }

    proptest! {
        #[test]
        fn matches_sorted_prefix(
            // Coarse values give many ties; zeros are excluded tokens.
            raw in prop::collection::vec(0u8..20, 1..300),
            top_p in 0.01f32..1.0,
        ) {
            let mut weights: Vec<f32> = raw.iter().map(|&r| f32::from(r) / 19.0).collect();
            weights[0] = 1.0;
            let want = reference(&weights, top_p);
            apply_top_p(&mut weights, top_p, &mut Vec::new());
            prop_assert_eq!(weights, want);
        }
    }

    #[test]
    fn partition3_orders_around_pivot() {
        let mut v = [3.0, 1.0, 2.0, 2.0, 5.0, 0.0, 2.0];
        let (gt, eq) = partition3(&mut v, 2.0);
        assert_eq!((gt, eq), (2, 3));
        assert!(v[..2].iter().all(|&x| x > 2.0));
        assert!(v[2..5].iter().all(|&x| x == 2.0));
        assert!(v[5..].iter().all(|&x| x < 2.0));
    }
}
