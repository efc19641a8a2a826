//! A vectorisable `exp` for the sampler's vocabulary-wide passes.
//!
//! `f32::exp` is a libm call the compiler cannot vectorise; over a 49152-token
//! row it dominated the sampler's cost. Here `exp` is the classic range
//! reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, a degree-6 Taylor polynomial
//! for `e^r` (truncation error below 1.3e-7 relative) and `2^n` built from the
//! exponent bits. Only arguments <= 0 occur (logits minus their maximum), which
//! keeps `2^n` a normal float without extra branches.

/// Below this `e^x` is subnormal; such weights are flushed to exactly 0 so that
/// masked (-inf) logits can never be drawn.
const UNDERFLOW: f32 = -87.0;

/// `e^x` for `x <= 0` with about 2 ulp error; returns 0 for `x < -87` and for
/// -inf. Positive inputs are not supported (they come out wrong, not UB).
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^9 (Cody-Waite).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(UNDERFLOW);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // The low bits of `t` hold n (two's complement, n in [-126, 0]).
    let n_int = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < UNDERFLOW {
        0.0
    } else {
        p * scale
    }
}

/// Number of independent accumulators: enough to fill a vector register and
/// to hide the latency of the additions.
const LANES: usize = 8;

/// Sum of `values`, accumulated in f64 per lane so that neither precision
/// (49152 terms) nor vectorisation is lost.
#[inline(always)]
pub fn sum_f64(values: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v);
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Defines a public function whose body is also compiled for AVX2 and picks
/// that copy at run time when the CPU has it. The crate is built for baseline
/// x86-64 (SSE2); the 8-wide copy of the `exp` loops is several times faster.
/// No FMA is enabled, so both copies round identically and a seed gives the
/// same tokens on every x86-64 machine.
macro_rules! with_avx2_copy {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: `avx2` only requires the AVX2 feature, which
                    // was just detected on this CPU.
                    return unsafe { avx2($($arg),*) };
                }
            }
            portable($($arg),*)
        }
    };
}

/// Elements per stack block in [`sum_exp_shifted`].
const BLOCK: usize = 256;

with_avx2_copy! {
    /// `sum(exp(v - shift))` for a shift at least as large as every value.
    ///
    /// Exponentials go through a small stack block first: two simple loops
    /// vectorise, one loop fusing `exp` with the f64 accumulation did not.
    pub fn sum_exp_shifted(values: &[f32], shift: f32) -> f64 {
        let mut block = [0.0f32; BLOCK];
        let mut total = 0.0;
        for c in values.chunks(BLOCK) {
            let b = &mut block[..c.len()];
            for (e, &v) in b.iter_mut().zip(c) {
                *e = exp_nonpos(v - shift);
            }
            total += sum_f64(b);
        }
        total
    }
}

with_avx2_copy! {
    /// Writes `exp((l - max) * inv_t)` for each logit at or above `cutoff`, and
    /// 0 for the others, into `out` (resized to the row): the unnormalised
    /// probabilities of `softmax(logits / T)` restricted by min-p.
    pub fn fill_weights(logits: &[f32], max: f32, inv_t: f32, cutoff: f32, out: &mut Vec<f32>) {
        out.clear();
        out.resize(logits.len(), 0.0);
        for (w, &l) in out.iter_mut().zip(logits) {
            let e = exp_nonpos((l - max) * inv_t);
            *w = if l >= cutoff { e } else { 0.0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_within_3e_7_relative() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpos(x));
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
            x -= 0.001_3;
        }
        assert_eq!(exp_nonpos(0.0), 1.0);
    }

    #[test]
    fn exp_flushes_underflow_and_minus_infinity_to_zero() {
        assert_eq!(exp_nonpos(-87.5), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpos(-86.9) > 0.0);
    }

    #[test]
    fn sums_match_sequential_f64() {
        let v: Vec<f32> = (0..1003).map(|i| -((i * 37 % 101) as f32) * 0.05).collect();
        let want: f64 = v.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((sum_exp_shifted(&v, 0.0) - want).abs() / want < 1e-6);
        let want: f64 = v.iter().map(|&x| f64::from(x)).sum();
        assert!((sum_f64(&v) - want).abs() < 1e-9);
    }
}
