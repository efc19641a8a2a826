//! The interleaved layouts of quantized matrices ([`Packed::Q4Interleaved`],
//! [`Packed::Q8Interleaved`]): `group` rows stored together so one vector
//! of `4 * group` bytes holds four quant bytes of each, one row per 32-bit
//! lane. AVX2 uses groups of [`AVX2_GROUP`] rows (32-byte vectors, read by
//! [`gemv_x8_avx2`](super::gemv_x8_avx2)), AVX-512 groups of
//! [`AVX512_GROUP`] (64-byte vectors, read by
//! [`gemv_x16_avx512`](super::gemv_x16_avx512)).
//!
//! Rows are taken in groups (the last group padded with zero rows, whose
//! zero scales make them zero); each group stores its blocks one after the
//! other. Within a (group, block) record, vector `s` holds bytes
//! `4s .. 4s + 4` of each row's quant bytes of the block (GGUF order), row
//! `i` at byte `4i`:
//!
//! - 4-bit: four vectors (16 bytes of nibbles per row), then the rows' f16
//!   scales, then their f16 minimums: [`q4_record`] bytes, one stream per
//!   group.
//! - 8-bit: eight vectors (32 signed bytes per row), [`q8_quants`] bytes;
//!   the scales live in their own array, `group` per record (scales beside
//!   the quants would leave the vectors unaligned).
//!
//! [`Packed::Q4Interleaved`]: super::weights::Packed::Q4Interleaved
//! [`Packed::Q8Interleaved`]: super::weights::Packed::Q8Interleaved

use super::aligned::AlignedBytes;
use super::weights::{Packed, QK, SCALE_PAD};

/// Rows per group of the AVX2 layout.
pub(crate) const AVX2_GROUP: usize = 8;

/// Rows per group of the AVX-512 layout.
pub(crate) const AVX512_GROUP: usize = 16;

/// Bytes per (group, block) record of a 4-bit matrix: quants, scales,
/// minimums (a multiple of `4 * group`, so every vector is aligned).
pub(crate) const fn q4_record(group: usize) -> usize {
    group * (QK / 2 + 4)
}

/// Bytes of quants per (group, block) record of an 8-bit matrix.
pub(crate) const fn q8_quants(group: usize) -> usize {
    group * QK
}

/// Stores one row's quant bytes of a block (`q`, 16 or 32 bytes) as row
/// `i` of the record `rec` of a `group`-row layout.
fn scatter_words(q: &[u8], group: usize, i: usize, rec: &mut [u8]) {
    for (s, word) in q.chunks_exact(4).enumerate() {
        rec[4 * group * s + 4 * i..][..4].copy_from_slice(word);
    }
}

/// Row `i`'s quant bytes of the record `rec` into `q` (16 or 32 bytes).
fn gather_words(rec: &[u8], group: usize, i: usize, q: &mut [u8]) {
    for (s, word) in q.chunks_exact_mut(4).enumerate() {
        word.copy_from_slice(&rec[4 * group * s + 4 * i..][..4]);
    }
}

/// The `group`-row layout of a 4-bit matrix of `rows` rows of `blocks`
/// blocks, whose block `i` (row after row) is `block(i)`: 16 quant bytes in
/// GGUF order, f16 scale, f16 minimum.
pub(crate) fn interleave_q4<'a>(
    group: usize,
    rows: usize,
    blocks: usize,
    block: impl Fn(usize) -> (&'a [u8], u16, u16),
) -> Packed {
    let record = q4_record(group);
    let mut out = AlignedBytes::zeroed(rows.div_ceil(group) * blocks * record);
    let data = out.as_mut_slice();
    let (scales, mins) = (group * QK / 2, group * (QK / 2 + 2));
    for r in 0..rows {
        let i = r % group;
        for b in 0..blocks {
            let rec = &mut data[((r / group) * blocks + b) * record..][..record];
            let (q, d, m) = block(r * blocks + b);
            scatter_words(q, group, i, rec);
            rec[scales + 2 * i..][..2].copy_from_slice(&d.to_le_bytes());
            rec[mins + 2 * i..][..2].copy_from_slice(&m.to_le_bytes());
        }
    }
    Packed::Q4Interleaved { data: out, group }
}

