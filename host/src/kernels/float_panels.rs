//! The layout of float weight matrices (F32, F16, BF16 checkpoints): the
//! 16-row panels the FMA microkernel reads ([`gemm`](super::gemm)), built
//! once at load instead of at every product.
//!
//! Panel `p` holds rows `16 p .. 16 p + 16` column after column
//! (`[k][16]`), in the checkpoint's own element type; the last panel is
//! padded with zero rows. A product then streams each panel from start to
//! end, widening 16-bit values in registers (exactly), where before it
//! gathered and converted every element into an f32 panel per call:
//! decoding with a bf16 checkpoint read its weights at ~4 GB/s, a seventh
//! of what this machine's memory gives.

use super::aligned::AlignedBytes;
use super::gemm::NR;
use super::kv_elem::KvElem;

/// `bytes`, a row-major `[rows, cols]` matrix of `N`-byte values
/// (little-endian, as checkpoints and this CPU store them), as panels.
pub(crate) fn to_panels<const N: usize>(bytes: &[u8], rows: usize, cols: usize) -> AlignedBytes {
    debug_assert_eq!(bytes.len(), rows * cols * N);
    let mut out = AlignedBytes::zeroed(rows.div_ceil(NR) * NR * cols * N);
    let panels = out.as_mut_slice();
    for (r, row) in bytes.chunks_exact(cols * N).enumerate() {
        let start = index(r, 0, cols) * N;
        for (k, value) in row.chunks_exact(N).enumerate() {
            let at = start + k * NR * N;
            panels[at..at + N].copy_from_slice(value);
        }
    }
    out
}

/// Where `W[row, k]` lies in the panels of a `cols`-wide matrix.
pub(crate) fn index(row: usize, k: usize, cols: usize) -> usize {
    (row / NR * cols + k) * NR + row % NR
}

/// The panels' values as `E`, the matrix's element type.
pub(crate) fn elems<E: KvElem>(panels: &AlignedBytes) -> &[E] {
    let bytes = panels.as_slice();
    // SAFETY: the buffer starts 64-byte aligned, which suits f32, f16 and
    // bf16; `KvElem` types are plain data of which every bit pattern is a
    // value; the length is rounded down to whole values.
    unsafe {
        std::slice::from_raw_parts(
            bytes.as_ptr().cast::<E>(),
            bytes.len() / std::mem::size_of::<E>(),
        )
    }
}

/// `out[j] = W[row, k0 + j]` from the panels of a `cols`-wide matrix.
pub(crate) fn read_row<E: KvElem>(
    panels: &[E],
    cols: usize,
    row: usize,
    k0: usize,
    out: &mut [f32],
) {
    let start = index(row, k0, cols);
    for (j, o) in out.iter_mut().enumerate() {
        *o = panels[start + j * NR].to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_hold_each_value_where_index_says_and_pad_with_zeros() {
        let (rows, cols) = (37, 5);
        let values: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 1.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let panels = to_panels::<4>(&bytes, rows, cols);
        let got = elems::<f32>(&panels);
        assert_eq!(got.len(), 48 * cols, "three panels of 16 rows");
        for r in 0..rows {
            for k in 0..cols {
                assert_eq!(got[index(r, k, cols)], values[r * cols + k], "({r}, {k})");
            }
        }
        let filled = got.iter().filter(|&&v| v != 0.0).count();
        assert_eq!(filled, rows * cols, "padding rows are zero");
        let mut row = [0f32; 3];
        read_row(got, cols, 36, 2, &mut row);
        assert_eq!(row, [36.0 * 5.0 + 3.0, 36.0 * 5.0 + 4.0, 36.0 * 5.0 + 5.0]);
    }
}
