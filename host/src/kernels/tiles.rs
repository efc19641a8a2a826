//! Attention's tile kernels: one query's scores against a KV tile and the
//! weighted sum of a V tile, over rows of any KV-cache element type
//! ([`KvElem`]), each bit-identical to [`dot`](super::dot) and
//! [`axpy`](super::axpy) per row on the rows widened to f32.

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

/// `out += p[j] * rows[j]` for every `(p, rows)` tile in order and every
/// row of a tile in order: attention's weighted sum of V, bit-identical to
/// one [`axpy`](super::axpy) per row widened to f32, but with `out` kept in
/// registers throughout when it is 64 floats wide (a head of the default
/// model).
///
/// Panics if a tile's `rows` is shorter than `p.len() * out.len()`.
pub fn axpy_rows<'a, E: KvElem>(
    tiles: impl Iterator<Item = (&'a [f32], &'a [E])>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: the AVX2 family (AVX2, FMA, F16C) is present.
        unsafe { avx2::axpy_rows(tiles, out) };
        return;
    }
    let hd = out.len();
    for (p, rows) in tiles {
        for (&p, row) in p.iter().zip(rows[..p.len() * hd].chunks_exact(hd.max(1))) {
            axpy_portable(p, row, out);
        }
    }
}

/// Asks the CPU to start loading `data` into its caches: a hint that
/// changes no result. Attention gives it the next K/V piece, whose blocks
/// lie apart in memory where the hardware prefetcher does not follow.
#[inline]
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

    /// AVX2 [`axpy_rows`](super::axpy_rows): for a 64-float `out`, kept in
    /// eight registers, the same fused multiply-adds per lane, in the same
    /// order, as [`axpy`] per row; other widths, [`axpy`] per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_rows<'a, E: KvElem>(
        tiles: impl Iterator<Item = (&'a [f32], &'a [E])>,
        out: &mut [f32],
    ) {
        let hd = out.len();
        if hd != 64 {
            for (p, rows) in tiles {
                for (&p, row) in p.iter().zip(rows[..p.len() * hd].chunks_exact(hd.max(1))) {
                    axpy(p, row, out);
                }
            }
            return;
        }
        let po = out.as_mut_ptr();
        let mut acc = [_mm256_setzero_ps(); 8];
        for (k, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_loadu_ps(po.add(8 * k));
        }
        for (p, rows) in tiles {
            let rows = &rows[..p.len() * 64];
            for (j, &p) in p.iter().enumerate() {
                let a = _mm256_set1_ps(p);
                let row = rows.as_ptr().add(j * 64);
                for (k, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(a, E::load8(row.add(8 * k)), *acc);
                }
            }
        }
        for (k, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(po.add(8 * k), *acc);
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
            let start = rng.normals(hd);
            let mut want = start.clone();
            for (p, rows) in &tiles {
                let rows = widened(rows);
                for (j, &p) in p.iter().enumerate() {
                    axpy(p, &rows[j * hd..(j + 1) * hd], &mut want);
                }
            }
            let mut got = start;
            axpy_rows(tiles.iter().map(|(p, r)| (&p[..], &r[..])), &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "hd {hd}");
        }
    }

    #[test]
    fn tile_kernels_equal_dot_and_axpy_per_row_bit_for_bit() {
        equal_dot_and_axpy_per_row::<f32>(14, |x| x);
        equal_dot_and_axpy_per_row::<f16>(15, f16::from_f32);
        equal_dot_and_axpy_per_row::<bf16>(16, bf16::from_f32);
    }
}
