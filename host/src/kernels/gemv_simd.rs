//! The SIMD [`gemv_rows`](super::gemv::gemv_rows) driver for row-major
//! quantized matrices, shared by the AVX2 and AVX-VNNI kernels, which differ
//! only in how they compute integer block sums ([`BlockSums`]).
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
}

/// How one instruction set computes exact integer block sums.
///
/// Implementations are `#[inline(always)]` functions without target
/// features of their own, inlined into a `#[target_feature]` entry point;
/// they must not call intrinsics from closures, which are compiled as
/// separate functions without the entry point's features, so the
/// intrinsics in them become calls.
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
            // Rows x tokens = 4 (or 3) accumulators that share one vector
            // (see `dot`), so the serial float adds cost a quarter each.
            match nt {
                1 => chunk_rows::<K, 1, 4>(w, acts, chunk.clone(), t0, out),
                2 => chunk_rows::<K, 2, 2>(w, acts, chunk.clone(), t0, out),
                3 => chunk_rows::<K, 3, 1>(w, acts, chunk.clone(), t0, out),
                _ => chunk_rows::<K, 4, 1>(w, acts, chunk.clone(), t0, out),
            }
            t0 += nt;
        }
        r0 = chunk.end;
    }
}

/// One quantized weight matrix as raw pointers (`m` only for Q4).
#[derive(Clone, Copy)]
struct RawRows {
    /// Quants, row after row.
    qs: *const u8,
    /// Scales, `blocks` per row.
    d: *const u16,
    /// Q4 minimums, laid out like `d`; null for Q8.
    m: *const u16,
    /// Bytes of quants per row.
    row_bytes: usize,
    /// Blocks per row.
    blocks: usize,
}

/// Rows `rows` times tokens `t0 .. t0 + NT`, `R` rows at a time; the
/// per-call setup is hoisted out of the row loop, which matters for short
/// (576-column) rows.
#[inline(always)]
unsafe fn chunk_rows<K: BlockSums, const NT: usize, const R: usize>(
    w: &WeightMatrix,
    acts: &Q8Acts,
    rows: Range<usize>,
    t0: usize,
    out: OutPtr,
) {
    let (cols, blocks) = (w.cols(), w.cols() / QK);
    let mut x = Tokens::<NT> {
        qs: [std::ptr::null(); NT],
        d: [std::ptr::null(); NT],
        s: [std::ptr::null(); NT],
    };
    for t in 0..NT {
        let (d, s) = acts.row_scales(t0 + t);
        x.qs[t] = acts.row_qs(t0 + t).as_ptr();
        (x.d[t], x.s[t]) = (d.as_ptr(), s.as_ptr());
    }
    match &w.data {
        Packed::Q4 { qs, d, m } => {
            let (qs, d, m) = (qs.as_slice().as_ptr(), d.as_ptr(), m.as_ptr());
            let raw = RawRows {
                qs,
                d,
                m,
                row_bytes: cols / 2,
                blocks,
            };
            rows_pass::<K, true, NT, R>(raw, rows, &x, t0, w.rows(), out);
        }
        Packed::Q8 { qs, d } => {
            let (qs, d, m) = (qs.as_slice().as_ptr(), d.as_ptr(), std::ptr::null());
            let raw = RawRows {
                qs,
                d,
                m,
                row_bytes: cols,
                blocks,
            };
            rows_pass::<K, false, NT, R>(raw, rows, &x, t0, w.rows(), out);
        }
        Packed::FloatPanels(_) => {
            unreachable!("gemv is only for quantized weights")
        }
        Packed::Q4Interleaved { .. } | Packed::Q8Interleaved { .. } => {
            unreachable!("interleaved rows have their own kernels")
        }
    }
}

