//! Matrix x few-vectors products straight from quantized weights.
//!
//! Decode multiplies each weight matrix by one activation row (or a few,
//! one per running sequence), so it is bound by streaming the weights from
//! memory. These kernels never expand weights to f32: each block's quants
//! are multiplied as integers with the 8-bit quantized activations
//! ([`Q8Acts`]) and the block's scales are applied to the integer sum.

use std::ops::Range;

use super::cpu::CpuKernels;
#[cfg(target_arch = "x86_64")]
use super::group_tiles::{Interleaved, Job};
use super::interleaved::{q4_block_at, q8_block_at};
#[cfg(target_arch = "x86_64")]
use super::interleaved::{AVX2_GROUP, AVX512_GROUP};
use super::quant::Q8Acts;
use super::weights::{f16_to_f32, Packed, WeightMatrix, QK};
use super::OutPtr;

/// Computes `out[t * rows + r]` for `r` in `rows` and every token of `acts`
/// with the given kernel family (every family gives bit-identical results).
///
/// Only for quantized weights (`Packed::Q8`, `Packed::Q4` and their
/// interleaved forms).
/// Panics if the CPU cannot run `kernels` (a caller bug: callers pass a
/// supported family).
pub(crate) fn gemv_rows(
    kernels: CpuKernels,
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    assert!(
        kernels.is_supported(),
        "{kernels:?} kernels on a CPU without them"
    );
    match (kernels, &w.data) {
        (CpuKernels::Scalar, _) => gemv_rows_scalar(w, acts, n_tokens, rows, out),
        #[cfg(target_arch = "x86_64")]
        (_, Packed::Q4Interleaved { data, group }) => {
            let data = Interleaved::Q4(data.as_slice());
            gemv_interleaved(kernels, *group, data, w, acts, n_tokens, rows, out)
        }
        #[cfg(target_arch = "x86_64")]
        (_, Packed::Q8Interleaved { qs, d, group }) => {
            let data = Interleaved::Q8(qs.as_slice(), d);
            gemv_interleaved(kernels, *group, data, w, acts, n_tokens, rows, out)
        }
        // AVX-512 VNNI and AMX matrices are interleaved; a row-major one
        // (only a test makes it) is read with the AVX2 kernels those
        // families include.
        // SAFETY: the CPU has the family's features (asserted above).
        #[cfg(target_arch = "x86_64")]
        (CpuKernels::Avx2 | CpuKernels::Avx512Vnni | CpuKernels::Amx, _) => unsafe {
            super::gemv_avx2::gemv_rows(w, acts, n_tokens, rows, out)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        (CpuKernels::AvxVnni, _) => unsafe {
            super::gemv_avx2::gemv_rows_vnni(w, acts, n_tokens, rows, out)
        },
        #[cfg(not(target_arch = "x86_64"))]
        (CpuKernels::Avx2 | CpuKernels::AvxVnni | CpuKernels::Avx512Vnni | CpuKernels::Amx, _) => {
            unreachable!("never supported here")
        }
    }
}

/// [`gemv_rows`] for an interleaved matrix (`data`, in groups of `group`
/// rows) with a SIMD family: every one has AVX2 and F16C, all the 8-row
/// kernels need; the 16-row layout needs AVX-512 VNNI (AMX for batches of
/// [`MIN_TOKENS`](super::gemm_amx::MIN_TOKENS) or more), and families
/// without it (which never choose that layout, though a test may hand it
/// to them) read it with the scalar code.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn gemv_interleaved(
    kernels: CpuKernels,
    group: usize,
    data: Interleaved,
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    let job = Job {
        w: data,
        n_rows: w.rows(),
        blocks: w.cols() / QK,
        acts,
        n_tokens,
        rows,
        out,
    };
    match (group, kernels) {
        // SAFETY: the caller checked the family is supported; `AlignedBytes`
        // start 64-byte aligned.
        (AVX2_GROUP, _) => unsafe { super::gemv_x8_avx2::gemv_rows(job) },
        // SAFETY: as above.
        (AVX512_GROUP, CpuKernels::Avx512Vnni) => unsafe { super::gemv_x16_avx512::gemv_rows(job) },
        // SAFETY: as above; supporting AMX means this process holds the
        // tile permission.
        (AVX512_GROUP, CpuKernels::Amx) => unsafe { super::gemm_amx::gemv_rows(job) },
        _ => gemv_rows_scalar(w, acts, n_tokens, job.rows, out),
    }
}

