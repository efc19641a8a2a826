//! Attention's tile kernels: several query heads' scores against a KV tile
//! and their weighted sums of a V tile, over rows of any KV-cache element
//! type ([`KvElem`]), each bit-identical to [`dot`](super::dot) and
//! [`axpy`](super::axpy) per row on the rows widened to f32.
//!
//! The heads that share a KV head go through a tile together. With AVX2,
//! the V pass keeps up to three heads' sums in registers and loads (and
//! widens) each V row once for them; the score pass does the same for a
//! half-width K row, whose widening costs as much as its multiply-adds,
//! while an f32 K row is cheaper read once per head against a query held
//! in registers.
//!
//! The AVX-512 versions (64-wide heads) keep those bits: a score is the
//! AVX2 kernel's four 8-lane accumulators held in two 16-lane ones and
//! reduced by the same tree; a weighted sum is the same fused
//! multiply-add per lane and key, with up to three heads sharing each V row
//! so that twelve independent accumulators keep both FMA units busy (one
//! head's four would wait on each other's latency). Their score pass over
//! half-width K widens a few rows at a time into f32 once for all the heads.

use super::kv_elem::KvElem;
use super::vector::{axpy_portable, dot_portable};

/// Where several heads' vectors and scores against one KV tile lie: head
/// `h`'s vector (its query, or its output) is
/// `[h * head_stride..][..head_dim]`, and its scores of the tile's `keys`
/// rows (the scores [`dot_rows_scaled`] writes, the weights
/// [`axpy_rows`] reads) are `[h * score_stride..][..keys]`.
#[derive(Clone, Copy, Debug)]
pub struct HeadsLayout {
    /// Heads sharing the tile.
    pub heads: usize,
    /// Rows of the tile.
    pub keys: usize,
    /// Width of a row and of a head's vector.
    pub head_dim: usize,
    /// Floats between consecutive heads' scores (at least `keys`).
    pub score_stride: usize,
    /// Floats between consecutive heads' vectors (at least `head_dim`).
    pub head_stride: usize,
}

impl HeadsLayout {
    /// Panics, naming `kernel`, unless every head's vector and scores lie
    /// inside slices of `vectors` and `scores` floats, heads do not overlap,
    /// and a tile of `rows` values holds `keys` rows.
    fn check(&self, kernel: &str, vectors: usize, scores: usize, rows: usize) {
        let last = self.heads.saturating_sub(1);
        assert!(
            self.head_stride >= self.head_dim
                && self.score_stride >= self.keys
                && vectors >= last * self.head_stride + self.head_dim
                && scores >= last * self.score_stride + self.keys
                && rows >= self.keys * self.head_dim,
            "{kernel}: {self:?} does not fit its slices"
        );
    }
}

