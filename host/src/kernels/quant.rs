//! Activations quantized to 8-bit blocks, the right-hand side of the fused
//! integer dot products (llama.cpp's Q8_1 idea): per block of 32 values a
//! scale `d = max|x| / 127`, the rounded quotients `q = x / d`, and
//! `s = d * sum(q)`, which lets a 4-bit block with a minimum `m` contribute
//! `m * s` without touching the quants again. The integer sums themselves
//! are kept too: the AVX-512 VNNI kernels bias signed Q8_0 weights by +128
//! to make them unsigned and subtract `128 * sum(q)` again, exactly.

use std::sync::Mutex;

use super::aligned::AlignedBytes;
use super::pool::ROWS_PARALLEL_MIN_VALUES;
use super::weights::QK;
use super::ThreadPool;

/// [`Q8Acts`] holds its tokens padded to a multiple of this, so the AMX
/// kernel can load a whole tile of tokens past the last one.
pub(crate) const TOKEN_PAD: usize = 16;

/// `n_tokens` rows of `cols` activations in 8-bit blocks.
#[derive(Default)]
pub(crate) struct Q8Acts {
    /// Signed quants, `n_tokens * cols` bytes, row after row.
    pub(crate) qs: AlignedBytes,
    /// Per-block scales; row `t` starts at `t * stride`, zero padded.
    pub(crate) d: Vec<f32>,
    /// Per-block `d * sum(q)`, laid out like `d`.
    pub(crate) s: Vec<f32>,
    /// Per-block `sum(q)`, laid out like `d`.
    pub(crate) sums: Vec<i32>,
    /// Values per row.
    pub(crate) cols: usize,
    /// Distance between rows of `d` and `s`: blocks per row rounded up to a
    /// multiple of 8, so SIMD code can load eight scales without a tail.
    pub(crate) stride: usize,
}

impl Q8Acts {
    /// Quantizes `x` (`n_tokens` rows of `cols`, `cols % 32 == 0`), reusing
    /// this buffer's memory. The rows past `n_tokens` up to a multiple of
    /// [`TOKEN_PAD`] have zero scales and whatever quants an earlier call
    /// left: the AMX kernel computes them and stores none of their results,
    /// so they are not cleared on every call (decode's calls included).
    ///
    /// Batches of [`ROWS_PARALLEL_MIN_VALUES`] values or more are split
    /// between `pool`'s threads by rows, as
    /// [`ThreadPool::for_each_row`] splits its rows (this fills four
    /// buffers per row, not one); a row's quants never depend on the split.
    pub(crate) fn quantize(&mut self, pool: &ThreadPool, x: &[f32], n_tokens: usize, cols: usize) {
        debug_assert!(cols.is_multiple_of(QK) && x.len() == n_tokens * cols);
        let blocks = cols / QK;
        let padded = n_tokens.next_multiple_of(TOKEN_PAD);
        self.cols = cols;
        self.stride = blocks.div_ceil(8) * 8;
        self.qs.resize(padded * cols);
        self.d.clear();
        self.d.resize(padded * self.stride, 0.0);
        self.s.clear();
        self.s.resize(padded * self.stride, 0.0);
        self.sums.clear();
        self.sums.resize(padded * self.stride, 0);
        let stride = self.stride;
        let qs = &mut self.qs.as_mut_slice()[..n_tokens * cols];
        let d = &mut self.d[..n_tokens * stride];
        let s = &mut self.s[..n_tokens * stride];
        let sums = &mut self.sums[..n_tokens * stride];
        let threads = if n_tokens * cols >= ROWS_PARALLEL_MIN_VALUES {
            pool.num_threads().min(n_tokens)
        } else {
            1
        };
        if threads == 1 {
            quantize_rows(x, Rows { qs, d, s, sums }, cols, stride);
            return;
        }
        // Each thread's share of the rows, behind a lock that thread alone
        // takes: safe code for disjoint writes, at the price of one
        // uncontended lock per thread and call.
        let per = n_tokens.div_ceil(threads);
        let (c, st) = (per * cols, per * stride);
        let shares: Vec<_> = x
            .chunks(c)
            .zip(qs.chunks_mut(c))
            .zip(
                d.chunks_mut(st)
                    .zip(s.chunks_mut(st))
                    .zip(sums.chunks_mut(st)),
            )
            .map(|((x, qs), ((d, s), sums))| Mutex::new((x, Rows { qs, d, s, sums })))
            .collect();
        pool.run(|i, _| {
            if let Some(share) = shares.get(i) {
                let mut share = share.lock().unwrap_or_else(|e| e.into_inner());
                let (x, rows) = &mut *share;
                quantize_rows(x, rows.reborrow(), cols, stride);
            }
        });
    }

