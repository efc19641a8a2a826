//! Attention's tile kernels: one query's scores against a KV tile and the
//! weighted sums of a V tile, over rows of any KV-cache element type
//! ([`KvElem`]), each bit-identical to [`dot`](super::dot) and
//! [`axpy`](super::axpy) per row on the rows widened to f32.
//!
//! The AVX-512 versions (64-wide heads) keep those bits: a score is the
//! AVX2 kernel's four 8-lane accumulators held in two 16-lane ones and
//! reduced by the same tree; a weighted sum is the same fused
//! multiply-add per lane and key, with up to three heads sharing each V row
//! so that twelve independent accumulators keep both FMA units busy (one
//! head's four would wait on each other's latency).

use super::kv_elem::KvElem;
use super::vector::{axpy_portable, dot_portable};

/// `scores[j] = dot(q, rows[j]) * scale` for each of the `scores.len()`
/// consecutive rows of `q.len()` values in `rows`: attention's scores of
/// one query against a KV tile, each bit-identical to [`dot`](super::dot)'s
/// on the row widened to f32.
///
/// Panics if `rows` is shorter than `scores.len() * q.len()`.
pub fn dot_rows_scaled<E: KvElem>(q: &[f32], rows: &[E], scale: f32, scores: &mut [f32]) {
    let hd = q.len();
    let rows = &rows[..scores.len() * hd];
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx512() && hd == 64 {
        // SAFETY: the AVX-512 family (with AVX2, FMA, F16C) is present;
        // `rows` holds every row (sliced above).
        unsafe { avx512::dot_rows_scaled_64(q, rows, scale, scores) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: the AVX2 family (AVX2, FMA, F16C) is present; `rows`
        // holds every row (sliced above).
        unsafe { avx2::dot_rows_scaled(q, rows, scale, scores) };
        return;
    }
    for (s, row) in scores.iter_mut().zip(rows.chunks_exact(hd.max(1))) {
        *s = dot_portable(q, row) * scale;
    }
}

/// Where several heads' weights and outputs of one V tile lie: head `h`
/// weighs the tile's `keys` rows by `p[h * p_stride..][..keys]` and adds
/// them into `out[h * out_stride..][..head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct HeadsLayout {
    /// Heads sharing the tile.
    pub heads: usize,
    /// Rows of the tile.
    pub keys: usize,
    /// Width of a row and of a head's output.
    pub head_dim: usize,
    /// Floats between consecutive heads' weights.
    pub p_stride: usize,
    /// Floats between consecutive heads' outputs (at least `head_dim`).
    pub out_stride: usize,
}

/// `out_h += Σ_j p_h[j] * rows[j]` for every head of `layout`, keys in
/// order: attention's weighted sums of one V tile, each head's bit-identical
/// to one [`axpy`](super::axpy) per row widened to f32.
///
/// Panics if a head's weights or output, or the tile, lie outside the
/// slices, or if heads' outputs overlap.
pub fn axpy_rows<E: KvElem>(layout: HeadsLayout, p: &[f32], rows: &[E], out: &mut [f32]) {
    let HeadsLayout {
        heads,
        keys,
        head_dim: hd,
        p_stride,
        out_stride,
    } = layout;
    if heads == 0 {
        return;
    }
    assert!(
        out_stride >= hd
            && p.len() >= (heads - 1) * p_stride + keys
            && out.len() >= (heads - 1) * out_stride + hd
            && rows.len() >= keys * hd,
        "axpy_rows: {layout:?} does not fit its slices"
    );
    let rows = &rows[..keys * hd];
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx512() && hd == 64 {
        // SAFETY: the AVX-512 family (with AVX2, FMA, F16C) is present;
        // every head's weights and output lie inside (checked above).
        unsafe { avx512::axpy_rows_64(layout, p, rows, out) };
        return;
    }
    for h in 0..heads {
        let (p, out) = (&p[h * p_stride..][..keys], &mut out[h * out_stride..][..hd]);
        #[cfg(target_arch = "x86_64")]
        if super::cpu::has_avx2() {
            // SAFETY: the AVX2 family (AVX2, FMA, F16C) is present.
            unsafe { avx2::axpy_rows(p, rows, out) };
            continue;
        }
        for (&p, row) in p.iter().zip(rows.chunks_exact(hd.max(1))) {
            axpy_portable(p, row, out);
        }
    }
}