/// [`chunk_rows`] for one weight type: `R` rows at a time, then the rest
/// one by one; stores `out[(t0 + t) * n_rows + r]`.
#[inline(always)]
unsafe fn rows_pass<K: BlockSums, const Q4: bool, const NT: usize, const R: usize>(
    w: RawRows,
    rows: Range<usize>,
    x: &Tokens<NT>,
    t0: usize,
    n_rows: usize,
    out: OutPtr,
) {
    let mut r = rows.start;
    while r + R <= rows.end {
        let acc = dot::<K, Q4, NT, R>(w, r, x);
        for (i, acc) in acc.iter().enumerate() {
            for (t, &v) in acc.iter().enumerate() {
                out.write((t0 + t) * n_rows + r + i, v);
            }
        }
        r += R;
    }
    for r in r..rows.end {
        let [acc] = dot::<K, Q4, NT, 1>(w, r, x);
        for (t, v) in acc.into_iter().enumerate() {
            out.write((t0 + t) * n_rows + r, v);
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

/// Dot products of weight rows `r0 .. r0 + R` with `NT` activation rows,
/// in the scalar path's float order (see the module docs). The `R * NT <= 4`
/// accumulators ("chains") share the lanes of one vector, so one vector add
/// advances all of them by a block.
#[inline(always)]
unsafe fn dot<K: BlockSums, const Q4: bool, const NT: usize, const R: usize>(
    w: RawRows,
    r0: usize,
    x: &Tokens<NT>,
) -> [[f32; NT]; R] {
    const { assert!(R * NT <= 4) };
    let blocks = w.blocks;
    let mut acc = _mm_setzero_ps();
    let mut g = 0;
    while g < blocks {
        let n = (blocks - g).min(GROUP);
        // Chain `i * NT + t`'s terms for blocks g .. g + 8; unused chains stay 0.
        let mut terms = [_mm256_setzero_ps(); 4];
        for i in 0..R {
            let (qs, d) = (w.qs.add((r0 + i) * w.row_bytes), w.d.add((r0 + i) * blocks));
            // A literal 8 for whole groups lets the compiler drop the tail
            // handling (masks, bounds) from the hot loop.
            let sums = if n == GROUP {
                K::sums8::<Q4, NT>(qs, g, GROUP, x)
            } else {
                K::sums8::<Q4, NT>(qs, g, n, x)
            };
            let dw = load8_f16(d.add(g));
            let mw = if Q4 {
                load8_f16(w.m.add((r0 + i) * blocks + g))
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
                terms[i * NT + t] = v;
            }
        }
        let cols = transpose(terms);
        acc = if n == GROUP {
            add_in_order(acc, &cols, GROUP)
        } else {
            add_in_order(acc, &cols, n)
        };
        g += GROUP;
    }
    let mut lanes = [0f32; 4];
    _mm_storeu_ps(lanes.as_mut_ptr(), acc);
    let mut out = [[0f32; NT]; R];
    for (i, out) in out.iter_mut().enumerate() {
        out.copy_from_slice(&lanes[i * NT..(i + 1) * NT]);
    }
    out
}

/// Column `j` of the 4 x 8 matrix whose rows are `v`: `[v0[j], .., v3[j]]`.
#[inline(always)]
unsafe fn transpose(v: [__m256; 4]) -> [__m128; GROUP] {
    let (t0, t1) = (
        _mm256_unpacklo_ps(v[0], v[1]),
        _mm256_unpackhi_ps(v[0], v[1]),
    );
    let (t2, t3) = (
        _mm256_unpacklo_ps(v[2], v[3]),
        _mm256_unpackhi_ps(v[2], v[3]),
    );
    // u[k] holds column k in its low half and column k + 4 in its high half.
    let u = [
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xEE>(t0, t2),
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xEE>(t1, t3),
    ];
    let mut cols = [_mm_setzero_ps(); GROUP];
    for k in 0..4 {
        cols[k] = _mm256_castps256_ps128(u[k]);
        cols[k + 4] = _mm256_extractf128_ps::<1>(u[k]);
    }
    cols
}

/// `acc + cols[0] + .. + cols[n - 1]`, left to right: the scalar order.
#[inline(always)]
unsafe fn add_in_order(mut acc: __m128, cols: &[__m128; GROUP], n: usize) -> __m128 {
    for col in &cols[..n] {
        acc = _mm_add_ps(acc, *col);
    }
    acc
}