    /// The quants of row `t`.
    pub(crate) fn row_qs(&self, t: usize) -> &[i8] {
        let bytes = &self.qs.as_slice()[t * self.cols..(t + 1) * self.cols];
        // SAFETY: i8 and u8 have the same size and alignment.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<i8>(), bytes.len()) }
    }

    /// The scales and scaled sums of row `t` (`stride` long).
    pub(crate) fn row_scales(&self, t: usize) -> (&[f32], &[f32]) {
        let r = t * self.stride..(t + 1) * self.stride;
        (&self.d[r.clone()], &self.s[r])
    }

    /// The integer block sums of row `t` (`stride` long).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn row_sums(&self, t: usize) -> &[i32] {
        &self.sums[t * self.stride..(t + 1) * self.stride]
    }
}

/// Rows of a [`Q8Acts`]'s buffers: `cols` quants and `stride` scales,
/// scaled sums and sums per row.
struct Rows<'a> {
    qs: &'a mut [u8],
    d: &'a mut [f32],
    s: &'a mut [f32],
    sums: &'a mut [i32],
}

impl Rows<'_> {
    /// The same rows, borrowed again.
    fn reborrow(&mut self) -> Rows<'_> {
        Rows {
            qs: self.qs,
            d: self.d,
            s: self.s,
            sums: self.sums,
        }
    }
}

/// Quantizes the rows of `x` (`cols` values each) into `rows`, choosing
/// the block kernel once per call rather than once per block.
fn quantize_rows(x: &[f32], rows: Rows, cols: usize, stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::has_avx2() {
        // SAFETY: the CPU has AVX2.
        unsafe { quantize_rows_avx2(x, rows, cols, stride) };
        return;
    }
    quantize_rows_with(x, rows, cols, stride, quantize_block_scalar);
}

/// [`quantize_rows`] with the AVX2 block kernel, inlined into the loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_rows_avx2(x: &[f32], rows: Rows, cols: usize, stride: usize) {
    // SAFETY (the closure): this function runs only where AVX2 is present,
    // and `quantize_rows_with` hands it blocks of 32.
    quantize_rows_with(x, rows, cols, stride, |x, q| unsafe {
        quantize_block_avx2(x, q)
    });
}

/// The loop of [`quantize_rows`] over rows and their blocks, with `block`
/// quantizing one block of 32 and returning `(d, sum(q))`.
#[inline(always)]
fn quantize_rows_with(
    x: &[f32],
    rows: Rows,
    cols: usize,
    stride: usize,
    block: impl Fn(&[f32], &mut [u8]) -> (f32, i32),
) {
    let Rows { qs, d, s, sums } = rows;
    let scales = d.chunks_exact_mut(stride).zip(s.chunks_exact_mut(stride));
    let rows = x
        .chunks_exact(cols)
        .zip(qs.chunks_exact_mut(cols))
        .zip(scales.zip(sums.chunks_exact_mut(stride)));
    for ((x, qs), ((d, s), sums)) in rows {
        let blocks = x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK));
        for (((x, q), d), (s, sum)) in blocks.zip(d).zip(s.iter_mut().zip(sums)) {
            let (bd, bsum) = block(x, q);
            (*d, *s, *sum) = (bd, bd * bsum as f32, bsum);
        }
    }
}