/// Block `b` of row `row` of a 4-bit `group`-row matrix with `blocks`
/// blocks per row: its 16 quant bytes in GGUF order, scale and minimum.
#[inline]
pub(crate) fn q4_block_at(
    data: &[u8],
    group: usize,
    blocks: usize,
    row: usize,
    b: usize,
) -> ([u8; 16], u16, u16) {
    let record = q4_record(group);
    let rec = &data[((row / group) * blocks + b) * record..][..record];
    let i = row % group;
    let mut q = [0u8; 16];
    gather_words(rec, group, i, &mut q);
    let half = |at: usize| u16::from_le_bytes([rec[at], rec[at + 1]]);
    let (scales, mins) = (group * QK / 2, group * (QK / 2 + 2));
    (q, half(scales + 2 * i), half(mins + 2 * i))
}

/// The `group`-row layout of an 8-bit matrix of `rows` rows of `blocks`
/// blocks, whose block `i` (row after row) is `block(i)`: 32 quant bytes,
/// f16 scale.
pub(crate) fn interleave_q8<'a>(
    group: usize,
    rows: usize,
    blocks: usize,
    block: impl Fn(usize) -> (&'a [u8], u16),
) -> Packed {
    let records = rows.div_ceil(group) * blocks;
    let mut out = AlignedBytes::zeroed(records * q8_quants(group));
    let mut scales = vec![0u16; records * group + SCALE_PAD];
    let data = out.as_mut_slice();
    for r in 0..rows {
        let i = r % group;
        for b in 0..blocks {
            let at = (r / group) * blocks + b;
            let (q, d) = block(r * blocks + b);
            scatter_words(q, group, i, &mut data[at * q8_quants(group)..]);
            scales[at * group + i] = d;
        }
    }
    Packed::Q8Interleaved {
        qs: out,
        d: scales,
        group,
    }
}

/// Block `b` of row `row` of an 8-bit `group`-row matrix with `blocks`
/// blocks per row: its 32 quant bytes and its scale.
#[inline]
pub(crate) fn q8_block_at(
    (qs, d): (&[u8], &[u16]),
    group: usize,
    blocks: usize,
    row: usize,
    b: usize,
) -> ([u8; 32], u16) {
    let at = (row / group) * blocks + b;
    let i = row % group;
    let mut q = [0u8; 32];
    gather_words(
        &qs[at * q8_quants(group)..][..q8_quants(group)],
        group,
        i,
        &mut q,
    );
    (q, d[at * group + i])
}

#[cfg(test)]
mod tests {
    use super::{AVX2_GROUP, AVX512_GROUP};
    use crate::kernels::testutil::{random_gguf_bytes, Rng};
    use crate::kernels::weights::tests::tensor;
    use crate::kernels::weights::Packed;
    use crate::kernels::{CpuKernels, WeightMatrix};
    use crate::model::DType;

    /// The interleaved layouts of both widths hold the same values as the
    /// row-major one, in every row of a matrix whose last group is partial.
    #[test]
    fn interleaved_rows_dequantize_like_row_major() {
        let mut rng = Rng::new(3);
        for dtype in [DType::Q4_1, DType::Q4_0, DType::Q8_0] {
            let (rows, cols) = (13, 96);
            let t = tensor(
                dtype,
                rows,
                cols,
                random_gguf_bytes(&mut rng, dtype, rows, cols),
            );
            let plain = WeightMatrix::from_tensor_for(&t, CpuKernels::Scalar).unwrap();
            assert!(matches!(plain.data, Packed::Q4 { .. } | Packed::Q8 { .. }));
            for group in [AVX2_GROUP, AVX512_GROUP] {
                let mixed = WeightMatrix::from_tensor_in(&t, Some(group)).unwrap();
                assert!(matches!(
                    mixed.data,
                    Packed::Q4Interleaved { group: g, .. } | Packed::Q8Interleaved { group: g, .. }
                        if g == group
                ));
                let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
                for r in 0..rows {
                    plain.dequantize_row(r, &mut a);
                    mixed.dequantize_row(r, &mut b);
                    assert_eq!(a, b, "{dtype:?} group {group} row {r}");
                }
                let mut part = vec![0f32; 32];
                mixed.dequantize_range(12, 64, &mut part);
                assert_eq!(
                    part,
                    a[64..],
                    "{dtype:?} group {group} last block of the last row"
                );
            }
        }
    }
}
