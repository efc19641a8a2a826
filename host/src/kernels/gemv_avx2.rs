//! AVX2 versions of the [`gemv`](super::gemv) kernels (llama.cpp's
//! Q4_1 x Q8_1 and Q8_0 x Q8_0 method, on our repacked layout).
//!
//! Per block of 32: unpack the weight quants to 32 unsigned bytes,
//! `maddubs` them against the activation quants (32 products summed in
//! pairs to i16), `madd` by ones (to 8 x i32), convert to f32 and
//! accumulate with the block's scale `d_w * d_x`. Q8_0 weights are signed,
//! so we multiply `|w|` by `x` carrying `w`'s sign instead. Four-bit
//! minimums contribute `m_w * s_x` per block, eight blocks per FMA.

use std::arch::x86_64::*;
use std::ops::Range;

use super::quant::Q8Acts;
use super::weights::{Packed, WeightMatrix, QK};
use super::OutPtr;

/// Most tokens that share one pass over a weight row.
const MAX_TOKENS: usize = 4;

/// Rows per chunk: every token group passes over a chunk while it is still
/// in L1/L2 (64 rows of 576 4-bit columns are 23 KiB).
const ROW_CHUNK: usize = 64;

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
    let mut r0 = rows.start;
    while r0 < rows.end {
        let chunk = r0..(r0 + ROW_CHUNK).min(rows.end);
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(MAX_TOKENS);
            match nt {
                1 => chunk_rows::<1>(w, acts, chunk.clone(), t0, out),
                2 => chunk_rows::<2>(w, acts, chunk.clone(), t0, out),
                3 => chunk_rows::<3>(w, acts, chunk.clone(), t0, out),
                _ => chunk_rows::<4>(w, acts, chunk.clone(), t0, out),
            }
            t0 += nt;
        }
        r0 = chunk.end;
    }
}

/// Rows `rows` times tokens `t0 .. t0 + NT`; the per-call setup is hoisted
/// out of the row loop, which matters for short (576-column) rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_rows<const NT: usize>(
    w: &WeightMatrix,
    acts: &Q8Acts,
    rows: Range<usize>,
    t0: usize,
    out: OutPtr,
) {
    let (cols, blocks, n_rows) = (w.cols(), w.cols() / QK, w.rows());
    let x = Tokens::<NT> {
        qs: std::array::from_fn(|t| acts.row_qs(t0 + t).as_ptr()),
        d: std::array::from_fn(|t| acts.row_scales(t0 + t).0.as_ptr()),
        s: std::array::from_fn(|t| acts.row_scales(t0 + t).1.as_ptr()),
    };
    // Scale pointers may run past a row into the next one and the zero
    // padding at the end, never further (see `load8_f16`).
    let store = |r: usize, sums: [f32; NT]| {
        for (t, v) in sums.into_iter().enumerate() {
            out.write((t0 + t) * n_rows + r, v);
        }
    };
    match &w.data {
        Packed::Q4 { qs, d, m } => {
            let (q, d, m) = (qs.as_slice().as_ptr(), d.as_ptr(), m.as_ptr());
            for r in rows {
                store(
                    r,
                    dot::<true, NT>(
                        q.add(r * cols / 2),
                        d.add(r * blocks),
                        m.add(r * blocks),
                        blocks,
                        &x,
                    ),
                );
            }
        }
        Packed::Q8 { qs, d } => {
            let (q, d) = (qs.as_slice().as_ptr(), d.as_ptr());
            for r in rows {
                store(
                    r,
                    dot::<false, NT>(
                        q.add(r * cols),
                        d.add(r * blocks),
                        std::ptr::null(),
                        blocks,
                        &x,
                    ),
                );
            }
        }
        Packed::F32(_) | Packed::F16(_) | Packed::BF16(_) => {
            unreachable!("gemv is only for quantized weights")
        }
    }
}

/// Pointers to the quantized activations of `NT` tokens.
struct Tokens<const NT: usize> {
    /// Quants of each token.
    qs: [*const i8; NT],
    /// Block scales of each token (padded to a multiple of 8 with zeros).
    d: [*const f32; NT],
    /// Block `d * sum(q)` of each token, padded like `d`.
    s: [*const f32; NT],
}

