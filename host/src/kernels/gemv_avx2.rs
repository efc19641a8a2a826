//! AVX2 integer block sums for the [`gemv`](super::gemv) kernels
//! (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 method, on our repacked layout);
//! the driver and the float part are shared with AVX-512 in
//! [`gemv_simd`](super::gemv_simd).
//!
//! Per block of 32: unpack the weight quants to 32 unsigned bytes,
//! `maddubs` them against the activation quants (32 products summed in
//! pairs to i16, which cannot saturate: |pair| <= 2 * 128 * 127), `madd` by
//! ones (to 8 x i32 partial sums). Q8_0 weights are signed, so we multiply
//! `|w|` by `x` carrying `w`'s sign instead. Eight blocks' partial sums are
//! then reduced to eight exact block sums with horizontal adds.
//!
//! CPUs with AVX-VNNI (256-bit `vpdpbusd`, u8 x i8 summed in fours into
//! i32 lanes) replace `maddubs` + `madd` by that one instruction and keep
//! everything else, so the same code serves both (`Avx2<VNNI>`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::gemv_simd::{BlockSums, Tokens, GROUP};
use super::quant::Q8Acts;
use super::weights::{WeightMatrix, QK};
use super::OutPtr;

/// AVX2 [`gemv_rows`](super::gemv::gemv_rows).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out` must be valid for
/// `n_tokens * w.rows()` values, and no other thread may write these rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv_rows(
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    super::gemv_simd::gemv_rows::<Avx2<false>>(w, acts, n_tokens, rows, out);
}

/// AVX-VNNI [`gemv_rows`](super::gemv::gemv_rows).
///
/// # Safety
/// As [`gemv_rows`], and the CPU must support AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn gemv_rows_vnni(
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    super::gemv_simd::gemv_rows::<Avx2<true>>(w, acts, n_tokens, rows, out);
}

/// The AVX2 [`BlockSums`]; `VNNI` uses AVX-VNNI's `vpdpbusd`.
struct Avx2<const VNNI: bool>;

impl<const VNNI: bool> BlockSums for Avx2<VNNI> {
    #[inline(always)]
    unsafe fn sums8<const Q4: bool, const NT: usize>(
        qs: *const u8,
        g: usize,
        n: usize,
        x: &Tokens<NT>,
    ) -> [__m256i; NT] {
        // Unsigned weight bytes, and for Q8 the signs to move onto `x`;
        // missing blocks stay zero and are never loaded.
        let mut wu = [_mm256_setzero_si256(); GROUP];
        let mut wsign = [_mm256_setzero_si256(); GROUP];
        for j in 0..n {
            let b = g + j;
            if Q4 {
                let low4 = _mm_set1_epi8(0x0F);
                let raw = _mm_loadu_si128(qs.add(b * QK / 2).cast());
                let lo = _mm_and_si128(raw, low4);
                let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                wu[j] = _mm256_set_m128i(hi, lo);
            } else {
                let raw = _mm256_loadu_si256(qs.add(b * QK).cast());
                wu[j] = _mm256_sign_epi8(raw, raw);
                wsign[j] = raw;
            }
        }
        // Loops, not `array::from_fn`: a closure is compiled without this
        // function's target features, so its intrinsics would not inline.
        let mut sums = [_mm256_setzero_si256(); NT];
        for (t, sums) in sums.iter_mut().enumerate() {
            let mut parts = [_mm256_setzero_si256(); GROUP];
            for j in 0..n {
                let mut xv = _mm256_loadu_si256(x.qs[t].add((g + j) * QK).cast());
                if !Q4 {
                    xv = _mm256_sign_epi8(xv, wsign[j]);
                }
                parts[j] = if VNNI {
                    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wu[j], xv)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(wu[j], xv), _mm256_set1_epi16(1))
                };
            }
            *sums = reduce8(parts);
        }
        sums
    }
}

/// Lane `j` = the sum of the eight lanes of `p[j]`.
#[inline(always)]
unsafe fn reduce8(p: [__m256i; GROUP]) -> __m256i {
    // Within each 128-bit half: [p0, p1, p2, p3] partial sums of that half.
    let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    // Low halves of both, plus high halves of both.
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(h0123, h4567),
        _mm256_permute2x128_si256::<0x31>(h0123, h4567),
    )
}
