//! The model's weights on the device in bf16: GGUF Q4_1 / Q8_0 / F16 / F32,
//! safetensors and dummy tensors are dequantized on the host at load
//! (host/src/model/dequant.rs) and uploaded; Q, K, V are stacked into one
//! QKV matrix and gate / up into one, so each is a single GEMM.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::device::{grid, Gpu, GpuError};
use crate::model::{dequant, LlamaConfig, ModelWeights, Tensor};

/// One transformer block's weights on the device.
pub struct DeviceLayer {
    /// RMSNorm before attention, f32 `[hidden]`.
    pub attn_norm: CudaSlice<f32>,
    /// Q, K, V stacked: bf16 `[(heads + 2 kv_heads) head_dim, hidden]`.
    pub qkv: CudaSlice<u16>,
    /// Output projection, bf16 `[hidden, heads head_dim]`.
    pub wo: CudaSlice<u16>,
    /// RMSNorm before the MLP, f32 `[hidden]`.
    pub ffn_norm: CudaSlice<f32>,
    /// Gate and up stacked: bf16 `[2 intermediate, hidden]`.
    pub gate_up: CudaSlice<u16>,
    /// Down projection, bf16 `[hidden, intermediate]`.
    pub down: CudaSlice<u16>,
}

/// A whole model on the device.
pub struct DeviceWeights {
    /// Token embedding, bf16 `[vocab, hidden]`.
    pub embed: CudaSlice<u16>,
    /// Separate output projection, when not tied.
    pub lm_head: Option<CudaSlice<u16>>,
    /// Final RMSNorm, f32 `[hidden]`.
    pub final_norm: CudaSlice<f32>,
    /// The blocks.
    pub layers: Vec<DeviceLayer>,
}

/// Tensors as bf16 bits, rows of each appended in order.
fn bf16_rows(tensors: &[&Tensor]) -> Vec<u16> {
    let mut out = Vec::with_capacity(tensors.iter().map(|t| t.numel()).sum());
    for t in tensors {
        out.extend(
            dequant::dequantize(t)
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_bits()),
        );
    }
    out
}

impl DeviceWeights {
    /// Dequantizes and uploads `weights` (progress logged per layer).
    pub fn upload(gpu: &Gpu, weights: &ModelWeights) -> Result<DeviceWeights, GpuError> {
        let s = &gpu.stream;
        let up = |t: &[&Tensor]| s.memcpy_stod(&bf16_rows(t));
        let norm = |t: &Tensor| s.memcpy_stod(&dequant::dequantize(t));
        let n = weights.layers.len();
        let mut layers = Vec::with_capacity(n);
        for (i, l) in weights.layers.iter().enumerate() {
            layers.push(DeviceLayer {
                attn_norm: norm(&l.attn_norm)?,
                qkv: up(&[&l.wq, &l.wk, &l.wv])?,
                wo: up(&[&l.wo])?,
                ffn_norm: norm(&l.ffn_norm)?,
                gate_up: up(&[&l.w_gate, &l.w_up])?,
                down: up(&[&l.w_down])?,
            });
            tracing::debug!(layer = i + 1, of = n, "cuda: weights uploaded");
        }
        Ok(DeviceWeights {
            embed: up(&[&weights.embed])?,
            lm_head: weights.lm_head.as_ref().map(|t| up(&[t])).transpose()?,
            final_norm: norm(&weights.final_norm)?,
            layers,
        })
    }

