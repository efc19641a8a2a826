//! The element types a KV cache stores ([`KvElem`]): f32, and the
//! half-width IEEE half and bfloat16 that halve the bytes a long-context
//! decode reads. Float weight matrices are kept in the same three types
//! (see `float_panels`) and widened by the same loads.
//!
//! Attention computes in f32 whatever the cache holds: a row is widened as
//! it is loaded. Widening is exact, so a kernel over half-width rows gives
//! the bits the same kernel gives over the widened rows, and every property
//! of the f32 kernels (batch invariance, agreement between plans) carries
//! over. Only storing rounds, once, when a token's K and V are written.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A KV-cache element: stored from f32 (rounding to nearest, ties to
/// even), loaded back as f32 (exactly).
///
/// # Safety
/// All-zero bytes must be the value 0.0 and every bit pattern a valid
/// value: the cache takes its memory zeroed from the system and hands
/// it out as `&[Self]`.
pub unsafe trait KvElem: Copy + Send + Sync + 'static {
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;

    /// `dst[i] = src[i]` rounded to this type; the slices have equal
    /// lengths.
    fn store(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i]` widened to f32 (exactly); the slices have equal
    /// lengths.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Eight consecutive values at `p`, widened to f32.
    ///
    /// # Safety
    /// `p` points at 8 readable values and the CPU has AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen consecutive values at `p`, widened to f32.
    ///
    /// # Safety
    /// `p` points at 16 readable values and the CPU has AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

// SAFETY: zero bits are 0.0 and every bit pattern is some f32.
unsafe impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

// SAFETY: `f16` is a transparent `u16`: zero bits are +0.0 and every bit
// pattern is some half (a NaN at worst).
unsafe impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    fn widen(src: &[f16], dst: &mut [f32]) {
        widen_with_loads(src, dst);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

// SAFETY: `bf16` is a transparent `u16`: zero bits are +0.0 and every bit
// pattern is some bfloat16 (a NaN at worst).
unsafe impl KvElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    fn store(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }

    fn widen(src: &[bf16], dst: &mut [f32]) {
        widen_with_loads(src, dst);
    }

    /// A bfloat16 is the top half of an f32: widen each to 32 bits and
    /// shift it up.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        )))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        )))
    }
}

/// [`KvElem::widen`] through the type's own vector loads, sixteen or eight
/// values at a time as the active kernel family allows (a library call per
/// eight values cost attention's prefill over a half-width cache a fifth
/// of what widening saved), the rest one at a time.
fn widen_with_loads<E: KvElem>(src: &[E], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: slices of unequal length");
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;

        /// Widens the first multiple of 16 values; returns how many.
        ///
        /// # Safety
        /// The slices have equal lengths and the CPU has AVX-512 F.
        #[target_feature(enable = "avx512f")]
        unsafe fn wide16<E: KvElem>(src: &[E], dst: &mut [f32]) -> usize {
            let n = src.len() / 16 * 16;
            for i in (0..n).step_by(16) {
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), E::load16(src.as_ptr().add(i)));
            }
            n
        }
        /// Widens the first multiple of 8 values; returns how many.
        ///
        /// # Safety
        /// The slices have equal lengths and the CPU has AVX2, FMA, F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn wide8<E: KvElem>(src: &[E], dst: &mut [f32]) -> usize {
            let n = src.len() / 8 * 8;
            for i in (0..n).step_by(8) {
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), E::load8(src.as_ptr().add(i)));
            }
            n
        }
        // SAFETY: equal lengths (asserted); each family's loads run only
        // where it is active.
        if super::cpu::has_avx512() {
            done = unsafe { wide16(src, dst) };
        } else if super::cpu::has_avx2() {
            done = unsafe { wide8(src, dst) };
        }
    }
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = s.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    /// Values that round, values at a tie, and the edges of each format's
    /// range (an f16 overflows to infinity past 65504).
    fn samples() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            65504.0,
            70000.0,
            -1e-8,
            f32::INFINITY,
            3.0e38,
        ];
        v.extend(Rng::new(21).normals(71));
        v
    }

    /// Storing then loading gives the value rounded as the `half` crate
    /// rounds it (round to nearest even), through the scalar loads, the
    /// slice widening and the AVX2 and AVX-512 loads alike.
    fn round_trips<E: KvElem + PartialEq + std::fmt::Debug>(round: fn(f32) -> E) {
        let src = samples();
        let zero: E = round(0.0);
        let mut stored = vec![zero; src.len()];
        E::store(&src, &mut stored);
        for (s, &x) in stored.iter().zip(&src) {
            assert_eq!(s.to_f32().to_bits(), round(x).to_f32().to_bits(), "{x}");
        }
        // Whole vectors and the tails after them (80 values, then 79, 71).
        for skip in [0, 1, 9] {
            let mut widened = vec![f32::NAN; src.len() - skip];
            E::widen(&stored[skip..], &mut widened);
            for (w, &x) in widened.iter().zip(&src[skip..]) {
                assert_eq!(w.to_bits(), round(x).to_f32().to_bits(), "{x} widened");
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn widen8<E: KvElem>(src: &[E], dst: &mut [f32]) {
                _mm256_storeu_ps(dst.as_mut_ptr(), E::load8(src.as_ptr()));
            }
            #[target_feature(enable = "avx512f")]
            unsafe fn widen16<E: KvElem>(src: &[E], dst: &mut [f32]) {
                _mm512_storeu_ps(dst.as_mut_ptr(), E::load16(src.as_ptr()));
            }
            let check = |width: usize, widen: unsafe fn(&[E], &mut [f32])| {
                for (lanes, want) in stored.chunks_exact(width).zip(src.chunks_exact(width)) {
                    let mut got = vec![0f32; width];
                    // SAFETY: the caller checked the CPU; `lanes` and
                    // `got` hold `width` values.
                    unsafe { widen(lanes, &mut got) };
                    for (g, &x) in got.iter().zip(want) {
                        assert_eq!(g.to_bits(), round(x).to_f32().to_bits(), "{x}");
                    }
                }
            };
            if crate::kernels::cpu::has_avx2() {
                check(8, widen8::<E>);
            }
            if crate::kernels::cpu::has_avx512() {
                check(16, widen16::<E>);
            }
        }
    }

    #[test]
    fn each_type_rounds_to_nearest_and_loads_exactly() {
        round_trips(|x| x);
        round_trips(f16::from_f32);
        round_trips(bf16::from_f32);
        assert_eq!(
            f16::from_f32(1.0 + 1.0 / 2048.0).to_f32(),
            1.0,
            "a tie rounds to even"
        );
    }
}
