//! The SIMD [`gemv_rows`](super::gemv::gemv_rows) driver shared by the AVX2
//! and AVX-512 VNNI kernels, which differ only in how they compute integer
//! block sums ([`BlockSums`]).
//!
//! Results are bit-identical to the scalar path, so a token's logits do not
//! depend on which CPU (or forced path) computed them. Integer block sums are
//! exact whatever the instructions, so what must match is the float part:
//! the scalar path adds, block after block, `(d_w * d_x) * isum + m_w * s_x`
//! (Q4) or `(d_w * d_x) * isum` (Q8) to one accumulator that starts at 0.
//! We compute those per-block terms for eight blocks at a time in one vector,
//! with the same operations in the same order (no FMA: a fused multiply-add
//! rounds once where the scalar code rounds twice), then add the eight lanes
//! to the accumulator in block order. That serial add is one scalar add per
//! block and token; rows and tokens are independent chains, so out-of-order
//! execution overlaps them.

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

/// Blocks whose sums one [`BlockSums::sums8`] call returns.
pub(crate) const GROUP: usize = 8;

/// Pointers to the quantized activations of `NT` tokens.
pub(crate) struct Tokens<const NT: usize> {
    /// Quants of each token.
    pub(crate) qs: [*const i8; NT],
    /// Block scales of each token (padded to a multiple of 8 with zeros).
    pub(crate) d: [*const f32; NT],
    /// Block `d * sum(q)` of each token, padded like `d`.
    pub(crate) s: [*const f32; NT],
    /// Block `sum(q)` of each token, padded like `d`.
    pub(crate) sums: [*const i32; NT],
}

/// How one instruction set computes exact integer block sums.
pub(crate) trait BlockSums {
    /// For each token `t`, lane `j` = the exact integer dot product of block
    /// `g + j` of the weight row at `qs` (`Q4`: 16 bytes per block, unsigned
    /// nibbles; else 32 signed bytes) with the token's block `g + j`, for
    /// `j < n` (`1 <= n <= 8`). Lanes `n..` are unspecified, and nothing
    /// past block `g + n` of the row or of the activations is read.
    ///
    /// # Safety
    /// The CPU supports the implementation's features; the row and the
    /// activations hold at least `g + n` blocks.
    unsafe fn sums8<const Q4: bool, const NT: usize>(
        qs: *const u8,
        g: usize,
        n: usize,
        x: &Tokens<NT>,
    ) -> [__m256i; NT];
}

/// Computes `out[t * rows + r]` for `r` in `rows` and every token of `acts`.
///
/// # Safety
/// The CPU supports AVX2, FMA, F16C and `K`'s features, and the caller's
/// `#[target_feature]` function enables them (this is inlined into it);
/// `out` holds `n_tokens * w.rows()` values and no other thread writes these rows.
#[inline(always)]
pub(crate) unsafe fn gemv_rows<K: BlockSums>(
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
                1 => chunk_rows::<K, 1>(w, acts, chunk.clone(), t0, out),
                2 => chunk_rows::<K, 2>(w, acts, chunk.clone(), t0, out),
                3 => chunk_rows::<K, 3>(w, acts, chunk.clone(), t0, out),
                _ => chunk_rows::<K, 4>(w, acts, chunk.clone(), t0, out),
            }
            t0 += nt;
        }
        r0 = chunk.end;
    }
}

/// Rows `rows` times tokens `t0 .. t0 + NT`; the per-call setup is hoisted
/// out of the row loop, which matters for short (576-column) rows.
#[inline(always)]
unsafe fn chunk_rows<K: BlockSums, const NT: usize>(
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
        sums: std::array::from_fn(|t| acts.row_sums(t0 + t).as_ptr()),
    };
    let store = |r: usize, sums: [f32; NT]| {
        for (t, v) in sums.into_iter().enumerate() {
            out.write((t0 + t) * n_rows + r, v);
        }
    };
    match &w.data {
        Packed::Q4 { qs, d, m } => {
            let (q, d, m) = (qs.as_slice().as_ptr(), d.as_ptr(), m.as_ptr());
            for r in rows {
                let (qr, dr, mr) = (q.add(r * cols / 2), d.add(r * blocks), m.add(r * blocks));
                store(r, dot::<K, true, NT>(qr, dr, mr, blocks, &x));
            }
        }
        Packed::Q8 { qs, d } => {
            let (q, d) = (qs.as_slice().as_ptr(), d.as_ptr());
            for r in rows {
                let (qr, dr) = (q.add(r * cols), d.add(r * blocks));
                store(r, dot::<K, false, NT>(qr, dr, std::ptr::null(), blocks, &x));
            }
        }
        Packed::F32(_) | Packed::F16(_) | Packed::BF16(_) => {
            unreachable!("gemv is only for quantized weights")
        }
    }
}

/// Eight f16 values `src[0 .. 8]` as f32. Scale arrays end with
/// [`SCALE_PAD`](super::weights::SCALE_PAD) zeros, so this is in bounds at
/// any block of any row (lanes past the row hold the next row's scales and
/// are never added).
#[inline(always)]
unsafe fn load8_f16(src: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(src.cast()))
}

/// Dot products of one weight row (scales `d`, Q4 minimums `m`) with `NT`
/// activation rows, in the scalar path's float order (see the module docs).
#[inline(always)]
unsafe fn dot<K: BlockSums, const Q4: bool, const NT: usize>(
    qs: *const u8,
    d: *const u16,
    m: *const u16,
    blocks: usize,
    x: &Tokens<NT>,
) -> [f32; NT] {
    let mut acc = [0f32; NT];
    let mut g = 0;
    while g < blocks {
        let n = (blocks - g).min(GROUP);
        // A literal 8 for whole groups lets the compiler drop the tail
        // handling (masks, bounds) from the hot loop.
        let sums = if n == GROUP {
            K::sums8::<Q4, NT>(qs, g, GROUP, x)
        } else {
            K::sums8::<Q4, NT>(qs, g, n, x)
        };
        let dw = load8_f16(d.add(g));
        let mw = if Q4 {
            load8_f16(m.add(g))
        } else {
            _mm256_setzero_ps()
        };
        for t in 0..NT {
            // `Q8Acts` pads its scale rows to a multiple of 8 with zeros.
            let dx = _mm256_loadu_ps(x.d[t].add(g));
            let mut v = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sums[t]));
            if Q4 {
                v = _mm256_add_ps(v, _mm256_mul_ps(mw, _mm256_loadu_ps(x.s[t].add(g))));
            }
            let mut terms = [0f32; GROUP];
            _mm256_storeu_ps(terms.as_mut_ptr(), v);
            for &term in &terms[..n] {
                acc[t] += term;
            }
        }
        g += GROUP;
    }
    acc
}
