//! AVX-512 versions of [`super::vector`]'s kernels built on `exp`: lane for
//! lane the AVX2 ones (the same operations in the same order on each lane,
//! and sums accumulated in the AVX2 kernels' eight lanes), so a token's
//! bits do not depend on which of the two families ran.

use std::arch::x86_64::*;

use super::vector::avx2::hsum;
use super::vector::{EXP_LN2_HI, EXP_LN2_LO, EXP_TAYLOR};

/// [`exp_avx2`](super::vector::avx2::exp_avx2) on 16 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp16(x_in: __m512) -> __m512 {
    let floor = _mm512_set1_ps(-104.0);
    let x = _mm512_min_ps(_mm512_max_ps(x_in, floor), _mm512_set1_ps(88.5));
    // Round to nearest even, as `_mm256_round_ps` does.
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_TAYLOR[0]);
    for c in &EXP_TAYLOR[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let n = _mm512_cvtps_epi32(n);
    let half = _mm512_srai_epi32::<1>(n);
    let e = _mm512_mul_ps(
        _mm512_mul_ps(p, pow2(half)),
        pow2(_mm512_sub_epi32(n, half)),
    );
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x_in, floor), e)
}

/// `2^e` per lane for `e` in the normal exponent range.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pow2(e: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        e,
        _mm512_set1_epi32(127),
    )))
}

/// AVX-512 [`softmax_parts`](super::softmax_parts), bit-identical to the
/// AVX2 one.
#[target_feature(enable = "avx2,fma,avx512f")]
pub(crate) unsafe fn softmax_parts(x: &mut [f32]) -> (f32, f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    // The max is exact in any order.
    let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 16 <= n {
        vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(p.add(i)));
        i += 16;
    }
    let mut max = _mm512_reduce_max_ps(vmax);
    for &v in &x[i..] {
        max = max.max(v);
    }
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return (max, 0.0);
    }
    let m = _mm512_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        // The tail's missing lanes read -inf, whose exp is 0, and adding
        // 0 leaves the AVX2 kernel's lane sums as they were.
        let lanes = (n - i).min(16);
        let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
        let v = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, p.add(i));
        let e = exp16(_mm512_sub_ps(v, m));
        _mm512_mask_storeu_ps(p.add(i), mask, e);
        vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
        vsum = _mm256_add_ps(vsum, high_half(e));
        i += 16;
    }
    (max, hsum(vsum))
}

/// Lanes 8..16 of `v`, moved as four doubles: AVX-512 F alone
/// (`_mm512_extractf32x8_ps` is AVX-512 DQ, which the family does not
/// check, and outside a function that enables it the intrinsic is not
/// inlined but called).
#[inline(always)]
unsafe fn high_half(v: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu;
    use crate::kernels::testutil::Rng;
    use crate::kernels::vector::avx2;

    /// Every length around the 8- and 16-lane edges, with masked entries,
    /// scores close enough that many terms shape the sum and spread wide
    /// enough to reach exp's clamps.
    #[test]
    fn softmax_parts_equal_the_avx2_kernel_bit_for_bit() {
        if !cpu::has_avx512() {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut rng = Rng::new(41);
        let lengths = (0..50).chain([127, 128, 129, 1000]);
        for (n, spread) in lengths.flat_map(|n| [(n, 0.5), (n, 3.0), (n, 40.0)]) {
            let mut x: Vec<f32> = rng.normals(n).iter().map(|v| v * spread).collect();
            for masked in x.iter_mut().step_by(7).skip(1) {
                *masked = f32::NEG_INFINITY;
            }
            let (mut a, mut b) = (x.clone(), x.clone());
            // SAFETY: AVX-512 F, AVX2 and FMA are present.
            let (got, want) = unsafe { (softmax_parts(&mut a), avx2::softmax_parts(&mut b)) };
            assert_eq!(
                got.0.to_bits(),
                want.0.to_bits(),
                "n={n} spread {spread}: max"
            );
            assert_eq!(
                got.1.to_bits(),
                want.1.to_bits(),
                "n={n} spread {spread}: sum"
            );
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "n={n} spread {spread}: exps differ");
        }
    }
}
