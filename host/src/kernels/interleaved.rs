//! The interleaved layouts of quantized matrices ([`Packed::Q4x8`],
//! [`Packed::Q8x8`]): eight rows stored together so one 32-byte vector holds
//! four quant bytes of each, one row per 32-bit lane (the AVX2 kernels in
//! [`gemv_x8_avx2`](super::gemv_x8_avx2) read them).
//!
//! Rows are taken in groups of [`X8_ROWS`] (the last group padded with
//! zero rows, whose zero scales make them zero); each group stores its
//! blocks one after the other. Within a (group, block) record, vector `s`
//! holds bytes `4s .. 4s + 4` of each row's quant bytes of the block (GGUF
//! order), row `i` at byte `4i`:
//!
//! - `Q4x8`: four vectors (16 bytes of nibbles per row), then the eight
//!   rows' f16 scales, then their f16 minimums: [`Q4X8_RECORD`] bytes, one
//!   stream per eight rows.
//! - `Q8x8`: eight vectors (32 signed bytes per row), [`Q8X8_QUANTS`]
//!   bytes; the scales live in their own array, eight per record (a record
//!   of 272 bytes would leave the vectors unaligned).
//!
//! [`Packed::Q4x8`]: super::weights::Packed::Q4x8
//! [`Packed::Q8x8`]: super::weights::Packed::Q8x8

use super::aligned::AlignedBytes;
use super::weights::{Packed, QK, SCALE_PAD};

/// Rows per interleaved group.
pub(crate) const X8_ROWS: usize = 8;

/// Bytes per (group, block) record of `Q4x8`: 128 of quants, 16 of
/// scales, 16 of minimums (a multiple of 32, so every vector is aligned).
pub(crate) const Q4X8_RECORD: usize = X8_ROWS * (QK / 2 + 4);

/// Bytes of quants per (group, block) record of `Q8x8`.
pub(crate) const Q8X8_QUANTS: usize = X8_ROWS * QK;

/// Stores one row's quant bytes of a block (`q`, 16 or 32 bytes) as row
/// `i` of the record `rec`.
fn scatter_words(q: &[u8], i: usize, rec: &mut [u8]) {
    for (s, word) in q.chunks_exact(4).enumerate() {
        rec[32 * s + 4 * i..][..4].copy_from_slice(word);
    }
}

/// Row `i`'s quant bytes of the record `rec` into `q` (16 or 32 bytes).
fn gather_words(rec: &[u8], i: usize, q: &mut [u8]) {
    for (s, word) in q.chunks_exact_mut(4).enumerate() {
        word.copy_from_slice(&rec[32 * s + 4 * i..][..4]);
    }
}

/// The `Q4x8` layout of a 4-bit matrix of `rows` rows of `blocks` blocks,
/// whose block `i` (row after row) is `block(i)`: 16 quant bytes in GGUF
/// order, f16 scale, f16 minimum.
pub(crate) fn interleave_q4<'a>(
    rows: usize,
    blocks: usize,
    block: impl Fn(usize) -> (&'a [u8], u16, u16),
) -> Packed {
    let mut out = AlignedBytes::zeroed(rows.div_ceil(X8_ROWS) * blocks * Q4X8_RECORD);
    let data = out.as_mut_slice();
    for r in 0..rows {
        let i = r % X8_ROWS;
        for b in 0..blocks {
            let rec = &mut data[((r / X8_ROWS) * blocks + b) * Q4X8_RECORD..][..Q4X8_RECORD];
            let (q, d, m) = block(r * blocks + b);
            scatter_words(q, i, rec);
            rec[128 + 2 * i..][..2].copy_from_slice(&d.to_le_bytes());
            rec[144 + 2 * i..][..2].copy_from_slice(&m.to_le_bytes());
        }
    }
    Packed::Q4x8(out)
}

/// Block `b` of row `row` of a `Q4x8` matrix with `blocks` blocks per row:
/// its 16 quant bytes in GGUF order, its scale and its minimum.
#[inline]
pub(crate) fn q4x8_block(data: &[u8], blocks: usize, row: usize, b: usize) -> ([u8; 16], u16, u16) {
    let rec = &data[((row / X8_ROWS) * blocks + b) * Q4X8_RECORD..][..Q4X8_RECORD];
    let i = row % X8_ROWS;
    let mut q = [0u8; 16];
    gather_words(rec, i, &mut q);
    let half = |at: usize| u16::from_le_bytes([rec[at], rec[at + 1]]);
    (q, half(128 + 2 * i), half(144 + 2 * i))
}

/// The `Q8x8` layout of an 8-bit matrix of `rows` rows of `blocks` blocks,
/// whose block `i` (row after row) is `block(i)`: 32 quant bytes, f16 scale.
pub(crate) fn interleave_q8<'a>(
    rows: usize,
    blocks: usize,
    block: impl Fn(usize) -> (&'a [u8], u16),
) -> Packed {
    let records = rows.div_ceil(X8_ROWS) * blocks;
    let mut out = AlignedBytes::zeroed(records * Q8X8_QUANTS);
    let mut scales = vec![0u16; records * X8_ROWS + SCALE_PAD];
    let data = out.as_mut_slice();
    for r in 0..rows {
        let i = r % X8_ROWS;
        for b in 0..blocks {
            let at = (r / X8_ROWS) * blocks + b;
            let (q, d) = block(r * blocks + b);
            scatter_words(q, i, &mut data[at * Q8X8_QUANTS..]);
            scales[at * X8_ROWS + i] = d;
        }
    }
    Packed::Q8x8 { qs: out, d: scales }
}

/// Block `b` of row `row` of a `Q8x8` matrix with `blocks` blocks per row:
/// its 32 quant bytes and its scale.
#[inline]
pub(crate) fn q8x8_block(
    qs: &[u8],
    d: &[u16],
    blocks: usize,
    row: usize,
    b: usize,
) -> ([u8; 32], u16) {
    let at = (row / X8_ROWS) * blocks + b;
    let i = row % X8_ROWS;
    let mut q = [0u8; 32];
    gather_words(&qs[at * Q8X8_QUANTS..][..Q8X8_QUANTS], i, &mut q);
    (q, d[at * X8_ROWS + i])
}

#[cfg(test)]
mod tests {
    use crate::kernels::testutil::{random_gguf_bytes, Rng};
    use crate::kernels::weights::tests::tensor;
    use crate::kernels::weights::Packed;
    use crate::kernels::{CpuKernels, WeightMatrix};
    use crate::model::DType;

    /// The interleaved layouts hold the same values as the row-major ones,
    /// in every row of a matrix whose last group of eight is partial.
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
            let mixed = WeightMatrix::from_tensor_for(&t, CpuKernels::Avx2).unwrap();
            assert!(matches!(plain.data, Packed::Q4 { .. } | Packed::Q8 { .. }));
            assert!(matches!(mixed.data, Packed::Q4x8(_) | Packed::Q8x8 { .. }));
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                plain.dequantize_row(r, &mut a);
                mixed.dequantize_row(r, &mut b);
                assert_eq!(a, b, "{dtype:?} row {r}");
            }
            let mut part = vec![0f32; 32];
            mixed.dequantize_range(12, 64, &mut part);
            assert_eq!(part, a[64..], "{dtype:?} last block of the last row");
        }
    }
}