/// `scores_h[j] = dot(q_h, rows[j]) * scale` for every head `h` of
/// `layout` and each of its `keys` rows: attention's scores of the query
/// heads that share a KV tile, each bit-identical to [`dot`](super::dot)'s
/// on the row widened to f32.
///
/// Panics if a head's query or scores, or the tile, lie outside the
/// slices, or if heads' scores overlap.
pub fn dot_rows_scaled<E: KvElem>(
    layout: HeadsLayout,
    q: &[f32],
    rows: &[E],
    scale: f32,
    scores: &mut [f32],
) {
    layout.check("dot_rows_scaled", q.len(), scores.len(), rows.len());
    let hd = layout.head_dim;
    let rows = &rows[..layout.keys * hd];
    #[cfg(target_arch = "x86_64")]
    if hd == 64 && std::mem::size_of::<E>() < 4 && super::cpu::has_avx2() {
        // SAFETY: the AVX2 family (AVX2, FMA, F16C), and with
        // `has_avx512` AVX-512 F, is present; every head's query and
        // scores, and every row, lie inside (checked above).
        unsafe {
            if super::cpu::has_avx512() {
                avx512::dot_rows_widened_64(layout, q, rows, scale, scores);
            } else {
                avx2::dot_rows_shared_64(layout, q, rows, scale, scores);
            }
        }
        return;
    }
    for h in 0..layout.heads {
        let q = &q[h * layout.head_stride..][..hd];
        let scores = &mut scores[h * layout.score_stride..][..layout.keys];
        #[cfg(target_arch = "x86_64")]
        if super::cpu::has_avx512() && hd == 64 {
            // SAFETY: the AVX-512 family (with AVX2, FMA, F16C) is
            // present; `rows` holds every row (checked above).
            unsafe { avx512::dot_rows_scaled_64(q, rows, scale, scores) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if super::cpu::has_avx2() {
            // SAFETY: the AVX2 family (AVX2, FMA, F16C) is present; `rows`
            // holds every row (checked above).
            unsafe { avx2::dot_rows_scaled(q, rows, scale, scores) };
            continue;
        }
        for (s, row) in scores.iter_mut().zip(rows.chunks_exact(hd.max(1))) {
            *s = dot_portable(q, row) * scale;
        }
    }
}

/// `out_h += Σ_j p_h[j] * rows[j]` for every head `h` of `layout`, with
/// `p_h` its scores (weights) and `out_h` its vector, keys in order:
/// attention's weighted sums of one V tile, each head's bit-identical to
/// one [`axpy`](super::axpy) per row widened to f32.
///
/// Panics if a head's weights or output, or the tile, lie outside the
/// slices, or if heads' outputs overlap.
pub fn axpy_rows<E: KvElem>(layout: HeadsLayout, p: &[f32], rows: &[E], out: &mut [f32]) {
    layout.check("axpy_rows", out.len(), p.len(), rows.len());
    let HeadsLayout {
        heads,
        keys,
        head_dim: hd,
        score_stride,
        head_stride,
    } = layout;
    let rows = &rows[..keys * hd];
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx512() && hd == 64 {
        // SAFETY: the AVX-512 family (with AVX2, FMA, F16C) is present;
        // every head's weights and output lie inside (checked above).
        unsafe { avx512::axpy_rows_64(layout, p, rows, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: the AVX2 family (AVX2, FMA, F16C) is present; every
        // head's weights and output lie inside (checked above).
        unsafe { avx2::axpy_rows(layout, p, rows, out) };
        return;
    }
    for h in 0..heads {
        let p = &p[h * score_stride..][..keys];
        let out = &mut out[h * head_stride..][..hd];
        for (&p, row) in p.iter().zip(rows.chunks_exact(hd.max(1))) {
            axpy_portable(p, row, out);
        }
    }
}

/// Asks the CPU to start loading `data` into its level-2 cache: a hint
/// that changes no result. Attention gives it the next K/V piece, whose
/// blocks lie apart in memory where the hardware prefetcher does not
/// follow.
///
/// Level 2 (`T1`), not level 1: a piece is a burst of up to 64 lines, and
/// on AMD Zen 4 a decode at depth 2048 ran no faster with `T0` than with
/// no prefetch at all (112 against 112 tokens/s), but 30% faster with `T1`
/// or `T2` (146–158), presumably because a `T0` line holds one of level
/// 1's few miss buffers until it arrives and the burst stalls the loads
/// behind it. The weights' own prefetch (`group_tiles::prefetch_ahead`)
/// asks for a line at a time, paced by the work, and stays on `T0`, which
/// measured faster there.
#[inline]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        // SAFETY: prefetching is a hint with no memory access that can
        // fault; the address is inside `data`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// The AVX2 versions; each needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::vector::avx2::{axpy, dot_inline, hsum};
    use super::{HeadsLayout, KvElem};

    /// AVX2 [`dot_rows_scaled`](super::dot_rows_scaled) of half-width
    /// 64-wide rows: up to three heads at a time, each row widened once
    /// for all of them, the queries read from memory (twelve accumulators
    /// and the widened vector fill the registers) and each row's sum
    /// reduced at once by [`dot_inline`]'s tree.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows_shared_64<E: KvElem>(
        layout: HeadsLayout,
        q: &[f32],
        rows: &[E],
        scale: f32,
        scores: &mut [f32],
    ) {
        let mut h = 0;
        while h < layout.heads {
            match layout.heads - h {
                1 => dot_heads_shared_64::<E, 1>(layout, h, q, rows, scale, scores),
                2 => dot_heads_shared_64::<E, 2>(layout, h, q, rows, scale, scores),
                _ => dot_heads_shared_64::<E, 3>(layout, h, q, rows, scale, scores),
            }
            h += 3;
        }
    }

    /// Heads `first..first + G` of [`dot_rows_shared_64`].
    #[inline(always)]
    unsafe fn dot_heads_shared_64<E: KvElem, const G: usize>(
        layout: HeadsLayout,
        first: usize,
        q: &[f32],
        rows: &[E],
        scale: f32,
        scores: &mut [f32],
    ) {
        let pq = q.as_ptr().add(first * layout.head_stride);
        let ps = scores.as_mut_ptr().add(first * layout.score_stride);
        for j in 0..layout.keys {
            let k = rows.as_ptr().add(j * 64);
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for half in [0, 32] {
                for i in 0..4 {
                    let kv = E::load8(k.add(half + 8 * i));
                    for (g, acc) in acc.iter_mut().enumerate() {
                        let qv = _mm256_loadu_ps(pq.add(g * layout.head_stride + half + 8 * i));
                        acc[i] = _mm256_fmadd_ps(qv, kv, acc[i]);
                    }
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
                *ps.add(g * layout.score_stride + j) = hsum(v) * scale;
            }
        }
    }

    /// One head of AVX2 [`dot_rows_scaled`](super::dot_rows_scaled);
    /// `rows` holds `scores.len()` rows of `q.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows_scaled<E: KvElem>(
        q: &[f32],
        rows: &[E],
        scale: f32,
        scores: &mut [f32],
    ) {
        let hd = q.len();
        let mut j = 0;
        if hd == 64 {
            while j + 8 <= scores.len() {
                dot8_rows_64(q, rows.as_ptr().add(j * 64), scale, &mut scores[j..j + 8]);
                j += 8;
            }
        }
        for (j, s) in scores.iter_mut().enumerate().skip(j) {
            *s = dot_inline(q, rows.get_unchecked(j * hd..(j + 1) * hd)) * scale;
        }
    }

    /// Eight rows of 64 against `q`: each row's four accumulators exactly as
    /// [`dot_inline`] builds them, and its horizontal sum in the same tree
    /// (`((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))` over the combined lanes),
    /// done for the eight rows at once by transposing adds instead of one
    /// serial reduction per row. Every row position goes through the same
    /// tree, so the rows enter in the order (0 4 1 5 2 6 3 7) that leaves
    /// their sums in order, and they join the transpose as soon as they are
    /// summed, so that beside the eight query vectors and four accumulators
    /// only a few partial sums are live: no spills.
    #[inline(always)]
    unsafe fn dot8_rows_64<E: KvElem>(q: &[f32], rows: *const E, scale: f32, out: &mut [f32]) {
        let mut qv = [_mm256_setzero_ps(); 8];
        for (i, qv) in qv.iter_mut().enumerate() {
            *qv = _mm256_loadu_ps(q.as_ptr().add(8 * i));
        }
        let row = |r: usize| rows.add(r * 64);
        let a = quad_sum(&qv, [row(0), row(4), row(1), row(5)]);
        let b = quad_sum(&qv, [row(2), row(6), row(3), row(7)]);
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        );
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }

    /// Four rows `[r0, r1, r2, r3]` of [`dot8_rows_64`], partly reduced:
    /// `[r0(s0+s2), r2(s0+s2), r0(s1+s3), r2(s1+s3)]` in the low 128-bit
    /// half and the same of rows r1 and r3 in the high one, `s` being a
    /// row's `lo + hi` over its combined accumulator.
    #[inline(always)]
    unsafe fn quad_sum<E: KvElem>(qv: &[__m256; 8], rows: [*const E; 4]) -> __m256 {
        let lo = pair_sum(qv, rows[0], rows[1]);
        let hi = pair_sum(qv, rows[2], rows[3]);
        _mm256_add_ps(_mm256_unpacklo_ps(lo, hi), _mm256_unpackhi_ps(lo, hi))
    }

    /// Rows `a` and `b` of [`dot8_rows_64`]: `[a.lo + a.hi, b.lo + b.hi]`
    /// of their combined accumulators. The halves are moved by inserts and
    /// an extract, which Zen 1 does in one or two micro-ops each, where a
    /// two-source 128-bit permute takes eight.
    #[inline(always)]
    unsafe fn pair_sum<E: KvElem>(qv: &[__m256; 8], a: *const E, b: *const E) -> __m256 {
        let (a, b) = (row_sum(qv, a), row_sum(qv, b));
        let los = _mm256_insertf128_ps::<1>(a, _mm256_castps256_ps128(b));
        let his = _mm256_insertf128_ps::<0>(b, _mm256_extractf128_ps::<1>(a));
        _mm256_add_ps(los, his)
    }

    /// One row of 64 at `k` against the query in `qv`: [`dot_inline`]'s
    /// four accumulators, combined as `(acc0 + acc1) + (acc2 + acc3)`.
    #[inline(always)]
    unsafe fn row_sum<E: KvElem>(qv: &[__m256; 8], k: *const E) -> __m256 {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(qv[i], E::load8(k.add(8 * i)), *acc);
            *acc = _mm256_fmadd_ps(qv[4 + i], E::load8(k.add(32 + 8 * i)), *acc);
        }
        _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))
    }

    /// AVX2 [`axpy_rows`](super::axpy_rows). For 64-wide heads, up to
    /// three heads at a time, one 32-lane half of their outputs after the
    /// other, each half in twelve registers (four per head) fed by one load
    /// of the half of each V row, so a half-width row is widened once for
    /// all three heads; other widths, [`axpy`] per head and row. Per lane,
    /// the same fused multiply-adds in the same order as [`axpy`] per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_rows<E: KvElem>(
        layout: HeadsLayout,
        p: &[f32],
        rows: &[E],
        out: &mut [f32],
    ) {
        let hd = layout.head_dim;
        if hd != 64 {
            for h in 0..layout.heads {
                let p = &p[h * layout.score_stride..][..layout.keys];
                let out = &mut out[h * layout.head_stride..][..hd];
                for (&p, row) in p.iter().zip(rows.chunks_exact(hd.max(1))) {
                    axpy(p, row, out);
                }
            }
            return;
        }
        let mut h = 0;
        while h < layout.heads {
            for half in [0, 32] {
                match layout.heads - h {
                    1 => heads_half_64::<E, 1>(layout, h, half, p, rows, out),
                    2 => heads_half_64::<E, 2>(layout, h, half, p, rows, out),
                    _ => heads_half_64::<E, 3>(layout, h, half, p, rows, out),
                }
            }
            h += 3;
        }
    }

    /// Lanes `half..half + 32` of heads `first..first + G` of
    /// [`axpy_rows`]. The V loads go one at a time, each into the `G`
    /// heads' accumulators for its lanes, so that the `G` weights, one V
    /// vector and `4 G` accumulators fit in sixteen registers.
    #[inline(always)]
    unsafe fn heads_half_64<E: KvElem, const G: usize>(
        layout: HeadsLayout,
        first: usize,
        half: usize,
        p: &[f32],
        rows: &[E],
        out: &mut [f32],
    ) {
        let po = out.as_mut_ptr().add(first * layout.head_stride + half);
        let pp = p.as_ptr().add(first * layout.score_stride);
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(po.add(g * layout.head_stride + 8 * k));
            }
        }
        for j in 0..layout.keys {
            let row = rows.as_ptr().add(j * 64 + half);
            let mut a = [_mm256_setzero_ps(); G];
            for (g, a) in a.iter_mut().enumerate() {
                *a = _mm256_set1_ps(*pp.add(g * layout.score_stride + j));
            }
            for k in 0..4 {
                let v = E::load8(row.add(8 * k));
                for (acc, a) in acc.iter_mut().zip(a) {
                    acc[k] = _mm256_fmadd_ps(a, v, acc[k]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(po.add(g * layout.head_stride + 8 * k), *acc);
            }
        }
    }
}

