//! Helpers shared by the kernel unit tests: a seeded generator and random
//! quantized tensors in GGUF's byte layout.

use half::f16;

use crate::model::DType;

/// A small deterministic generator (xorshift64*), so failures reproduce.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform 64 bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller).
    pub(crate) fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// `n` standard normal values.
    pub(crate) fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Random GGUF bytes for a `rows x cols` matrix of `dtype`, with scales
/// around `0.01`, as in real checkpoints.
pub(crate) fn random_gguf_bytes(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let h = |x: f32| f16::from_f32(x).to_le_bytes();
    let mut out = Vec::with_capacity(dtype.bytes_for(n).unwrap_or(0));
    match dtype {
        DType::F32 => (0..n).for_each(|_| out.extend(rng.normal().to_le_bytes())),
        DType::F16 => (0..n).for_each(|_| out.extend(h(rng.normal()))),
        DType::BF16 => {
            (0..n).for_each(|_| out.extend(half::bf16::from_f32(rng.normal()).to_le_bytes()))
        }
        DType::Q8_0 => {
            for _ in 0..n / 32 {
                out.extend(h(0.001 + 0.01 * rng.uniform()));
                // The full i8 range, -128 included: the sign trick must cope.
                (0..32).for_each(|_| out.push(rng.next_u64() as u8));
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            for _ in 0..n / 32 {
                out.extend(h(0.001 + 0.01 * rng.uniform()));
                if dtype == DType::Q4_1 {
                    out.extend(h(-0.08 * rng.uniform()));
                }
                (0..16).for_each(|_| out.push(rng.next_u64() as u8));
            }
        }
    }
    out
}
