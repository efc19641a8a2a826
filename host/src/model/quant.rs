//! Scalar quantization of `f32` data to every [`DType`], with ggml's
//! reference rounding (see [`super::dequant`] for the block layouts). Used
//! to build dummy weights in quantized formats and in tests.

use half::{bf16, f16};

use super::DType;

/// Quantizes `data` to `dtype`, or `None` when its length is not a whole
/// number of blocks.
pub fn quantize(dtype: DType, data: &[f32]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(dtype.bytes_for(data.len())?);
    for block in data.chunks_exact(dtype.block_len()) {
        match dtype {
            DType::F32 => out.extend(block[0].to_le_bytes()),
            DType::F16 => out.extend(f16::from_f32(block[0]).to_le_bytes()),
            DType::BF16 => out.extend(bf16::from_f32(block[0]).to_le_bytes()),
            DType::Q8_0 => quantize_q8_0(block, &mut out),
            DType::Q4_0 => quantize_q4_0(block, &mut out),
            DType::Q4_1 => quantize_q4_1(block, &mut out),
        }
    }
    Some(out)
}

/// `1/d`, or 0 for an all-zero block so every value quantizes to zero.
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Scale so the largest magnitude maps to ±127, rounded half away from zero.
fn quantize_q8_0(block: &[f32], out: &mut Vec<u8>) {
    let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
}

/// The value of largest magnitude maps to -8 (keeping its sign), so the
/// 16 levels cover [-8d, 7d].
fn quantize_q4_0(block: &[f32], out: &mut Vec<u8>) {
    let max = block
        .iter()
        .fold(0.0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
    let d = max / -8.0;
    let id = inverse(d);
    out.extend(f16::from_f32(d).to_le_bytes());
    let q = |x: f32| ((x * id + 8.5) as u8).min(15);
    out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
}

/// 16 levels spread evenly from the block's minimum to its maximum.
fn quantize_q4_1(block: &[f32], out: &mut Vec<u8>) {
    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(min).to_le_bytes());
    let q = |x: f32| (((x - min) * id + 0.5) as u8).min(15);
    out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::model::dequant::dequantize;
    use crate::model::{Storage, Tensor};

    fn round_trip(dtype: DType, xs: &[f32]) -> Vec<f32> {
        let bytes = quantize(dtype, xs).expect("whole blocks");
        assert_eq!(Some(bytes.len()), dtype.bytes_for(xs.len()));
        let t = Tensor {
            name: "t".into(),
            dtype,
            shape: vec![xs.len()],
            storage: Storage::Owned(Arc::new(bytes)),
        };
        dequantize(&t)
    }

    #[test]
    fn partial_blocks_are_rejected() {
        assert_eq!(quantize(DType::Q8_0, &[0.0; 33]), None);
        assert!(quantize(DType::F16, &[0.0; 33]).is_some());
    }

    #[test]
    fn zero_blocks_stay_zero() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            assert!(
                round_trip(dtype, &[0.0; 64]).iter().all(|&x| x == 0.0),
                "{dtype:?}"
            );
        }
    }

    proptest! {
        /// Every element comes back within half a quantization step (plus
        /// the f16 rounding of the scale and minimum).
        #[test]
        fn round_trip_error_is_within_half_a_step(
            xs in prop::collection::vec(-4.0f32..4.0, 64),
        ) {
            for block in xs.chunks(32) {
                let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let cases = [
                    (DType::Q8_0, amax / 127.0 * 0.5 + amax * 2e-3),
                    // The end opposite the largest magnitude is clipped a full step.
                    (DType::Q4_0, amax / 8.0 + amax * 1e-2),
                    (DType::Q4_1, (max - min) / 15.0 * 0.5 + (max - min + max.abs().max(min.abs())) * 2e-3),
                    (DType::F16, amax * 1e-3),
                    (DType::BF16, amax * 8e-3),
                    (DType::F32, 0.0),
                ];
                for (dtype, tol) in cases {
                    let got = round_trip(dtype, block);
                    for (g, x) in got.iter().zip(block) {
                        prop_assert!((g - x).abs() <= tol, "{dtype:?}: {g} vs {x}, tol {tol}");
                    }
                }
            }
        }
    }
}
