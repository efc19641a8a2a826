//! [`WeightMatrix`]: a weight matrix repacked at load time for the kernels.
//!
//! GGUF interleaves each block's f16 scale(s) with its quants (18, 20 or 34
//! byte blocks), so block starts are unaligned. We split every quantized
//! matrix into a 64-byte aligned array of quants and separate arrays of f16
//! scales: the same number of bytes (decode streams every weight once per
//! token, so bytes are time), but aligned SIMD loads and eight scales
//! converted by one F16C instruction. Q4_0 is stored as Q4_1 with the
//! minimum `m = -8 d`, so one 4-bit kernel serves both.
//!
//! The AVX2 and AVX-512 families want quantized matrices with groups of
//! rows interleaved ([`Packed::Q4Interleaved`], [`Packed::Q8Interleaved`]);
//! [`WeightMatrix::from_tensor_for`] repacks them so at load (the same
//! bytes again, never a second copy). Float matrices are stored in the
//! 16-row panels the FMA microkernel reads, whatever the family
//! ([`Packed::FloatPanels`]).

use half::{bf16, f16};

use super::aligned::AlignedBytes;
use super::cpu::CpuKernels;
use super::float_panels::{elems, read_row, to_panels};
use super::interleaved::{interleave_q4, interleave_q8, q4_block_at, q8_block_at};
use super::KernelError;
use crate::model::{DType, Tensor};

/// Elements per quantization block.
pub(crate) const QK: usize = 32;

/// A weight matrix `[rows, cols]` in the layout the kernels want.
pub struct WeightMatrix {
    /// Output features.
    rows: usize,
    /// Input features.
    cols: usize,
    /// The checkpoint's element type.
    dtype: DType,
    /// The repacked data.
    pub(crate) data: Packed,
}

/// Zero scales appended to every scale array, so SIMD code can load eight
/// scales starting at any block without a bounds check.
pub(crate) const SCALE_PAD: usize = 8;

/// Repacked weight data; per-row arrays are concatenated row after row, and
/// scale arrays end with [`SCALE_PAD`] zeros.
pub(crate) enum Packed {
    /// Float values (F32, F16 or BF16, the matrix's `dtype`) in 16-row
    /// panels (see [`float_panels`](super::float_panels)).
    FloatPanels(AlignedBytes),
    /// 8-bit blocks: `qs` holds `rows * cols` signed bytes, `d` one f16 scale
    /// per block (`rows * cols / 32`).
    Q8 { qs: AlignedBytes, d: Vec<u16> },
    /// 4-bit blocks (Q4_1, and Q4_0 with `m = -8 d`): `qs` holds 16 bytes
    /// per block in GGUF nibble order (value `j` in the low nibble of byte
    /// `j`, value `j + 16` in its high nibble); value = `q * d + m`.
    Q4 {
        qs: AlignedBytes,
        d: Vec<u16>,
        m: Vec<u16>,
    },
    /// `Q4` with `group` rows interleaved, scales beside their quants (see
    /// [`interleaved`](super::interleaved)).
    Q4Interleaved { data: AlignedBytes, group: usize },
    /// `Q8` with `group` rows interleaved (see [`interleaved`](super::interleaved)):
    /// `d` holds the group's scales of each block, group after group.
    Q8Interleaved {
        qs: AlignedBytes,
        d: Vec<u16>,
        group: usize,
    },
}

impl WeightMatrix {
    /// Repacks a 2-D tensor (F32, F16, BF16, Q8_0, Q4_0 or Q4_1) in the
    /// layout of the active kernel family ([`CpuKernels::active`]).
    pub fn from_tensor(t: &Tensor) -> Result<WeightMatrix, KernelError> {
        WeightMatrix::from_tensor_for(t, CpuKernels::active())
    }

    /// [`from_tensor`](Self::from_tensor) in the layout `kernels` wants.
    /// Every family computes the same bits from either layout; the layout
    /// only decides speed (tests and benchmarks choose it).
    pub fn from_tensor_for(t: &Tensor, kernels: CpuKernels) -> Result<WeightMatrix, KernelError> {
        WeightMatrix::from_tensor_in(t, kernels.interleave_group())
    }