/// The AVX-512 versions, for 64-wide heads; each needs AVX-512 F beside
/// the AVX2 family.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::vector::avx2::dot_inline;
    use super::{HeadsLayout, KvElem};

    /// Rows widened at a time by [`dot_rows_widened_64`]: 4 KiB of f32,
    /// which stay in L1 while every head reads them.
    const SLAB: usize = 16;

    /// [`SLAB`] rows of 64 widened to f32, on the stack.
    #[repr(C, align(64))]
    struct Slab([f32; SLAB * 64]);

    /// AVX-512 [`dot_rows_scaled`](super::dot_rows_scaled) of half-width
    /// 64-wide rows: [`SLAB`] rows at a time are widened once into f32 and
    /// every head runs [`dot_rows_scaled_64`] over them. Widening is
    /// exact, so the bits are those of each head widening the rows itself,
    /// with a third of the conversions for SmolLM2's three heads per KV
    /// head (a 512-bit `vcvtph2ps` costs about what the multiply-adds it
    /// feeds do). Sharing one widened row in registers, as the AVX2 kernel
    /// does, would need the three queries (twelve registers), the row's
    /// four and every head's partial sums of the eight-row tree at once.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn dot_rows_widened_64<E: KvElem>(
        layout: HeadsLayout,
        q: &[f32],
        rows: &[E],
        scale: f32,
        scores: &mut [f32],
    ) {
        let mut slab = std::mem::MaybeUninit::<Slab>::uninit();
        let wide = slab.as_mut_ptr().cast::<f32>();
        for first in (0..layout.keys).step_by(SLAB) {
            let n = SLAB.min(layout.keys - first);
            let src = rows.as_ptr().add(first * 64);
            for i in 0..4 * n {
                _mm512_store_ps(wide.add(16 * i), E::load16(src.add(16 * i)));
            }
            // SAFETY: the first `n` rows of the slab were written above.
            let widened = std::slice::from_raw_parts(wide, n * 64);
            for h in 0..layout.heads {
                let q = &q[h * layout.head_stride..][..64];
                let scores = &mut scores[h * layout.score_stride + first..][..n];
                dot_rows_scaled_64(q, widened, scale, scores);
            }
        }
    }

    /// One head of AVX-512 [`dot_rows_scaled`](super::dot_rows_scaled)
    /// for 64-wide rows: eight rows at a time, the rest as [`dot_inline`] (the same
    /// bits either way).
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn dot_rows_scaled_64<E: KvElem>(
        q: &[f32],
        rows: &[E],
        scale: f32,
        scores: &mut [f32],
    ) {
        let mut qv = [_mm512_setzero_ps(); 4];
        for (i, qv) in qv.iter_mut().enumerate() {
            *qv = _mm512_loadu_ps(q.as_ptr().add(16 * i));
        }
        let mut j = 0;
        while j + 8 <= scores.len() {
            dot8_rows_64(
                &qv,
                rows.as_ptr().add(j * 64),
                scale,
                scores.as_mut_ptr().add(j),
            );
            j += 8;
        }
        for (j, s) in scores.iter_mut().enumerate().skip(j) {
            *s = dot_inline(q, rows.get_unchecked(j * 64..(j + 1) * 64)) * scale;
        }
    }

    /// Eight rows of 64 against `q` (`qv`: its four 16-lane pieces). The
    /// AVX2 kernel keeps four 8-lane accumulators per row, the first over
    /// keys 0..8 then 32..40, the second 8..16 then 40..48, and so on, and
    /// sums them as `(acc0 + acc1) + (acc2 + acc3)`, then the eight lanes as
    /// `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`. Here `a` is `[acc0 | acc1]`
    /// and `b` `[acc2 | acc3]`, and the eight rows' sums are formed by
    /// shuffles that add exactly those pairs.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn dot8_rows_64<E: KvElem>(qv: &[__m512; 4], rows: *const E, scale: f32, out: *mut f32) {
        // Per pair of rows: [v_r0 | v_r1], each v = (acc0 + acc1) + (acc2 + acc3).
        let mut w = [_mm512_setzero_ps(); 4];
        for (pair, w) in w.iter_mut().enumerate() {
            let mut ab = [[_mm512_setzero_ps(); 2]; 2];
            for (r, ab) in ab.iter_mut().enumerate() {
                let k = rows.add((2 * pair + r) * 64);
                let zero = _mm512_setzero_ps();
                let a = _mm512_fmadd_ps(qv[0], E::load16(k), zero);
                let b = _mm512_fmadd_ps(qv[1], E::load16(k.add(16)), zero);
                ab[0] = _mm512_fmadd_ps(qv[2], E::load16(k.add(32)), a);
                ab[1] = _mm512_fmadd_ps(qv[3], E::load16(k.add(48)), b);
            }
            // [x_r0.lo + x_r0.hi | x_r1.lo + x_r1.hi] for x = a, b.
            let halves = |x0: __m512, x1: __m512| {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x44>(x0, x1),
                    _mm512_shuffle_f32x4::<0xEE>(x0, x1),
                )
            };
            *w = _mm512_add_ps(halves(ab[0][0], ab[1][0]), halves(ab[0][1], ab[1][1]));
        }
        // Quarter r of x: v_r[0..4] + v_r[4..8], rows 0..4 and 4..8.
        let fold = |w0: __m512, w1: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(w0, w1),
                _mm512_shuffle_f32x4::<0xDD>(w0, w1),
            )
        };
        let (x0, x1) = (fold(w[0], w[1]), fold(w[2], w[3]));
        // Quarter q: [u_q0, u_q1, u_(q+4)0, u_(q+4)1], u_r[l] = t_r[l] + t_r[l + 2].
        let y = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x0, x1),
            _mm512_shuffle_ps::<0xEE>(x0, x1),
        );
        // Quarter q: [d_q, d_(q+4), d_q, d_(q+4)], d_r = u_r0 + u_r1.
        let z = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(y, y),
            _mm512_shuffle_ps::<0xDD>(y, y),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, z));
        _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }

    /// AVX-512 [`axpy_rows`](super::axpy_rows) for 64-wide heads: up to
    /// three heads at a time, each in four registers, all fed by one load of
    /// each V row.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn axpy_rows_64<E: KvElem>(
        layout: HeadsLayout,
        p: &[f32],
        rows: &[E],
        out: &mut [f32],
    ) {
        let mut h = 0;
        while h < layout.heads {
            match layout.heads - h {
                1 => heads_64::<E, 1>(layout, h, p, rows, out),
                2 => heads_64::<E, 2>(layout, h, p, rows, out),
                _ => heads_64::<E, 3>(layout, h, p, rows, out),
            }
            h += 3;
        }
    }

    /// Heads `first..first + G` of [`axpy_rows_64`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    #[inline]
    unsafe fn heads_64<E: KvElem, const G: usize>(
        layout: HeadsLayout,
        first: usize,
        p: &[f32],
        rows: &[E],
        out: &mut [f32],
    ) {
        let po = out.as_mut_ptr().add(first * layout.head_stride);
        let pp = p.as_ptr().add(first * layout.score_stride);
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_loadu_ps(po.add(g * layout.head_stride + 16 * k));
            }
        }
        for j in 0..layout.keys {
            let row = rows.as_ptr().add(j * 64);
            let v = [
                E::load16(row),
                E::load16(row.add(16)),
                E::load16(row.add(32)),
                E::load16(row.add(48)),
            ];
            for (g, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_ps(*pp.add(g * layout.score_stride + j));
                for (acc, v) in acc.iter_mut().zip(v) {
                    *acc = _mm512_fmadd_ps(a, v, *acc);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(po.add(g * layout.head_stride + 16 * k), *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::kernels::testutil::Rng;
    use crate::kernels::{axpy, dot};

    /// Random tiles of `hd`-wide rows (16, 21 and 5 rows: groups of eight
    /// with and without a tail, and a tail alone; each with 3 values to
    /// spare past the last row), stored as `E`.
    fn tiles<E: KvElem>(rng: &mut Rng, hd: usize, round: fn(f32) -> E) -> Vec<Vec<E>> {
        [16, 21, 5]
            .iter()
            .map(|&n| rng.normals(n * hd + 3).into_iter().map(round).collect())
            .collect()
    }

    /// The tile kernels over `E` rows give exactly what `dot` and `axpy`
    /// give per row on the rows widened to f32 (the 64-wide register paths
    /// and the heads sharing a row included), so batch invariance and the
    /// kernel families' agreement carry over to every cache type.
    fn equal_dot_and_axpy_per_row<E: KvElem>(seed: u64, round: fn(f32) -> E) {
        let mut rng = Rng::new(seed);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for hd in [64, 48, 13, 1] {
            let tiles = tiles(&mut rng, hd, round);
            let widened = |rows: &[E]| rows.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
            // Up to four heads, their vectors and scores interleaved with
            // unused floats; each V tile adds to what the last left.
            for heads in 1..=4 {
                let (score_stride, head_stride) = (23, hd + 5);
                let q = rng.normals(heads * head_stride);
                let start = rng.normals(heads * head_stride);
                let (mut want, mut got) = (start.clone(), start);
                for rows in &tiles {
                    let keys = (rows.len() - 3) / hd;
                    let layout = HeadsLayout {
                        heads,
                        keys,
                        head_dim: hd,
                        score_stride,
                        head_stride,
                    };
                    let wide = widened(rows);
                    let row = |j: usize| &wide[j * hd..(j + 1) * hd];
                    let untouched = rng.normals(heads * score_stride);
                    let (mut scores, mut want_scores) = (untouched.clone(), untouched);
                    for h in 0..heads {
                        let q = &q[h * head_stride..][..hd];
                        for j in 0..keys {
                            want_scores[h * score_stride + j] = dot(q, row(j)) * 0.125;
                        }
                    }
                    dot_rows_scaled(layout, &q, rows, 0.125, &mut scores);
                    assert_eq!(bits(&scores), bits(&want_scores), "hd {hd}, {heads} heads");

                    let p = rng.normals(heads * score_stride);
                    for h in 0..heads {
                        let out = &mut want[h * head_stride..][..hd];
                        for j in 0..keys {
                            axpy(p[h * score_stride + j], row(j), out);
                        }
                    }
                    axpy_rows(layout, &p, rows, &mut got);
                }
                assert_eq!(bits(&got), bits(&want), "hd {hd}, {heads} heads");
            }
        }
    }

    #[test]
    fn tile_kernels_equal_dot_and_axpy_per_row_bit_for_bit() {
        equal_dot_and_axpy_per_row::<f32>(14, |x| x);
        equal_dot_and_axpy_per_row::<f16>(15, f16::from_f32);
        equal_dot_and_axpy_per_row::<bf16>(16, bf16::from_f32);
    }
}