/// Portable [`gemv_rows`], also the reference the SIMD versions are tested
/// against bit for bit: they reproduce this function's float order.
pub(crate) fn gemv_rows_scalar(
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    let (cols, blocks) = (w.cols(), w.cols() / QK);
    for r in rows {
        let scales = r * blocks..(r + 1) * blocks;
        for t in 0..n_tokens {
            let (xq, (dx, sx)) = (acts.row_qs(t), acts.row_scales(t));
            let v = match &w.data {
                Packed::Q8 { qs, d } => {
                    let (q, d) = (&qs.as_slice()[r * cols..(r + 1) * cols], &d[scales.clone()]);
                    dot_q8((0..blocks).map(|b| (&q[b * QK..][..QK], d[b])), xq, dx)
                }
                Packed::Q4 { qs, d, m } => {
                    let q = &qs.as_slice()[r * cols / 2..(r + 1) * cols / 2];
                    let (d, m) = (&d[scales.clone()], &m[scales.clone()]);
                    dot_q4(
                        (0..blocks).map(|b| (&q[b * QK / 2..][..QK / 2], d[b], m[b])),
                        xq,
                        dx,
                        sx,
                    )
                }
                Packed::Q4Interleaved { data, group } => {
                    let block = |b| q4_block_at(data.as_slice(), *group, blocks, r, b);
                    dot_q4((0..blocks).map(block), xq, dx, sx)
                }
                Packed::Q8Interleaved { qs, d, group } => {
                    let block = |b| q8_block_at((qs.as_slice(), d), *group, blocks, r, b);
                    dot_q8((0..blocks).map(block), xq, dx)
                }
                Packed::FloatPanels(_) => {
                    unreachable!("gemv is only for quantized weights")
                }
            };
            // SAFETY: `r < rows` and `t < n_tokens`; the caller gives each thread disjoint rows.
            unsafe { out.write(t * w.rows() + r, v) };
        }
    }
}

/// One Q8_0 row, given as its blocks (32 quant bytes, f16 scale), times
/// one quantized activation row.
fn dot_q8<Q: AsRef<[u8]>>(blocks: impl Iterator<Item = (Q, u16)>, xq: &[i8], dx: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, ((wq, d), xq)) in blocks.zip(xq.chunks_exact(QK)).enumerate() {
        let isum = isum_q8(block(wq.as_ref()), block(xq));
        acc += f16_to_f32(d) * dx[b] * isum as f32;
    }
    acc
}

/// One 4-bit row, given as its blocks (16 quant bytes, f16 scale, f16
/// minimum), times one quantized activation row.
fn dot_q4<Q: AsRef<[u8]>>(
    blocks: impl Iterator<Item = (Q, u16, u16)>,
    xq: &[i8],
    dx: &[f32],
    sx: &[f32],
) -> f32 {
    let mut acc = 0f32;
    for (b, ((wq, d, m), xq)) in blocks.zip(xq.chunks_exact(QK)).enumerate() {
        let isum = isum_q4(block(wq.as_ref()), block(xq));
        acc += f16_to_f32(d) * dx[b] * isum as f32 + f16_to_f32(m) * sx[b];
    }
    acc
}

/// `s` as the fixed-size array it is (a block's quants), so the loops over
/// it compile without bounds checks.
fn block<T, const N: usize>(s: &[T]) -> &[T; N] {
    s.try_into().expect("a block holds QK quants")
}

// The block sums below are exact: |sum| <= 32 * 128 * 128 < 2^31, so their
// additions never wrap, and `wrapping_add` only tells the compiler so. With
// checked additions (the test profile's overflow checks) these loops stay
// scalar; without them they vectorise, which the scalar family's test runs
// and every CPU without a SIMD family rely on.

/// The integer dot product of one Q8_0 block with one activation block.
fn isum_q8(wq: &[u8; QK], xq: &[i8; QK]) -> i32 {
    let mut isum = 0i32;
    for (&w, &x) in wq.iter().zip(xq) {
        isum = isum.wrapping_add(i32::from(w as i8) * i32::from(x));
    }
    isum
}

/// The integer dot product of one 4-bit block (low nibbles hold quants
/// 0..16, high nibbles 16..32) with one activation block.
fn isum_q4(wq: &[u8; QK / 2], xq: &[i8; QK]) -> i32 {
    let (lo, hi) = xq.split_at(QK / 2);
    let mut isum = 0i32;
    for ((&byte, &xl), &xh) in wq.iter().zip(lo).zip(hi) {
        let pair = i32::from(byte & 0x0F) * i32::from(xl) + i32::from(byte >> 4) * i32::from(xh);
        isum = isum.wrapping_add(pair);
    }
    isum
}
