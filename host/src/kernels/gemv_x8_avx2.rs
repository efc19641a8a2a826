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
//! The float part is the scalar path's, per lane: `acc += (d_w * d_x) *
//! isum (+ m_w * s_x)`, block after block, without FMA. So the result is
//! bit for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.

use std::arch::x86_64::*;
use std::ops::Range;

use super::interleaved::{Q4X8_RECORD, Q8X8_QUANTS, X8_ROWS};
use super::quant::Q8Acts;
use super::weights::QK;
use super::OutPtr;

/// Tokens that share one pass over a group's records (their sums live in
/// registers: four integer and four f32 accumulators).
const TOKENS: usize = 4;

/// An interleaved matrix's data, borrowed from its `Packed` variant.
#[derive(Clone, Copy)]
pub(crate) enum X8<'a> {
    /// `Packed::Q4x8`'s records.
    Q4(&'a [u8]),
    /// `Packed::Q8x8`'s quants and scales.
    Q8(&'a [u8], &'a [u16]),
}

/// Computes `out[t * n_rows + r]` for `r` in `rows` and every token of
/// `acts`, for an interleaved matrix of `n_rows` rows with `blocks` blocks
/// per row. Groups that `rows` covers only in part are computed whole and
/// stored in part.
///
/// # Safety
/// The CPU must support AVX2 and F16C (the caller's check); the quants must
/// be 32-byte aligned; `out` must be valid for `n_tokens * n_rows` values,
/// and no other thread may write these rows.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn gemv_rows(
    w: X8,
    n_rows: usize,
    blocks: usize,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    let records = n_rows.div_ceil(X8_ROWS) * blocks;
    match w {
        X8::Q4(data) => assert!(data.len() >= records * Q4X8_RECORD),
        X8::Q8(qs, d) => assert!(qs.len() >= records * Q8X8_QUANTS && d.len() >= records * X8_ROWS),
    }
    assert!(
        rows.end <= n_rows,
        "rows {rows:?} past the matrix's {n_rows}"
    );
    for g in rows.start / X8_ROWS..rows.end.div_ceil(X8_ROWS) {
        let first = (g * X8_ROWS).max(rows.start);
        let at = Place {
            n_rows,
            first,
            lane: first - g * X8_ROWS,
            len: ((g + 1) * X8_ROWS).min(rows.end) - first,
        };
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(TOKENS);
            // SAFETY: the caller's contract; the group's `blocks` records
            // are in bounds (asserted above).
            unsafe {
                match w {
                    X8::Q4(data) => {
                        let group = data.as_ptr().add(g * blocks * Q4X8_RECORD);
                        match nt {
                            1 => tile_q4::<1>(group, blocks, acts, t0, at, out),
                            2 => tile_q4::<2>(group, blocks, acts, t0, at, out),
                            3 => tile_q4::<3>(group, blocks, acts, t0, at, out),
                            _ => tile_q4::<TOKENS>(group, blocks, acts, t0, at, out),
                        }
                    }
                    X8::Q8(qs, d) => {
                        let group = (
                            qs.as_ptr().add(g * blocks * Q8X8_QUANTS),
                            d.as_ptr().add(g * blocks * X8_ROWS),
                        );
                        match nt {
                            1 => tile_q8::<1>(group, blocks, acts, t0, at, out),
                            2 => tile_q8::<2>(group, blocks, acts, t0, at, out),
                            3 => tile_q8::<3>(group, blocks, acts, t0, at, out),
                            _ => tile_q8::<TOKENS>(group, blocks, acts, t0, at, out),
                        }
                    }
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

/// Tokens `t0 .. t0 + NT` of `acts`: quants, block scales, block `d * sum(q)`.
struct Tokens<const NT: usize> {
    xq: [*const i8; NT],
    dx: [*const f32; NT],
    sx: [*const f32; NT],
}

impl<const NT: usize> Tokens<NT> {
    fn new(acts: &Q8Acts, t0: usize) -> Tokens<NT> {
        let mut x = Tokens {
            xq: [std::ptr::null(); NT],
            dx: [std::ptr::null(); NT],
            sx: [std::ptr::null(); NT],
        };
        for t in 0..NT {
            x.xq[t] = acts.row_qs(t0 + t).as_ptr();
            let (d, s) = acts.row_scales(t0 + t);
            (x.dx[t], x.sx[t]) = (d.as_ptr(), s.as_ptr());
        }
        x
    }

    /// Token `t`'s four activation bytes from column `col`, in every lane.
    #[inline(always)]
    unsafe fn four(&self, t: usize, col: usize) -> __m256i {
        _mm256_set1_epi32(self.xq[t].add(col).cast::<i32>().read_unaligned())
    }
}

/// One 4-bit group's eight rows times tokens `t0 .. t0 + NT`.
///
/// # Safety
/// As [`gemv_rows`]; `group` points at the group's `blocks` records and
/// `acts` holds the tokens.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tile_q4<const NT: usize>(
    group: *const u8,
    blocks: usize,
    acts: &Q8Acts,
    t0: usize,
    at: Place,
    out: OutPtr,
) {
    let x = Tokens::<NT>::new(acts, t0);
    let (low4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); NT];
    for b in 0..blocks {
        let rec = group.add(b * Q4X8_RECORD);
        let mut pairs = [_mm256_setzero_si256(); NT];
        for s in 0..4 {
            let raw = _mm256_load_si256(rec.add(32 * s).cast());
            let lo = _mm256_and_si256(raw, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
            for (t, pairs) in pairs.iter_mut().enumerate() {
                let col = b * QK + 4 * s;
                let both = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, x.four(t, col)),
                    _mm256_maddubs_epi16(hi, x.four(t, col + QK / 2)),
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
    store(acc, t0, at, out);
}

/// One 8-bit group's eight rows times tokens `t0 .. t0 + NT`.
///
/// # Safety
/// As [`gemv_rows`]; `group` points at the group's `blocks` records of
/// quants and their scales, and `acts` holds the tokens.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tile_q8<const NT: usize>(
    (qs, d): (*const u8, *const u16),
    blocks: usize,
    acts: &Q8Acts,
    t0: usize,
    at: Place,
    out: OutPtr,
) {
    let x = Tokens::<NT>::new(acts, t0);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); NT];
    for b in 0..blocks {
        let rec = qs.add(b * Q8X8_QUANTS);
        let mut sums = [_mm256_setzero_si256(); NT];
        for s in 0..QK / 4 {
            let raw = _mm256_load_si256(rec.add(32 * s).cast());
            let abs = _mm256_sign_epi8(raw, raw);
            for (t, sums) in sums.iter_mut().enumerate() {
                let xs = _mm256_sign_epi8(x.four(t, b * QK + 4 * s), raw);
                let pairs = _mm256_maddubs_epi16(abs, xs);
                *sums = _mm256_add_epi32(*sums, _mm256_madd_epi16(pairs, ones));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(d.add(b * X8_ROWS).cast()));
        for t in 0..NT {
            let isum = _mm256_cvtepi32_ps(sums[t]);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*x.dx[t].add(b)));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, isum));
        }
    }
    store(acc, t0, at, out);
}

/// Stores the lanes `at` names of each token's accumulator.
#[inline(always)]
unsafe fn store<const NT: usize>(acc: [__m256; NT], t0: usize, at: Place, out: OutPtr) {
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
