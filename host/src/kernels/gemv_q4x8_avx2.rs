//! 4-bit weights with eight rows interleaved ([`Packed::Q4x8`]) times any
//! number of tokens, on AVX2: the AVX2 family's 4-bit kernel for decode and
//! prefill alike.
//!
//! The row-major kernel ([`gemv_simd`](super::gemv_simd)) multiplies one
//! row's block by one token's block, so each vector's eight lanes must be
//! added into one block sum per row and token, and it streams a dozen arrays
//! at once (quants, scales and minimums of four rows). Here one 32-byte load
//! holds four quant bytes of each of eight rows: masking its low and high
//! nibbles gives columns `4s .. 4s + 4` and `16 + 4s .. 20 + 4s` of the
//! block for all eight rows, one row per 32-bit lane. Broadcasting a token's
//! four activation bytes of those columns and `maddubs`-ing them against it
//! gives eight rows' partial sums in eight lanes: no horizontal sums, and
//! the float part works on eight rows per instruction. The matrix is one
//! sequential stream per group of eight rows.
//!
//! Exactness: weights are 0..=15 and activations -127..=127, so a `maddubs`
//! pair is at most 3810 in magnitude and the eight of a block (30480) fit
//! the i16 lanes; `madd` by ones then widens to the exact i32 block sum.
//! The float part is the scalar path's, per lane: `acc += (d_w * d_x) *
//! isum + m_w * s_x`, block after block, without FMA. So the result is bit
//! for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.
//!
//! [`Packed::Q4x8`]: super::weights::Packed::Q4x8

use std::arch::x86_64::*;
use std::ops::Range;

use super::quant::Q8Acts;
use super::weights::{QK, X8_RECORD, X8_ROWS};
use super::OutPtr;

/// Tokens that share one pass over a group's records (their sums live in
/// registers: four i16 and four f32 accumulators).
const TOKENS: usize = 4;

/// Computes `out[t * n_rows + r]` for `r` in `rows` and every token of
/// `acts`, for a [`Packed::Q4x8`](super::weights::Packed::Q4x8) matrix
/// `data` of `n_rows` rows with `blocks` blocks per row. Groups that
/// `rows` covers only in part are computed whole and stored in part.
///
/// # Safety
/// The CPU must support AVX2 and F16C (the caller's check); `data` must be
/// 32-byte aligned; `out` must be valid for `n_tokens * n_rows` values, and
/// no other thread may write these rows.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn gemv_rows(
    data: &[u8],
    n_rows: usize,
    blocks: usize,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    assert!(rows.end <= n_rows && data.len() >= n_rows.div_ceil(X8_ROWS) * blocks * X8_RECORD);
    for g in rows.start / X8_ROWS..rows.end.div_ceil(X8_ROWS) {
        let first = (g * X8_ROWS).max(rows.start);
        let at = Place {
            n_rows,
            first,
            lane: first - g * X8_ROWS,
            len: ((g + 1) * X8_ROWS).min(rows.end) - first,
        };
        let group = data.as_ptr().add(g * blocks * X8_RECORD);
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(TOKENS);
            // SAFETY: the caller's contract; `group` holds `blocks` records.
            unsafe {
                match nt {
                    1 => tile::<1>(group, blocks, acts, t0, at, out),
                    2 => tile::<2>(group, blocks, acts, t0, at, out),
                    3 => tile::<3>(group, blocks, acts, t0, at, out),
                    _ => tile::<TOKENS>(group, blocks, acts, t0, at, out),
                }
            }
            t0 += nt;
        }
    }
}

/// Where a group's results go: its lanes `lane .. lane + len` are rows
/// `first .. first + len` of an output with `n_rows` values per token.
#[derive(Clone, Copy)]
struct Place {
    n_rows: usize,
    first: usize,
    lane: usize,
    len: usize,
}

/// One group's eight rows times tokens `t0 .. t0 + NT`, stored into `out`.
///
/// # Safety
/// As [`gemv_rows`]; `group` points at the group's `blocks` records and
/// `acts` holds the tokens.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tile<const NT: usize>(
    group: *const u8,
    blocks: usize,
    acts: &Q8Acts,
    t0: usize,
    at: Place,
    out: OutPtr,
) {
    let mut xq = [std::ptr::null::<i8>(); NT];
    let (mut dx, mut sx) = ([std::ptr::null::<f32>(); NT], [std::ptr::null::<f32>(); NT]);
    for t in 0..NT {
        xq[t] = acts.row_qs(t0 + t).as_ptr();
        let (d, s) = acts.row_scales(t0 + t);
        (dx[t], sx[t]) = (d.as_ptr(), s.as_ptr());
    }
    let (low4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); NT];
    for b in 0..blocks {
        let rec = group.add(b * X8_RECORD);
        let mut pairs = [_mm256_setzero_si256(); NT];
        for s in 0..4 {
            let raw = _mm256_load_si256(rec.add(32 * s).cast());
            let lo = _mm256_and_si256(raw, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
            for t in 0..NT {
                let x = xq[t].add(b * QK + 4 * s);
                let xlo = _mm256_set1_epi32(x.cast::<i32>().read_unaligned());
                let xhi = _mm256_set1_epi32(x.add(QK / 2).cast::<i32>().read_unaligned());
                let both =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
                pairs[t] = _mm256_add_epi16(pairs[t], both);
            }
        }
        let scales = _mm256_load_si256(rec.add(4 * 32).cast());
        let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(scales));
        let mw = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(scales));
        for t in 0..NT {
            let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[t], ones));
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*dx[t].add(b)));
            let min = _mm256_mul_ps(mw, _mm256_set1_ps(*sx[t].add(b)));
            let term = _mm256_add_ps(_mm256_mul_ps(scale, isum), min);
            acc[t] = _mm256_add_ps(acc[t], term);
        }
    }
    for (t, acc) in acc.into_iter().enumerate() {
        let dst = out.ptr().add((t0 + t) * at.n_rows + at.first);
        if at.len == X8_ROWS {
            _mm256_storeu_ps(dst, acc);
        } else {
            let mut lanes = [0f32; X8_ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            std::ptr::copy_nonoverlapping(lanes.as_ptr().add(at.lane), dst, at.len);
        }
    }
}
