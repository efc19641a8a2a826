//! Scalar dequantization of every [`DType`] to `f32`: the simple reference
//! that tests compare the SIMD kernels against, and the loaders' converter.
//!
//! Block layouts are ggml's: Q8_0 is `d: f16, q: [i8; 32]` with
//! `x = d * q`; Q4_0 is `d: f16, q: [u8; 16]` with `x = d * (nibble - 8)`;
//! Q4_1 is `d: f16, m: f16, q: [u8; 16]` with `x = d * nibble + m`. In the
//! 4-bit formats byte `j` holds element `j` in its low nibble and element
//! `j + 16` in its high nibble.

use std::sync::Arc;

use half::{bf16, f16};

use super::{DType, Storage, Tensor};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes whole blocks of `dtype` from `bytes` into `out`; converts
/// `min(bytes / block_bytes, out / block_len)` blocks.
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes
        .chunks_exact(dtype.block_bytes())
        .zip(out.chunks_exact_mut(dtype.block_len()));
    for (b, o) in blocks {
        match dtype {
            DType::F32 => o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            DType::F16 => o[0] = f16_at(b, 0),
            DType::BF16 => o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            DType::Q8_0 => {
                let d = f16_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..]) {
                    *x = d * f32::from(q as i8);
                }
            }
            DType::Q4_0 => {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    o[j] = d * (f32::from(q & 0x0f) - 8.0);
                    o[j + 16] = d * (f32::from(q >> 4) - 8.0);
                }
            }
            DType::Q4_1 => {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for (j, &q) in b[4..].iter().enumerate() {
                    o[j] = d * f32::from(q & 0x0f) + m;
                    o[j + 16] = d * f32::from(q >> 4) + m;
                }
            }
        }
    }
}

/// All elements of `tensor` as `f32`, row-major.
pub fn dequantize(tensor: &Tensor) -> Vec<f32> {
    let mut out = vec![0.0; tensor.numel()];
    dequantize_into(tensor.dtype, tensor.storage.bytes(), &mut out);
    out
}

/// `tensor` converted to an owned F32 tensor of the same name and shape.
pub fn to_f32(tensor: &Tensor) -> Tensor {
    let bytes = dequantize(tensor)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    Tensor {
        name: tensor.name.clone(),
        dtype: DType::F32,
        shape: tensor.shape.clone(),
        storage: Storage::Owned(Arc::new(bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(dtype: DType, n: usize, bytes: Vec<u8>) -> Tensor {
        Tensor {
            name: "t".into(),
            dtype,
            shape: vec![n],
            storage: Storage::Owned(Arc::new(bytes)),
        }
    }

    #[test]
    fn q8_0_block_by_hand() {
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let got = dequantize(&tensor(DType::Q8_0, 32, b));
        let want: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 - 16.0)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn q4_0_nibble_order_by_hand() {
        let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
        // byte j: low nibble j % 16, high nibble 15 - j
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let got = dequantize(&tensor(DType::Q4_0, 32, b));
        for j in 0..16 {
            assert_eq!(got[j], 2.0 * (j as f32 - 8.0));
            assert_eq!(got[j + 16], 2.0 * (7.0 - j as f32));
        }
    }

    #[test]
    fn q4_1_scale_and_min_by_hand() {
        let mut b = f16::from_f32(0.25).to_le_bytes().to_vec();
        b.extend(f16::from_f32(-1.0).to_le_bytes());
        b.extend([0x10u8; 16]); // low nibble 0, high nibble 1
        let got = dequantize(&tensor(DType::Q4_1, 32, b));
        assert!(got[..16].iter().all(|&x| x == -1.0));
        assert!(got[16..].iter().all(|&x| x == -0.75));
    }

    #[test]
    fn floats_round_trip() {
        let xs = [1.5f32, -2.25, 0.0, 65504.0];
        let f32b: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f16b: Vec<u8> = xs
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = [1.5f32, -2.25, 0.0, 65536.0]
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(dequantize(&tensor(DType::F32, 4, f32b)), xs);
        assert_eq!(dequantize(&tensor(DType::F16, 4, f16b)), xs);
        assert_eq!(
            dequantize(&tensor(DType::BF16, 4, bf16b)),
            [1.5, -2.25, 0.0, 65536.0]
        );
    }
}
