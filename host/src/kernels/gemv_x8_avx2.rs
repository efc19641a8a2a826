//! Quantized weights with eight rows interleaved ([`interleaved`](super::interleaved))
//! times any number of tokens, on AVX2: the AVX2 family's kernels for
//! decode and prefill alike.
//!
//! The row-major kernels ([`gemv_simd`](super::gemv_simd)) multiply one
//! row's block by one token's block, so each vector's eight lanes must be
//! added into one block sum per row and token, and they stream a dozen
//! arrays at once (quants, scales and minimums of four rows). Here one
//! 32-byte load holds four quant bytes of each of eight rows, one row per
//! 32-bit lane. Broadcasting a token's four activation bytes of those
//! columns and `maddubs`-ing them against it gives eight rows' partial sums
//! in eight lanes: no horizontal sums, and the float part works on eight
//! rows per instruction.
//!
//! - 4-bit: masking a load's low and high nibbles gives columns
//!   `4s .. 4s + 4` and `16 + 4s .. 20 + 4s` of the block. Weights are
//!   0..=15 and activations -127..=127, so a `maddubs` pair is at most 3810
//!   in magnitude and the eight of a block (30480) fit the i16 lanes;
//!   `madd` by ones then widens to the exact i32 block sum.
//! - 8-bit: weights are signed, so `maddubs` takes `|w|` and `x` with
//!   `w`'s sign (a pair is at most 2 * 128 * 127 = 32512, no saturation)
//!   and every product is widened by `madd` at once.
//!
//! Decode reads each matrix from memory once, and on some cores (AMD Zen 1)
//! the hardware prefetcher alone leaves a core waiting on every few lines;
//! so the first tile of tokens over a group also asks for the weights a
//! little way ahead ([`prefetch_ahead`]; later tiles find the group in L1).
//!
//! The float part is the scalar path's, per lane: `acc += (d_w * d_x) *
//! isum (+ m_w * s_x)`, block after block, without FMA. So the result is
//! bit for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.

use std::arch::x86_64::*;

use super::group_tiles::{prefetch_ahead, GroupTiles, Job, Place, Tokens};
use super::interleaved::{q4_record, q8_quants, AVX2_GROUP};
use super::weights::QK;

/// Runs `job` on a matrix in groups of [`AVX2_GROUP`] rows.
///
/// # Safety
/// The CPU must support AVX2 and F16C (the caller's check); the data must
/// be 64-byte aligned; `out` must be valid for `n_tokens * n_rows` values,
/// and no other thread may write these rows.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn gemv_rows(job: Job) {
    super::group_tiles::gemv_rows::<Avx2>(job);
}

/// The AVX2 [`GroupTiles`].
struct Avx2;

/// Token `t`'s four activation bytes from column `col`, in every lane.
#[inline(always)]
unsafe fn four<const NT: usize>(x: &Tokens<NT>, t: usize, col: usize) -> __m256i {
    _mm256_set1_epi32(x.word(t, col))
}

impl GroupTiles for Avx2 {
    const GROUP: usize = AVX2_GROUP;

    #[inline(always)]
    unsafe fn tile_q4<const NT: usize>(
        records: *const u8,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    ) {
        store(tile_q4(records, blocks, x), x.t0, at);
    }

    #[inline(always)]
    unsafe fn tile_q8<const NT: usize>(
        qs: *const u8,
        d: *const u16,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    ) {
        store(tile_q8(qs, d, blocks, x), x.t0, at);
    }
}

/// One 4-bit group's eight rows times the tokens of `x`.
#[inline(always)]
unsafe fn tile_q4<const NT: usize>(
    group: *const u8,
    blocks: usize,
    x: &Tokens<NT>,
) -> [__m256; NT] {
    let (low4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); NT];
    let ahead = x.t0 == 0;
    for b in 0..blocks {
        let rec = group.add(b * q4_record(AVX2_GROUP));
        if ahead {
            prefetch_ahead(rec, q4_record(AVX2_GROUP));
        }
        let mut pairs = [_mm256_setzero_si256(); NT];
        for s in 0..4 {
            let raw = _mm256_load_si256(rec.add(32 * s).cast());
            let lo = _mm256_and_si256(raw, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
            for (t, pairs) in pairs.iter_mut().enumerate() {
                let col = b * QK + 4 * s;
                let both = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, four(x, t, col)),
                    _mm256_maddubs_epi16(hi, four(x, t, col + QK / 2)),
                );
                *pairs = _mm256_add_epi16(*pairs, both);
            }
        }
        let scales = _mm256_load_si256(rec.add(4 * 32).cast());
        let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(scales));
        let mw = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(scales));
        for t in 0..NT {
            let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[t], ones));
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.dx[t].add(b)));
            let min = _mm256_mul_ps(mw, _mm256_set1_ps(*x.sx[t].add(b)));
            let term = _mm256_add_ps(_mm256_mul_ps(scale, isum), min);
            acc[t] = _mm256_add_ps(acc[t], term);
        }
    }
    acc
}

/// One 8-bit group's eight rows (quants at `qs`, scales at `d`) times the
/// tokens of `x`.
#[inline(always)]
unsafe fn tile_q8<const NT: usize>(
    qs: *const u8,
    d: *const u16,
    blocks: usize,
    x: &Tokens<NT>,
) -> [__m256; NT] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); NT];
    let ahead = x.t0 == 0;
    for b in 0..blocks {
        let rec = qs.add(b * q8_quants(AVX2_GROUP));
        if ahead {
            prefetch_ahead(rec, q8_quants(AVX2_GROUP));
            prefetch_ahead(d.add(b * AVX2_GROUP).cast(), 1);
        }
        let mut sums = [_mm256_setzero_si256(); NT];
        for s in 0..QK / 4 {
            let raw = _mm256_load_si256(rec.add(32 * s).cast());
            let abs = _mm256_sign_epi8(raw, raw);
            for (t, sums) in sums.iter_mut().enumerate() {
                let xs = _mm256_sign_epi8(four(x, t, b * QK + 4 * s), raw);
                let pairs = _mm256_maddubs_epi16(abs, xs);
                *sums = _mm256_add_epi32(*sums, _mm256_madd_epi16(pairs, ones));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(d.add(b * AVX2_GROUP).cast()));
        for t in 0..NT {
            let isum = _mm256_cvtepi32_ps(sums[t]);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.dx[t].add(b)));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, isum));
        }
    }
    acc
}

/// Stores the lanes `at` names of each token's accumulator.
#[inline(always)]
unsafe fn store<const NT: usize>(acc: [__m256; NT], t0: usize, at: Place) {
    for (t, acc) in acc.into_iter().enumerate() {
        let mut lanes = [0f32; AVX2_GROUP];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        at.store(&lanes, t0 + t);
    }
}
