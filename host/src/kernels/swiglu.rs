//! [`swiglu`]: the MLP's activation over a batch of rows.

use super::vector::silu_mul;
use super::ThreadPool;

/// `out[t] = silu(gate_t) * up_t` for every row `t`, where row `t` of
/// `gate_up` is `[gate_t | up_t]` (`2 * ff` values, the fused gate/up
/// projection's output) and row `t` of `out` is `ff` values; a batch's
/// rows are split between the pool's threads
/// ([`ThreadPool::for_each_row`]).
///
/// Each row's result is [`silu_mul`]'s, whichever thread computes it.
///
/// Panics if `out` is not whole rows of `ff` values or `gate_up` does not
/// hold twice as many (a caller bug).
pub fn swiglu(pool: &ThreadPool, gate_up: &[f32], ff: usize, out: &mut [f32]) {
    assert!(
        ff > 0 && out.len().is_multiple_of(ff) && gate_up.len() == 2 * out.len(),
        "swiglu: {} gate/up values and {} outputs are not rows of 2 x {ff} and {ff}",
        gate_up.len(),
        out.len()
    );
    pool.for_each_row(out, ff, |t, out| {
        let (gate, up) = gate_up[2 * t * ff..2 * (t + 1) * ff].split_at(ff);
        silu_mul(gate, up, out);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    /// `g / (1 + e^-g) * u` in f64.
    fn reference(g: f32, u: f32) -> f64 {
        let g = f64::from(g);
        g / (1.0 + (-g).exp()) * f64::from(u)
    }

    #[test]
    fn every_row_is_silu_times_up_on_any_pool() {
        let mut rng = Rng::new(21);
        let ff = 1536;
        // Serial (1 row, under the threshold) and split (11 and 64 rows,
        // which two and three threads divide unevenly).
        for rows in [1usize, 11, 64] {
            let gate_up: Vec<f32> = rng.normals(rows * 2 * ff).iter().map(|v| v * 6.0).collect();
            let mut want = vec![0f32; rows * ff];
            for (t, want) in want.chunks_exact_mut(ff).enumerate() {
                let (gate, up) = gate_up[2 * t * ff..2 * (t + 1) * ff].split_at(ff);
                silu_mul(gate, up, want);
                for ((w, g), u) in want.iter().zip(gate).zip(up) {
                    let r = reference(*g, *u);
                    assert!(
                        (f64::from(*w) - r).abs() <= 1e-5 * (1.0 + r.abs()),
                        "{w} vs {r}"
                    );
                }
            }
            for threads in [1, 2, 3] {
                let mut got = vec![f32::NAN; rows * ff];
                swiglu(&ThreadPool::new(threads), &gate_up, ff, &mut got);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{rows} rows on {threads} threads differ from silu_mul"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "not rows of")]
    fn mismatched_buffers_are_a_caller_bug() {
        swiglu(&ThreadPool::new(1), &[0.0; 6], 2, &mut [0.0; 2]);
    }
}