/// Eight f16 values `src[0 .. 8]` as f32. Scale arrays end with
/// [`SCALE_PAD`](super::weights::SCALE_PAD) zeros, so this is in bounds at
/// any block of any row.
#[inline(always)]
unsafe fn load8_f16(src: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(src.cast()))
}

/// All-ones in lanes `0 .. n`, zero in the others.
#[inline(always)]
unsafe fn first_lanes(n: usize) -> __m256 {
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    ))
}

/// Sum of the 8 lanes.
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// Dot products of one weight row (`Q4`: 16 bytes per block with minimums
/// `m`; else 32 signed bytes per block) with `NT` activation rows.
#[inline(always)]
unsafe fn dot<const Q4: bool, const NT: usize>(
    qs: *const u8,
    d: *const u16,
    m: *const u16,
    blocks: usize,
    x: &Tokens<NT>,
) -> [f32; NT] {
    // Even and odd blocks go to separate accumulators to hide the FMA
    // latency when NT is 1. Every index below is a constant after
    // unrolling, so the accumulators live in registers.
    let mut even = [_mm256_setzero_ps(); NT];
    let mut odd = [_mm256_setzero_ps(); NT];
    let mut acc_min = [_mm256_setzero_ps(); NT];
    let mut scale = [[0f32; 8]; NT];
    let mut g = 0;
    while g < blocks {
        // Lanes past the row's last block hold the next row's scales; they
        // are never used for `d` and are masked out of `m`.
        let dw = load8_f16(d.add(g));
        let mw = if Q4 {
            _mm256_and_ps(load8_f16(m.add(g)), first_lanes(blocks - g))
        } else {
            _mm256_setzero_ps()
        };
        for t in 0..NT {
            // `Q8Acts` pads its scale rows to a multiple of 8 with zeros.
            let dx = _mm256_loadu_ps(x.d[t].add(g));
            _mm256_storeu_ps(scale[t].as_mut_ptr(), _mm256_mul_ps(dw, dx));
            if Q4 {
                let sx = _mm256_loadu_ps(x.s[t].add(g));
                acc_min[t] = _mm256_fmadd_ps(mw, sx, acc_min[t]);
            }
        }
        if blocks - g >= 8 {
            for pair in 0..4 {
                block::<Q4, NT>(qs, g + 2 * pair, &x.qs, &scale, 2 * pair, &mut even);
                block::<Q4, NT>(qs, g + 2 * pair + 1, &x.qs, &scale, 2 * pair + 1, &mut odd);
            }
        } else {
            for j in 0..blocks - g {
                block::<Q4, NT>(qs, g + j, &x.qs, &scale, j, &mut even);
            }
        }
        g += 8;
    }
    std::array::from_fn(|t| hsum(_mm256_add_ps(_mm256_add_ps(even[t], odd[t]), acc_min[t])))
}

/// Adds block `b` of the weight row times block `b` of each token's
/// activations, scaled by `scale[t][j]`, to `acc[t]`.
#[inline(always)]
unsafe fn block<const Q4: bool, const NT: usize>(
    qs: *const u8,
    b: usize,
    xq: &[*const i8; NT],
    scale: &[[f32; 8]; NT],
    j: usize,
    acc: &mut [__m256; NT],
) {
    let (wu, wsign) = if Q4 {
        let low4 = _mm_set1_epi8(0x0F);
        let raw = _mm_loadu_si128(qs.add(b * QK / 2).cast());
        let lo = _mm_and_si128(raw, low4);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        (_mm256_set_m128i(hi, lo), _mm256_setzero_si256())
    } else {
        let raw = _mm256_loadu_si256(qs.add(b * QK).cast());
        (_mm256_sign_epi8(raw, raw), raw)
    };
    for t in 0..NT {
        let mut x = _mm256_loadu_si256(xq[t].add(b * QK).cast());
        if !Q4 {
            x = _mm256_sign_epi8(x, wsign);
        }
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), _mm256_set1_epi16(1));
        acc[t] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(p),
            _mm256_broadcast_ss(&scale[t][j]),
            acc[t],
        );
    }
}
