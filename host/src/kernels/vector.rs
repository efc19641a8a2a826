//! Element-wise and reduction kernels on f32 vectors: RMSNorm, SwiGLU's
//! `silu(gate) * up`, softmax, dot and axpy (whose bodies attention's tile
//! kernels in [`super::tiles`] share).
//!
//! Each has a portable version (`*_scalar`, also the test reference) and an
//! AVX2 version chosen at run time; softmax, which attention runs on every
//! score, also has an AVX-512 one (in `vector_avx512`) with the AVX2 one's
//! bits. `exp` in the SIMD versions is our own polynomial ([`exp_avx2`]),
//! accurate to a few ulp.

use super::kv_elem::KvElem;

/// `out = x / rms(x) * weight`, with `rms(x) = sqrt(mean(x^2) + eps)`.
///
/// Panics if the three slices differ in length (a caller bug).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rms_norm: x, weight and out must have equal lengths"
    );
    if x.is_empty() {
        return;
    }
    let scale = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 is present; lengths were checked above.
        unsafe { avx2::scale_mul(x, weight, scale, out) };
        return;
    }
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * g;
    }
}

/// Portable [`rms_norm`] in f64, the test reference.
#[cfg(test)]
pub(crate) fn rms_norm_reference(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (ms + f64::from(eps)).sqrt();
    x.iter()
        .zip(weight)
        .map(|(&v, &g)| (f64::from(v) * scale * f64::from(g)) as f32)
        .collect()
}

/// `out[i] = silu(gate[i]) * up[i]` with `silu(g) = g / (1 + exp(-g))`.
///
/// Panics if the slices differ in length (a caller bug).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "silu_mul: gate, up and out must have equal lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 is present; lengths were checked above.
        unsafe { avx2::silu_mul(gate, up, out) };
        return;
    }
    silu_mul_scalar(gate, up, out);
}

/// Portable [`silu_mul`].
pub(crate) fn silu_mul_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// Softmax before its division: replaces `x` by `exp(x - max(x))` and
/// returns `(max(x), sum of the new x)`, the form in which attention merges
/// the chunks of a query's keys. `-inf` entries (masked positions) become
/// 0; all of them masked (or none at all) gives `(-inf, 0)`.
pub fn softmax_parts(x: &mut [f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx512() {
        // SAFETY: AVX-512 F (with AVX2 and FMA) is present.
        return unsafe { super::vector_avx512::softmax_parts(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 is present.
        return unsafe { avx2::softmax_parts(x) };
    }
    softmax_parts_scalar(x)
}

/// Portable [`softmax_parts`].
pub(crate) fn softmax_parts_scalar(x: &mut [f32]) -> (f32, f32) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return (max, 0.0);
    }
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    (max, sum)
}

/// `sum_i a[i] * b[i]`.
///
/// Panics if the slices differ in length (a caller bug).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: a and b must have equal lengths");
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 is present; lengths were checked above.
        return unsafe { avx2::dot(a, b) };
    }
    dot_portable(a, b)
}

/// Portable [`dot`], with `b` of any KV-cache element type.
pub(crate) fn dot_portable<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum()
}

/// `y[i] += alpha * x[i]`.
///
/// Panics if the slices differ in length (a caller bug).
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: x and y must have equal lengths");
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: AVX2 is present; lengths were checked above.
        unsafe { avx2::axpy(alpha, x, y) };
        return;
    }
    axpy_portable(alpha, x, y);
}

/// Portable [`axpy`], with `x` of any KV-cache element type.
pub(crate) fn axpy_portable<E: KvElem>(alpha: f32, x: &[E], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x.to_f32();
    }
}