    /// [`from_tensor`](Self::from_tensor) with quantized matrices in groups
    /// of `group` interleaved rows, or row after row for `None`.
    pub(crate) fn from_tensor_in(
        t: &Tensor,
        group: Option<usize>,
    ) -> Result<WeightMatrix, KernelError> {
        if t.shape.len() != 2 || t.shape.contains(&0) {
            return Err(KernelError::NotAMatrix {
                name: t.name.clone(),
                shape: t.shape.clone(),
            });
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        if cols % t.dtype.block_len() != 0 {
            return Err(KernelError::RaggedBlocks {
                name: t.name.clone(),
                cols,
                dtype: t.dtype,
            });
        }
        let bytes = t.storage.bytes();
        let expected = t.dtype.bytes_for(rows * cols);
        if expected != Some(bytes.len()) {
            return Err(KernelError::WrongByteLength {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                expected,
                actual: bytes.len(),
            });
        }
        let data = match t.dtype {
            DType::F32 => Packed::FloatPanels(to_panels::<4>(bytes, rows, cols)),
            DType::F16 | DType::BF16 => Packed::FloatPanels(to_panels::<2>(bytes, rows, cols)),
            // Straight from the checkpoint's blocks: no row-major copy first.
            DType::Q8_0 => match group {
                Some(g) => interleave_q8(g, rows, cols / QK, |i| q8_0_block(bytes, i)),
                None => repack_q8_0(bytes),
            },
            DType::Q4_0 | DType::Q4_1 => match group {
                Some(g) => interleave_q4(g, rows, cols / QK, |i| q4_block(bytes, t.dtype, i)),
                None => repack_q4(bytes, t.dtype),
            },
        };
        Ok(WeightMatrix {
            rows,
            cols,
            dtype: t.dtype,
            data,
        })
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The element type of the checkpoint this matrix came from.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its bulk: the float panels, or the quantized bytes (their scales are
    /// a sixteenth or less).
    fn bulk_mut(&mut self) -> &mut AlignedBytes {
        match &mut self.data {
            Packed::FloatPanels(panels) => panels,
            Packed::Q8 { qs, .. }
            | Packed::Q4 { qs, .. }
            | Packed::Q8Interleaved { qs, .. }
            | Packed::Q4Interleaved { data: qs, .. } => qs,
        }
    }

    /// Writes row `row` as f32 into `out` (`cols` long): the embedding lookup.
    ///
    /// Panics if `row >= rows` or `out.len() != cols` (caller bugs).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "row {row} out of range for a matrix of {} rows",
            self.rows
        );
        assert_eq!(
            out.len(),
            self.cols,
            "dequantize_row: output length must equal cols"
        );
        self.dequantize_range(row, 0, out);
    }

    /// Writes `W[row, k0 .. k0 + out.len()]` as f32. For quantized types `k0`
    /// and `out.len()` must be multiples of 32.
    pub(crate) fn dequantize_range(&self, row: usize, k0: usize, out: &mut [f32]) {
        let start = row * self.cols + k0;
        let n = out.len();
        match &self.data {
            Packed::FloatPanels(panels) => match self.dtype {
                DType::F32 => read_row(elems::<f32>(panels), self.cols, row, k0, out),
                DType::F16 => read_row(elems::<f16>(panels), self.cols, row, k0, out),
                DType::BF16 => read_row(elems::<bf16>(panels), self.cols, row, k0, out),
                other => unreachable!("float panels hold F32, F16 or BF16, not {other:?}"),
            },
            Packed::Q8 { qs, d } => {
                debug_assert!(start.is_multiple_of(QK) && n.is_multiple_of(QK));
                let qs = &qs.as_slice()[start..start + n];
                for (b, (o, q)) in out
                    .chunks_exact_mut(QK)
                    .zip(qs.chunks_exact(QK))
                    .enumerate()
                {
                    dequantize_q8(q, f16_to_f32(d[start / QK + b]), o);
                }
            }
            Packed::Q8Interleaved { qs, d, group } => {
                debug_assert!(k0.is_multiple_of(QK) && n.is_multiple_of(QK));
                for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                    let data = (qs.as_slice(), d.as_slice());
                    let (q, d) = q8_block_at(data, *group, self.cols / QK, row, k0 / QK + b);
                    dequantize_q8(&q, f16_to_f32(d), o);
                }
            }
            Packed::Q4 { qs, d, m } => {
                debug_assert!(start.is_multiple_of(QK) && n.is_multiple_of(QK));
                let qs = &qs.as_slice()[start / 2..(start + n) / 2];
                for (b, (o, q)) in out
                    .chunks_exact_mut(QK)
                    .zip(qs.chunks_exact(QK / 2))
                    .enumerate()
                {
                    let (scale, min) =
                        (f16_to_f32(d[start / QK + b]), f16_to_f32(m[start / QK + b]));
                    dequantize_q4(q, scale, min, o);
                }
            }
            Packed::Q4Interleaved { data, group } => {
                debug_assert!(k0.is_multiple_of(QK) && n.is_multiple_of(QK));
                for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                    let (q, d, m) =
                        q4_block_at(data.as_slice(), *group, self.cols / QK, row, k0 / QK + b);
                    dequantize_q4(&q, f16_to_f32(d), f16_to_f32(m), o);
                }
            }
        }
    }
}

