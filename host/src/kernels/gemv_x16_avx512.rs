//! Quantized weights with sixteen rows interleaved
//! ([`interleaved`](super::interleaved)) times any number of tokens, with
//! AVX-512 VNNI: the AVX-512 family's kernels for decode and prefill alike.
//!
//! One 64-byte load holds four quant bytes of each of sixteen rows, one row
//! per 32-bit lane; `vpdpbusd` multiplies them by a token's four activation
//! bytes of those columns (broadcast to every lane) and adds the four
//! products into the lane, exactly and without saturation. Eight of them
//! give sixteen rows' exact block sums, with no horizontal sums and no
//! widening steps (AVX2 needs `maddubs`, an i16 add and `madd` for eight
//! rows).
//!
//! - 4-bit: a load's low and high nibbles are columns `4s .. 4s + 4` and
//!   `16 + 4s .. 20 + 4s` of the block, unsigned as `vpdpbusd` wants.
//! - 8-bit: weights are signed, so each vector is biased to `w + 128`
//!   (an XOR with 0x80) and the block's sums start at `-128 * sum(x)`
//!   (kept by [`Q8Acts`](super::quant::Q8Acts)): exact, one XOR per vector
//!   shared by the tile's tokens and one broadcast per block and token.
//!
//! Like the AVX2 kernels, the first tile of tokens over a group asks for
//! the weights a little way ahead ([`prefetch_ahead`]): decode streams each
//! matrix from memory once.
//!
//! The float part is the scalar path's, per lane: `acc += (d_w * d_x) *
//! isum (+ m_w * s_x)`, block after block, without FMA. So the result is
//! bit for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.

use std::arch::x86_64::*;

use super::group_tiles::{prefetch_ahead, GroupTiles, Job, Place, Tokens};
use super::interleaved::{q4_record, q8_quants, AVX512_GROUP};
use super::weights::QK;

/// Runs `job` on a matrix in groups of [`AVX512_GROUP`] rows.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VNNI and F16C (the caller's check);
/// the data must be 64-byte aligned; `out` must be valid for
/// `n_tokens * n_rows` values, and no other thread may write these rows.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemv_rows(job: Job) {
    super::group_tiles::gemv_rows::<Avx512>(job);
}

/// The AVX-512 VNNI [`GroupTiles`].
struct Avx512;

/// Token `t`'s four activation bytes from column `col`, in every lane.
#[inline(always)]
unsafe fn four<const NT: usize>(x: &Tokens<NT>, t: usize, col: usize) -> __m512i {
    _mm512_set1_epi32(x.word(t, col))
}

impl GroupTiles for Avx512 {
    const GROUP: usize = AVX512_GROUP;

    #[inline(always)]
    unsafe fn tile_q4<const NT: usize>(
        records: *const u8,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    ) {
        let low4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); NT];
        let ahead = x.t0 == 0;
        for b in 0..blocks {
            let rec = records.add(b * q4_record(AVX512_GROUP));
            if ahead {
                prefetch_ahead(rec, q4_record(AVX512_GROUP));
            }
            let mut sums = [_mm512_setzero_si512(); NT];
            for s in 0..4 {
                let raw = _mm512_load_si512(rec.add(64 * s).cast());
                let lo = _mm512_and_si512(raw, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
                let col = b * QK + 4 * s;
                for (t, sums) in sums.iter_mut().enumerate() {
                    *sums = _mm512_dpbusd_epi32(*sums, lo, four(x, t, col));
                    *sums = _mm512_dpbusd_epi32(*sums, hi, four(x, t, col + QK / 2));
                }
            }
            let scales = _mm512_load_si512(rec.add(4 * 64).cast());
            let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(scales));
            let mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(scales));
            for t in 0..NT {
                let isum = _mm512_cvtepi32_ps(sums[t]);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*x.dx[t].add(b)));
                let min = _mm512_mul_ps(mw, _mm512_set1_ps(*x.sx[t].add(b)));
                let term = _mm512_add_ps(_mm512_mul_ps(scale, isum), min);
                acc[t] = _mm512_add_ps(acc[t], term);
            }
        }
        store(acc, x.t0, at);
    }

    #[inline(always)]
    unsafe fn tile_q8<const NT: usize>(
        qs: *const u8,
        d: *const u16,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    ) {
        let bias = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); NT];
        let ahead = x.t0 == 0;
        for b in 0..blocks {
            let rec = qs.add(b * q8_quants(AVX512_GROUP));
            if ahead {
                prefetch_ahead(rec, q8_quants(AVX512_GROUP));
                prefetch_ahead(d.add(b * AVX512_GROUP).cast(), 1);
            }
            // sum((w + 128) x) - 128 sum(x) = sum(w x), exactly.
            let mut sums = [_mm512_setzero_si512(); NT];
            for (t, sums) in sums.iter_mut().enumerate() {
                *sums = _mm512_set1_epi32(-128 * *x.sums[t].add(b));
            }
            for s in 0..QK / 4 {
                let biased = _mm512_xor_si512(_mm512_load_si512(rec.add(64 * s).cast()), bias);
                for (t, sums) in sums.iter_mut().enumerate() {
                    *sums = _mm512_dpbusd_epi32(*sums, biased, four(x, t, b * QK + 4 * s));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(d.add(b * AVX512_GROUP).cast()));
            for t in 0..NT {
                let isum = _mm512_cvtepi32_ps(sums[t]);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*x.dx[t].add(b)));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, isum));
            }
        }
        store(acc, x.t0, at);
    }
}

/// Stores the lanes `at` names of each token's accumulator.
#[inline(always)]
unsafe fn store<const NT: usize>(acc: [__m512; NT], t0: usize, at: Place) {
    for (t, acc) in acc.into_iter().enumerate() {
        let mut lanes = [0f32; AVX512_GROUP];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        at.store(&lanes, t0 + t);
    }
}