/// Quantizes one block of 32, portably; returns `(d, sum(q))`. Rounds
/// half to even, as the SIMD version does.
pub(crate) fn quantize_block_scalar(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        let qi = (v * id).round_ties_even() as i32;
        sum += qi;
        *q = qi as i8 as u8;
    }
    (d, sum)
}

/// [`quantize_block_scalar`] with AVX2, bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_block_avx2(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == QK && q.len() == QK);
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let mut amax = _mm256_and_ps(v[0], abs_mask);
    for vi in &v[1..] {
        amax = _mm256_max_ps(amax, _mm256_and_ps(*vi, abs_mask));
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
    let d = _mm_cvtss_f32(m1) / 127.0;
    let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let i = v.map(|vi| _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(vi, id))));
    // packs interleave 128-bit lanes; the permute restores element order.
    let w01 = _mm256_packs_epi32(i[0], i[1]);
    let w23 = _mm256_packs_epi32(i[2], i[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr().cast(), b);
    let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    let s4 = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256(sum, 1),
    );
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1));
    (d, _mm_cvtsi128_si32(s1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    #[test]
    fn scalar_quantization_reconstructs_within_half_a_step() {
        let mut rng = Rng::new(1);
        for scale in [1e-3f32, 1.0, 300.0] {
            let x: Vec<f32> = (0..QK).map(|_| rng.normal() * scale).collect();
            let mut q = [0u8; QK];
            let (d, s) = quantize_block_scalar(&x, &mut q);
            let sum: i32 = q.iter().map(|&b| i32::from(b as i8)).sum();
            assert_eq!(s, sum);
            for (&v, &b) in x.iter().zip(&q) {
                assert!(
                    (f32::from(b as i8) * d - v).abs() <= 0.5001 * d,
                    "{v} vs {}",
                    b as i8
                );
            }
        }
        let mut q = [1u8; QK];
        assert_eq!(quantize_block_scalar(&[0.0; QK], &mut q), (0.0, 0));
        assert_eq!(q, [0; QK]);
    }

    /// Splitting a batch between threads (2 and 3, with shares that end
    /// mid-batch) changes no quant, scale or sum of any row, and a smaller
    /// batch after a larger one leaves no stale value in its rows.
    #[test]
    fn a_split_batch_quantizes_like_one_row_at_a_time() {
        let mut rng = Rng::new(3);
        let cols = 576;
        for n in [1usize, 29, 64] {
            let x: Vec<f32> = rng.normals(n * cols).iter().map(|v| v * 4.0).collect();
            let mut want = Q8Acts::default();
            want.quantize(&ThreadPool::new(1), &x, n, cols);
            for threads in [2, 3] {
                let mut got = Q8Acts::default();
                got.quantize(&ThreadPool::new(threads), &rng.normals(80 * cols), 80, cols);
                got.quantize(&ThreadPool::new(threads), &x, n, cols);
                for t in 0..n {
                    assert_eq!(got.row_qs(t), want.row_qs(t), "row {t} of {n}");
                    assert_eq!(got.row_scales(t), want.row_scales(t), "row {t} of {n}");
                    #[cfg(target_arch = "x86_64")]
                    assert_eq!(got.row_sums(t), want.row_sums(t), "row {t} of {n}");
                }
                for t in 0..n {
                    let mut q = [0u8; QK];
                    let (d, sum) = quantize_block_scalar(&x[t * cols..][..QK], &mut q);
                    assert_eq!(got.row_scales(t).0[0], d);
                    assert_eq!(got.row_scales(t).1[0], d * sum as f32);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantization_matches_scalar_exactly() {
        if !crate::kernels::cpu::has_avx2() {
            return;
        }
        let mut rng = Rng::new(2);
        for _ in 0..500 {
            let x: Vec<f32> = (0..QK).map(|_| rng.normal() * 10.0).collect();
            let (mut a, mut b) = ([0u8; QK], [0u8; QK]);
            let ra = quantize_block_scalar(&x, &mut a);
            // SAFETY: AVX2 checked above.
            let rb = unsafe { quantize_block_avx2(&x, &mut b) };
            assert_eq!(a, b);
            assert_eq!(ra, rb);
        }
    }
}