/// Moves the bulk of `matrices` (a model's, all loaded: float panels or
/// quantized bytes) into one allocation on huge pages, values unchanged: a
/// decode reads every weight once per token, and on 4 KiB pages nearly
/// every page of them costs a TLB miss (see [`aligned::pack`](super::aligned::pack)).
pub fn pack_weights<'a>(matrices: impl IntoIterator<Item = &'a mut WeightMatrix>) {
    let mut bulk: Vec<&mut AlignedBytes> =
        matrices.into_iter().map(WeightMatrix::bulk_mut).collect();
    super::aligned::pack(&mut bulk);
}

/// One 8-bit block as 32 floats.
fn dequantize_q8(q: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(q) {
        *o = f32::from(q as i8) * scale;
    }
}

/// One 4-bit block (16 bytes, GGUF nibble order) as 32 floats.
fn dequantize_q4(q: &[u8], scale: f32, min: f32, out: &mut [f32]) {
    for (j, &byte) in q.iter().enumerate() {
        out[j] = f32::from(byte & 0x0F) * scale + min;
        out[j + QK / 2] = f32::from(byte >> 4) * scale + min;
    }
}

impl std::fmt::Debug for WeightMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("dtype", &self.dtype)
            .finish()
    }
}

/// IEEE half bits to f32.
#[inline]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// GGUF Q8_0 block `i` of `bytes` (f16 d, 32 x i8): its quants and scale.
fn q8_0_block(bytes: &[u8], i: usize) -> (&[u8], u16) {
    let block = &bytes[i * 34..][..34];
    (&block[2..], u16::from_le_bytes([block[0], block[1]]))
}

/// GGUF Q4_1 (f16 d, f16 m, 16 bytes) or Q4_0 (f16 d, 16 bytes) block `i`
/// of `bytes`: its 16 quant bytes, scale and minimum (Q4_0's is `-8 d`).
fn q4_block(bytes: &[u8], dtype: DType, i: usize) -> (&[u8], u16, u16) {
    let block_bytes = dtype.block_bytes();
    let block = &bytes[i * block_bytes..][..block_bytes];
    let scale = u16::from_le_bytes([block[0], block[1]]);
    let min = if dtype == DType::Q4_1 {
        u16::from_le_bytes([block[2], block[3]])
    } else {
        // Exact: multiplying an f16 by a power of two only changes its exponent.
        f16::from_f32(-8.0 * f16_to_f32(scale)).to_bits()
    };
    (&block[block_bytes - QK / 2..], scale, min)
}

/// Splits GGUF Q8_0 blocks into quants and scales.
fn repack_q8_0(bytes: &[u8]) -> Packed {
    let blocks = bytes.len() / 34;
    let mut qs = AlignedBytes::zeroed(blocks * QK);
    let mut d = Vec::with_capacity(blocks + SCALE_PAD);
    for (i, out) in qs.as_mut_slice().chunks_exact_mut(QK).enumerate() {
        let (q, scale) = q8_0_block(bytes, i);
        out.copy_from_slice(q);
        d.push(scale);
    }
    d.extend([0; SCALE_PAD]);
    Packed::Q8 { qs, d }
}