/// Asks the CPU to start loading `data` into its caches: a hint that
/// changes no result. Attention gives it the next K/V piece, whose blocks
/// lie apart in memory where the hardware prefetcher does not follow.
#[inline]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        // SAFETY: prefetching is a hint with no memory access that can
        // fault; the address is inside `data`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// The AVX2 versions; each needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::vector::avx2::{axpy, dot_inline};
    use super::KvElem;

    /// AVX2 [`dot_rows_scaled`](super::dot_rows_scaled); `rows` holds
    /// `scores.len()` rows.
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
    /// serial reduction per row.
    #[inline(always)]
    unsafe fn dot8_rows_64<E: KvElem>(q: &[f32], rows: *const E, scale: f32, out: &mut [f32]) {
        let mut qv = [_mm256_setzero_ps(); 8];
        for (i, qv) in qv.iter_mut().enumerate() {
            *qv = _mm256_loadu_ps(q.as_ptr().add(8 * i));
        }
        let mut v = [_mm256_setzero_ps(); 8];
        for (r, v) in v.iter_mut().enumerate() {
            let k = rows.add(r * 64);
            let mut acc = [_mm256_setzero_ps(); 4];
            for (i, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(qv[i], E::load8(k.add(8 * i)), *acc);
                *acc = _mm256_fmadd_ps(qv[4 + i], E::load8(k.add(32 + 8 * i)), *acc);
            }
            *v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        }
        // s4 of rows (a, b): [a.lo + a.hi, b.lo + b.hi].
        let pair = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        };
        let (s01, s23, s45, s67) = (
            pair(v[0], v[1]),
            pair(v[2], v[3]),
            pair(v[4], v[5]),
            pair(v[6], v[7]),
        );
        // [r(s0+s2), r'(s0+s2), r(s1+s3), r'(s1+s3)] per 128-bit half.
        let a = _mm256_add_ps(_mm256_unpacklo_ps(s01, s23), _mm256_unpackhi_ps(s01, s23));
        let b = _mm256_add_ps(_mm256_unpacklo_ps(s45, s67), _mm256_unpackhi_ps(s45, s67));
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        );
        // Lanes hold rows 0 2 4 6 1 3 5 7; put them in order.
        let ordered = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_ps(
            out.as_mut_ptr(),
            _mm256_mul_ps(ordered, _mm256_set1_ps(scale)),
        );
    }

    /// One head of AVX2 [`axpy_rows`](super::axpy_rows): for a 64-float
    /// `out`, kept in eight registers, the same fused multiply-adds per
    /// lane, in the same order, as [`axpy`] per row; other widths, [`axpy`]
    /// per row. `rows` holds `p.len()` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_rows<E: KvElem>(p: &[f32], rows: &[E], out: &mut [f32]) {
        let hd = out.len();
        if hd != 64 {
            for (&p, row) in p.iter().zip(rows.chunks_exact(hd.max(1))) {
                axpy(p, row, out);
            }
            return;
        }
        let po = out.as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); 8];
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_loadu_ps(po.add(8 * k));
        }
        for (j, &p) in p.iter().enumerate() {
            let a = _mm256_set1_ps(p);
            let row = rows.as_ptr().add(j * 64);
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(a, E::load8(row.add(8 * k)), *acc);
            }
        }
        for (k, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(po.add(8 * k), *acc);
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

    /// AVX-512 [`dot_rows_scaled`](super::dot_rows_scaled) for 64-wide
    /// rows: eight rows at a time, the rest as [`dot_inline`] (the same
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
        let po = out.as_mut_ptr().add(first * layout.out_stride);
        let pp = p.as_ptr().add(first * layout.p_stride);
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_loadu_ps(po.add(g * layout.out_stride + 16 * k));
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
                let a = _mm512_set1_ps(*pp.add(g * layout.p_stride + j));
                for (acc, v) in acc.iter_mut().zip(v) {
                    *acc = _mm512_fmadd_ps(a, v, *acc);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (k, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(po.add(g * layout.out_stride + 16 * k), *acc);
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

    /// Random tiles of `hd`-wide rows (16, 16 and 5 rows, each with 3 values
    /// to spare past the last row), stored as `E`.
    fn tiles<E: KvElem>(rng: &mut Rng, hd: usize, round: fn(f32) -> E) -> Vec<(Vec<f32>, Vec<E>)> {
        [16, 16, 5]
            .iter()
            .map(|&n| {
                let rows = rng.normals(n * hd + 3).into_iter().map(round).collect();
                (rng.normals(n), rows)
            })
            .collect()
    }

    /// The tile kernels over `E` rows give exactly what `dot` and `axpy`
    /// give per row on the rows widened to f32 (the 64-wide register paths
    /// included), so batch invariance and the kernel families' agreement
    /// carry over to every cache type.
    fn equal_dot_and_axpy_per_row<E: KvElem>(seed: u64, round: fn(f32) -> E) {
        let mut rng = Rng::new(seed);
        for hd in [64, 48, 13, 1] {
            let q = rng.normals(hd);
            let tiles = tiles(&mut rng, hd, round);
            let widened = |rows: &[E]| rows.iter().map(|e| e.to_f32()).collect::<Vec<f32>>();
            for (p, rows) in &tiles {
                let mut got = vec![0f32; p.len()];
                dot_rows_scaled(&q, rows, 0.125, &mut got);
                let rows = widened(rows);
                for (j, g) in got.iter().enumerate() {
                    let want = dot(&q, &rows[j * hd..(j + 1) * hd]) * 0.125;
                    assert_eq!(g.to_bits(), want.to_bits(), "hd {hd} row {j}");
                }
            }
            // Up to four heads, their weights and outputs interleaved with
            // unused floats, each tile adding to what the last left.
            for heads in 1..=4 {
                let (p_stride, out_stride) = (19, hd + 5);
                let start = rng.normals(heads * out_stride);
                let mut want = start.clone();
                let mut got = start;
                for (_, rows) in &tiles {
                    let keys = (rows.len() - 3) / hd;
                    let p = rng.normals(heads * p_stride);
                    let wide = widened(rows);
                    for h in 0..heads {
                        let out = &mut want[h * out_stride..][..hd];
                        for j in 0..keys {
                            axpy(p[h * p_stride + j], &wide[j * hd..(j + 1) * hd], out);
                        }
                    }
                    let layout = HeadsLayout {
                        heads,
                        keys,
                        head_dim: hd,
                        p_stride,
                        out_stride,
                    };
                    axpy_rows(layout, &p, rows, &mut got);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
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