/// ln2 split in two so that `n * EXP_LN2_HI` is exact (the SIMD `exp`s).
#[cfg(target_arch = "x86_64")]
pub(crate) const EXP_LN2_HI: f32 = 0.693_145_75;
/// The rest of ln2.
#[cfg(target_arch = "x86_64")]
pub(crate) const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// The SIMD `exp`s' degree-6 Taylor polynomial, highest power first.
#[cfg(target_arch = "x86_64")]
pub(crate) const EXP_TAYLOR: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// The AVX2 versions; every function needs AVX2 + FMA (+ F16C where it
/// reads a KV-cache element type) and equal lengths.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{KvElem, EXP_LN2_HI, EXP_LN2_LO, EXP_TAYLOR};

    /// Sum of the 8 lanes.
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// `exp(x)` per lane: `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-6
    /// Taylor polynomial for `exp(r)` (error below 2e-7 relative) and `2^n`
    /// built in the exponent bits. Inputs above 88.5 are clamped, and inputs
    /// below -104 (beyond the smallest denormal), `-inf` included, give 0.
    #[inline(always)]
    pub(crate) unsafe fn exp_avx2(x_in: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x_in, _mm256_set1_ps(-104.0)),
            _mm256_set1_ps(88.5),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_TAYLOR[0]);
        for c in &EXP_TAYLOR[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        // 2^n as two factors, so n down to -150 (denormals) still works.
        let n = _mm256_cvtps_epi32(n);
        let half = _mm256_srai_epi32(n, 1);
        let pow = |e: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_add_epi32(e, _mm256_set1_epi32(127)),
                23,
            ))
        };
        let e = _mm256_mul_ps(_mm256_mul_ps(p, pow(half)), pow(_mm256_sub_epi32(n, half)));
        _mm256_and_ps(e, _mm256_cmp_ps::<_CMP_GT_OQ>(x_in, _mm256_set1_ps(-104.0)))
    }

    /// Loads `n < 8` values as f32, zero padded.
    #[inline(always)]
    unsafe fn load_tail<E: KvElem>(src: &[E]) -> __m256 {
        let mut tmp = [0f32; 8];
        for (t, s) in tmp.iter_mut().zip(src) {
            *t = s.to_f32();
        }
        _mm256_loadu_ps(tmp.as_ptr())
    }

    /// Stores the first `dst.len() < 8` lanes of `v`.
    #[inline(always)]
    unsafe fn store_tail(dst: &mut [f32], v: __m256) {
        let mut tmp = [0f32; 8];
        _mm256_storeu_ps(tmp.as_mut_ptr(), v);
        let n = dst.len();
        dst.copy_from_slice(&tmp[..n]);
    }

    /// AVX2 [`dot`](super::dot).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot_inline(a, b)
    }

    /// [`dot`]'s body, with `b` of any KV-cache element type (widened as
    /// it is loaded), inlined into its callers; needs AVX2, FMA and F16C.
    #[inline(always)]
    pub(crate) unsafe fn dot_inline<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8 * j)),
                    E::load8(pb.add(i + 8 * j)),
                    *acc,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), E::load8(pb.add(i)), acc[0]);
            i += 8;
        }
        if i < n {
            acc[1] = _mm256_fmadd_ps(load_tail(&a[i..]), load_tail(&b[i..]), acc[1]);
        }
        hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ))
    }

    /// AVX2 [`axpy`](super::axpy), with `x` of any KV-cache element type.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn axpy<E: KvElem>(alpha: f32, x: &[E], y: &mut [f32]) {
        let n = x.len();
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let py = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                py,
                _mm256_fmadd_ps(a, E::load8(x.as_ptr().add(i)), _mm256_loadu_ps(py)),
            );
            i += 8;
        }
        if i < n {
            let v = _mm256_fmadd_ps(a, load_tail(&x[i..]), load_tail(&y[i..]));
            store_tail(&mut y[i..], v);
        }
    }

    /// `out = x * scale * w`, the second pass of RMSNorm.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn scale_mul(x: &[f32], w: &[f32], scale: f32, out: &mut [f32]) {
        let s = _mm256_set1_ps(scale);
        let n = x.len();
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_mul_ps(
                _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), s),
                _mm256_loadu_ps(w.as_ptr().add(i)),
            );
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            i += 8;
        }
        if i < n {
            store_tail(
                &mut out[i..],
                _mm256_mul_ps(_mm256_mul_ps(load_tail(&x[i..]), s), load_tail(&w[i..])),
            );
        }
    }

    /// `silu(g) * u` per lane.
    #[inline(always)]
    unsafe fn silu_mul8(g: __m256, u: __m256) -> __m256 {
        let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
    }

    /// AVX2 [`silu_mul`](super::silu_mul).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = gate.len();
        let mut i = 0;
        while i + 8 <= n {
            let v = silu_mul8(
                _mm256_loadu_ps(gate.as_ptr().add(i)),
                _mm256_loadu_ps(up.as_ptr().add(i)),
            );
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            i += 8;
        }
        if i < n {
            let v = silu_mul8(load_tail(&gate[i..]), load_tail(&up[i..]));
            store_tail(&mut out[i..], v);
        }
    }

    /// AVX2 [`softmax_parts`](super::softmax_parts).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn softmax_parts(x: &mut [f32]) -> (f32, f32) {
        let n = x.len();
        let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= n {
            vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x.as_ptr().add(i)));
            i += 8;
        }
        let mut max = f32::NEG_INFINITY;
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
        for &v in lanes.iter().chain(&x[i..]) {
            max = max.max(v);
        }
        if max == f32::NEG_INFINITY {
            x.fill(0.0);
            return (max, 0.0);
        }
        let m = _mm256_set1_ps(max);
        let mut vsum = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let p = x.as_mut_ptr().add(i);
            let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p), m));
            _mm256_storeu_ps(p, e);
            vsum = _mm256_add_ps(vsum, e);
            i += 8;
        }
        // Padding lanes would be exp(0 - max); mask them out of the sum.
        if i < n {
            let tail = &mut x[i..];
            let mut tmp = [f32::NEG_INFINITY; 8];
            tmp[..tail.len()].copy_from_slice(tail);
            let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tmp.as_ptr()), m));
            store_tail(tail, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        (max, hsum(vsum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    const LENGTHS: [usize; 9] = [0, 1, 7, 8, 9, 31, 64, 577, 1536];

    fn close(a: f32, b: f32, tol: f32) -> bool {
        (a - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn rms_norm_matches_f64_reference() {
        let mut rng = Rng::new(10);
        for n in LENGTHS {
            let (x, w) = (rng.normals(n), rng.normals(n));
            let mut out = vec![0f32; n];
            rms_norm(&x, &w, 1e-5, &mut out);
            for (g, e) in out.iter().zip(rms_norm_reference(&x, &w, 1e-5)) {
                assert!(close(*g, e, 1e-5), "n={n}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn silu_mul_matches_scalar() {
        let mut rng = Rng::new(11);
        for n in LENGTHS {
            let gate: Vec<f32> = rng.normals(n).iter().map(|v| v * 8.0).collect();
            let up = rng.normals(n);
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            silu_mul(&gate, &up, &mut a);
            silu_mul_scalar(&gate, &up, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!(close(*x, *y, 1e-6), "n={n}: {x} vs {y}");
            }
        }
        // Saturated ends: silu(-200) ~ 0, silu(200) = 200.
        let mut g = vec![0.0; 2];
        silu_mul(&[-200.0, 200.0], &[1.0, 1.0], &mut g);
        assert!(g[0].abs() < 1e-30 && g[1] == 200.0, "{g:?}");
    }

    #[test]
    fn softmax_parts_match_scalar_and_ignore_masked_entries() {
        let mut rng = Rng::new(12);
        for n in LENGTHS {
            let mut x: Vec<f32> = rng.normals(n).iter().map(|v| v * 20.0).collect();
            if n > 2 {
                x[1] = f32::NEG_INFINITY;
            }
            let (mut a, mut b) = (x.clone(), x.clone());
            let (max, sum) = softmax_parts(&mut a);
            assert!(
                close(sum, a.iter().sum::<f32>(), 1e-5),
                "n={n}: sum of the new x"
            );
            let want_max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max, want_max);
            let (_, want_sum) = softmax_parts_scalar(&mut b);
            assert!(close(sum, want_sum, 1e-5), "n={n}: {sum} vs {want_sum}");
            for ((p, q), v) in a.iter().zip(&b).zip(&x) {
                let exact = (f64::from(*v) - f64::from(max)).exp() as f32;
                assert!(
                    close(*p, *q, 1e-6) && close(*p, exact, 1e-6),
                    "n={n}: {p} vs {q} vs {exact}"
                );
            }
            if n > 2 {
                assert_eq!(a[1], 0.0);
            }
        }
        let mut all_masked = vec![f32::NEG_INFINITY; 9];
        assert_eq!(softmax_parts(&mut all_masked), (f32::NEG_INFINITY, 0.0));
        assert!(all_masked.iter().all(|v| *v == 0.0));
        assert_eq!(softmax_parts(&mut []), (f32::NEG_INFINITY, 0.0));
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        let mut rng = Rng::new(13);
        for n in LENGTHS {
            let (a, b) = (rng.normals(n), rng.normals(n));
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            let scale = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum::<f32>();
            assert!(
                (dot(&a, &b) - want as f32).abs() <= 1e-6 * (1.0 + scale),
                "n={n}"
            );
            let mut y = b.clone();
            axpy(0.75, &a, &mut y);
            for i in 0..n {
                assert!(close(y[i], b[i] + 0.75 * a[i], 1e-6));
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_exp_is_accurate_over_the_whole_range() {
        use std::arch::x86_64::*;
        if !crate::kernels::cpu::has_avx2() {
            return;
        }
        let mut x = -110.0f32;
        while x < 88.0 {
            let xs = [
                x,
                x + 0.013,
                x + 0.029,
                x + 0.031,
                x + 0.047,
                x + 0.053,
                x + 0.067,
                x + 0.071,
            ];
            let mut got = [0f32; 8];
            // SAFETY: AVX2 checked above.
            unsafe {
                _mm256_storeu_ps(
                    got.as_mut_ptr(),
                    avx2::exp_avx2(_mm256_loadu_ps(xs.as_ptr())),
                )
            };
            for (g, &x) in got.iter().zip(&xs) {
                let want = f64::from(x).exp();
                let err = (f64::from(*g) - want).abs();
                // Relative 1e-6, or absolute near the denormal range.
                assert!(
                    err <= 1e-6 * want || err < 1e-37 || (x < -104.0 && *g == 0.0),
                    "exp({x}) = {g}, want {want}"
                );
            }
            x += 0.37;
        }
    }
}