/// Splits GGUF Q4_1 or Q4_0 blocks into quants, scales and minimums.
fn repack_q4(bytes: &[u8], dtype: DType) -> Packed {
    let blocks = bytes.len() / dtype.block_bytes();
    let mut qs = AlignedBytes::zeroed(blocks * QK / 2);
    let (mut d, mut m) = (
        Vec::with_capacity(blocks + SCALE_PAD),
        Vec::with_capacity(blocks + SCALE_PAD),
    );
    for (i, out) in qs.as_mut_slice().chunks_exact_mut(QK / 2).enumerate() {
        let (q, scale, min) = q4_block(bytes, dtype, i);
        out.copy_from_slice(q);
        d.push(scale);
        m.push(min);
    }
    d.extend([0; SCALE_PAD]);
    m.extend([0; SCALE_PAD]);
    Packed::Q4 { qs, d, m }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Storage;
    use std::sync::Arc;

    /// A tensor named "w" over owned bytes.
    pub(crate) fn tensor(dtype: DType, rows: usize, cols: usize, bytes: Vec<u8>) -> Tensor {
        Tensor {
            name: "w".into(),
            dtype,
            shape: vec![rows, cols],
            storage: Storage::Owned(Arc::new(bytes)),
        }
    }

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_1_block_with_known_values() {
        // d = 0.5, m = -1, byte j = (lo = j % 16, hi = 15 - j % 16).
        let mut block = Vec::new();
        block.extend(h(0.5));
        block.extend(h(-1.0));
        block.extend((0u8..16).map(|j| j | ((15 - j) << 4)));
        let w = WeightMatrix::from_tensor(&tensor(DType::Q4_1, 1, 32, block)).unwrap();
        let mut out = [0f32; 32];
        w.dequantize_row(0, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0, "low nibble {j}");
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0, "high nibble {j}");
        }
    }

    #[test]
    fn q4_0_block_with_known_values() {
        let mut block = Vec::new();
        block.extend(h(0.25));
        block.extend((0u8..16).map(|j| j | ((15 - j) << 4)));
        let w = WeightMatrix::from_tensor(&tensor(DType::Q4_0, 1, 32, block)).unwrap();
        let mut out = [0f32; 32];
        w.dequantize_row(0, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.25);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 0.25);
        }
    }

    #[test]
    fn q8_0_second_row_with_known_values() {
        let mut bytes = Vec::new();
        for (row, scale) in [(0, 1.0f32), (1, 0.125)] {
            bytes.extend(h(scale));
            bytes.extend((0..32).map(|j| ((j as i8 - 16) * (row + 1)) as u8));
        }
        let w = WeightMatrix::from_tensor(&tensor(DType::Q8_0, 2, 32, bytes)).unwrap();
        let mut out = [0f32; 32];
        w.dequantize_row(1, &mut out);
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(v, (j as f32 - 16.0) * 2.0 * 0.125);
        }
    }

    #[test]
    fn float_types_convert_exactly() {
        let vals = [1.5f32, -2.0, 0.0, 3.25, 65504.0, -0.5];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        for (dtype, bytes) in [(DType::F32, f32b), (DType::F16, f16b), (DType::BF16, bf16b)] {
            let w = WeightMatrix::from_tensor(&tensor(dtype, 2, 3, bytes)).unwrap();
            let mut out = [0f32; 3];
            w.dequantize_row(1, &mut out);
            let expect: Vec<f32> = vals[3..]
                .iter()
                .map(|&v| {
                    if dtype == DType::BF16 {
                        bf16::from_f32(v).to_f32()
                    } else {
                        v
                    }
                })
                .collect();
            assert_eq!(out.to_vec(), expect, "{dtype:?}");
        }
    }

    #[test]
    fn malformed_tensors_are_rejected_with_their_name() {
        let err = WeightMatrix::from_tensor(&tensor(DType::Q4_1, 1, 33, vec![0; 40])).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
        assert!(matches!(err, KernelError::RaggedBlocks { cols: 33, .. }));
        let err = WeightMatrix::from_tensor(&tensor(DType::Q8_0, 2, 32, vec![0; 34])).unwrap_err();
        assert!(
            matches!(err, KernelError::WrongByteLength { actual: 34, .. }),
            "{err}"
        );
        let mut t = tensor(DType::F32, 1, 4, vec![0; 16]);
        t.shape = vec![4];
        assert!(matches!(
            WeightMatrix::from_tensor(&t),
            Err(KernelError::NotAMatrix { .. })
        ));
    }
}