    /// Random weights of shape `c` made on the device (uniform, scaled by
    /// 1/sqrt(fan-in) so activations stay finite; norms 1), deterministic in
    /// `seed`: vLLM's `load_format = "dummy"` for models too large to make
    /// on the host quickly.
    pub fn random(gpu: &Gpu, c: &LlamaConfig, seed: u32) -> Result<DeviceWeights, GpuError> {
        let s = &gpu.stream;
        let mut counter = seed;
        let mut rand = |rows: usize, cols: usize| -> Result<CudaSlice<u16>, GpuError> {
            let n = rows * cols;
            let mut out = s.alloc_zeros::<u16>(n)?;
            let scale = 1.0f32 / (cols as f32).sqrt();
            counter = counter
                .wrapping_mul(747_796_405)
                .wrapping_add(2_891_336_453);
            let mut b = s.launch_builder(gpu.func("fill_random_bf16"));
            b.arg(&mut out).arg(&n).arg(&counter).arg(&scale);
            unsafe { b.launch(grid(1024, 256)) }?;
            Ok(out)
        };
        let (h, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            layers.push(DeviceLayer {
                attn_norm: s.memcpy_stod(&vec![1.0f32; h])?,
                qkv: rand(q + 2 * kv, h)?,
                wo: rand(h, q)?,
                ffn_norm: s.memcpy_stod(&vec![1.0f32; h])?,
                gate_up: rand(2 * c.intermediate_size, h)?,
                down: rand(h, c.intermediate_size)?,
            });
        }
        Ok(DeviceWeights {
            embed: rand(c.vocab_size, h)?,
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(rand(c.vocab_size, h)?)
            },
            final_norm: s.memcpy_stod(&vec![1.0f32; h])?,
            layers,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        let mut b = self.embed.num_bytes() + self.final_norm.num_bytes();
        b += self.lm_head.as_ref().map_or(0, |t| t.num_bytes());
        for l in &self.layers {
            b += l.attn_norm.num_bytes() + l.qkv.num_bytes() + l.wo.num_bytes();
            b += l.ffn_norm.num_bytes() + l.gate_up.num_bytes() + l.down.num_bytes();
        }
        b as u64
    }

    /// The output projection.
    pub fn output(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
    /// The bf16 matrices in a fixed order: embedding, LM head (if any),
    /// then each layer's QKV, O, gate/up and down.
    fn matrices(&self) -> Vec<&CudaSlice<u16>> {
        let mut out = vec![&self.embed];
        out.extend(self.lm_head.as_ref());
        for l in &self.layers {
            out.extend([&l.qkv, &l.wo, &l.gate_up, &l.down]);
        }
        out
    }

    /// The f32 norms in a fixed order: final, then each layer's two.
    fn norms(&self) -> Vec<&CudaSlice<f32>> {
        let mut out = vec![&self.final_norm];
        for l in &self.layers {
            out.extend([&l.attn_norm, &l.ffn_norm]);
        }
        out
    }

    /// Copies every tensor to host memory (sleep level 1); the device
    /// copies are freed when `self` is dropped.
    pub fn download(&self, gpu: &Gpu) -> Result<HostWeights, GpuError> {
        let s = &gpu.stream;
        Ok(HostWeights {
            matrices: self
                .matrices()
                .into_iter()
                .map(|t| s.memcpy_dtov(t))
                .collect::<Result<_, _>>()?,
            norms: self
                .norms()
                .into_iter()
                .map(|t| s.memcpy_dtov(t))
                .collect::<Result<_, _>>()?,
            has_lm_head: self.lm_head.is_some(),
        })
    }

    /// Uploads again what feeds the tensor `name` of `weights` after it
    /// changed: a norm, a single matrix, or the whole stacked QKV or
    /// gate/up matrix it is part of (same size, same buffer, so captured
    /// CUDA graphs stay valid).
    pub fn reload(
        &mut self,
        gpu: &Gpu,
        weights: &ModelWeights,
        name: &str,
    ) -> Result<(), GpuError> {
        let s = &gpu.stream;
        let bf16 = |dst: &mut CudaSlice<u16>, src: &[&Tensor]| s.memcpy_htod(&bf16_rows(src), dst);
        let norm =
            |dst: &mut CudaSlice<f32>, src: &Tensor| s.memcpy_htod(&dequant::dequantize(src), dst);
        if name == weights.embed.name {
            return Ok(bf16(&mut self.embed, &[&weights.embed])?);
        }
        if name == weights.final_norm.name {
            return Ok(norm(&mut self.final_norm, &weights.final_norm)?);
        }
        if let (Some(dst), Some(src)) = (self.lm_head.as_mut(), weights.lm_head.as_ref()) {
            if src.name == name {
                return Ok(bf16(dst, &[src])?);
            }
        }
        for (dst, l) in self.layers.iter_mut().zip(&weights.layers) {
            let names = |ts: &[&Tensor]| ts.iter().any(|t| t.name == name);
            if names(&[&l.wq, &l.wk, &l.wv]) {
                return Ok(bf16(&mut dst.qkv, &[&l.wq, &l.wk, &l.wv])?);
            } else if names(&[&l.w_gate, &l.w_up]) {
                return Ok(bf16(&mut dst.gate_up, &[&l.w_gate, &l.w_up])?);
            } else if l.wo.name == name {
                return Ok(bf16(&mut dst.wo, &[&l.wo])?);
            } else if l.w_down.name == name {
                return Ok(bf16(&mut dst.down, &[&l.w_down])?);
            } else if l.attn_norm.name == name {
                return Ok(norm(&mut dst.attn_norm, &l.attn_norm)?);
            } else if l.ffn_norm.name == name {
                return Ok(norm(&mut dst.ffn_norm, &l.ffn_norm)?);
            }
        }
        Err(GpuError::Unsupported(format!(
            "no weight named `{name}` on the device"
        )))
    }
}

/// The weights in host memory while the GPU sleeps at level 1, in
/// [`DeviceWeights`]' fixed order.
pub struct HostWeights {
    matrices: Vec<Vec<u16>>,
    norms: Vec<Vec<f32>>,
    has_lm_head: bool,
}

impl HostWeights {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.matrices.iter().map(|m| 2 * m.len()).sum::<usize>()
            + self.norms.iter().map(|n| 4 * n.len()).sum::<usize>()
    }

    /// Uploads them back (wake_up).
    pub fn upload(&self, gpu: &Gpu) -> Result<DeviceWeights, GpuError> {
        let s = &gpu.stream;
        let mut m = self.matrices.iter().map(|v| s.memcpy_stod(v));
        let mut n = self.norms.iter().map(|v| s.memcpy_stod(v));
        let missing = || GpuError::Unsupported("the offloaded weights are incomplete".into());
        let mut next_m = || m.next().ok_or_else(missing).and_then(|r| Ok(r?));
        let embed = next_m()?;
        let lm_head = if self.has_lm_head {
            Some(next_m()?)
        } else {
            None
        };
        let num_layers = (self.norms.len().saturating_sub(1)) / 2;
        let mut layers = Vec::with_capacity(num_layers);
        let mut next_n = || n.next().ok_or_else(missing).and_then(|r| Ok(r?));
        let final_norm = next_n()?;
        for _ in 0..num_layers {
            let (qkv, wo, gate_up, down) = (next_m()?, next_m()?, next_m()?, next_m()?);
            let (attn_norm, ffn_norm) = (next_n()?, next_n()?);
            layers.push(DeviceLayer {
                attn_norm,
                qkv,
                wo,
                ffn_norm,
                gate_up,
                down,
            });
        }
        Ok(DeviceWeights {
            embed,
            lm_head,
            final_norm,
            layers,
        })
    }
}
