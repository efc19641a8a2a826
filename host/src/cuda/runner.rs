//! [`GpuModelRunner`]: the llama forward pass on one GPU over a paged bf16
//! KV cache, for a flattened batch that mixes prefill chunks and decodes —
//! the same inputs and outputs as the CPU runner, so the two are compared
//! directly (tests/gpu.rs).
//!
//! Per layer: fused add+RMSNorm → QKV GEMM → RoPE → K/V into the cache →
//! paged attention → O GEMM → fused add+RMSNorm → gate/up GEMM → SiLU·mul →
//! down GEMM. Activation buffers are allocated once for
//! `max_num_batched_tokens`, so the activation peak is known exactly.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::device::{grid, Gpu, GpuError};
use super::metadata::AttentionMetadata;
use super::weights::DeviceWeights;
use crate::model::LlamaConfig;
use crate::model_runner::{Logits, ModelInput};

/// Query rows per attention block (ATTN_ROWS in attention.cu).
const ATTN_ROWS: usize = 16;
/// Threads per attention block (ATTN_WARPS * 32 in attention.cu).
const ATTN_THREADS: u32 = 128;
/// Largest head the attention kernel holds (ATTN_MAX_DIM).
const ATTN_MAX_DIM: usize = 128;

/// Activation buffers for up to `tokens` tokens.
struct Activations {
    tokens: usize,
    /// Residual stream, bf16 `[tokens, hidden]`.
    h: CudaSlice<u16>,
    /// Normed input of a sub-block, `[tokens, hidden]`.
    x: CudaSlice<u16>,
    /// QKV projection, `[tokens, q + 2 kv]`.
    qkv: CudaSlice<u16>,
    /// Attention output, `[tokens, q]`.
    attn: CudaSlice<u16>,
    /// Gate/up projection, `[tokens, 2 intermediate]`.
    gate_up: CudaSlice<u16>,
    /// SiLU(gate)·up, `[tokens, intermediate]`.
    act: CudaSlice<u16>,
    /// Output of the O and down projections, `[tokens, hidden]`.
    o: CudaSlice<u16>,
    /// Each sequence's last normed row, `[tokens, hidden]`.
    last: CudaSlice<u16>,
    /// Logits, f32 `[tokens, vocab]`.
    logits: CudaSlice<f32>,
}

impl Activations {
    fn new(gpu: &Gpu, c: &LlamaConfig, tokens: usize) -> Result<Activations, GpuError> {
        let s = &gpu.stream;
        let (h, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        Ok(Activations {
            tokens,
            h: s.alloc_zeros(tokens * h)?,
            x: s.alloc_zeros(tokens * h)?,
            qkv: s.alloc_zeros(tokens * (q + 2 * kv))?,
            attn: s.alloc_zeros(tokens * q)?,
            gate_up: s.alloc_zeros(tokens * 2 * c.intermediate_size)?,
            act: s.alloc_zeros(tokens * c.intermediate_size)?,
            o: s.alloc_zeros(tokens * h)?,
            last: s.alloc_zeros(tokens * h)?,
            logits: s.alloc_zeros(tokens * c.vocab_size)?,
        })
    }

    fn bytes(&self) -> u64 {
        [
            &self.h,
            &self.x,
            &self.qkv,
            &self.attn,
            &self.gate_up,
            &self.act,
            &self.o,
            &self.last,
        ]
        .iter()
        .map(|b| b.num_bytes() as u64)
        .sum::<u64>()
            + self.logits.num_bytes() as u64
    }
}

/// The paged KV cache: per layer K and V, bf16
/// `[num_blocks, block_size, kv_heads, head_dim]`, in two allocations.
pub struct DeviceKvCache {
    /// Blocks per layer.
    pub num_blocks: usize,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    /// Elements of one layer's K (or V).
    layer_len: usize,
}

/// The GPU model runner of a llama-family model.
pub struct GpuModelRunner {
    config: LlamaConfig,
    block_size: usize,
    max_model_len: usize,
    weights: DeviceWeights,
    act: Activations,
    kv: Option<DeviceKvCache>,
}

impl GpuModelRunner {
    /// A runner over `weights` already on the device.
    pub fn new(
        gpu: &Gpu,
        config: LlamaConfig,
        weights: DeviceWeights,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        block_size: usize,
    ) -> Result<GpuModelRunner, GpuError> {
        let c = &config;
        if c.head_dim > ATTN_MAX_DIM
            || c.head_dim % 32 != 0
            || c.num_attention_heads % c.num_key_value_heads != 0
        {
            return Err(GpuError::Unsupported(format!(
                "head_dim {} with {} query / {} KV heads: the attention kernel needs head_dim a \
                 multiple of 32 up to {ATTN_MAX_DIM} and whole GQA groups",
                c.head_dim, c.num_attention_heads, c.num_key_value_heads
            )));
        }
        if max_num_batched_tokens == 0 || block_size == 0 || max_model_len == 0 {
            return Err(GpuError::Unsupported(
                "max_num_batched_tokens, max_model_len and block_size must be at least 1".into(),
            ));
        }
        let act = Activations::new(gpu, c, max_num_batched_tokens)?;
        Ok(GpuModelRunner {
            config,
            block_size,
            max_model_len,
            weights,
            act,
            kv: None,
        })
    }

    /// The model's hyper-parameters.
    pub fn model_config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes()
    }

    /// Bytes of the activation buffers (the activation peak: they are sized
    /// for the largest step and never grow).
    pub fn activation_bytes(&self) -> u64 {
        self.act.bytes()
    }

    /// Bytes one KV block takes across all layers (K and V, bf16).
    pub fn bytes_per_block(&self) -> usize {
        let c = &self.config;
        2 * 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim
    }

    /// Allocates (or replaces) the KV cache with `num_blocks` blocks.
    pub fn initialize_kv_cache(&mut self, gpu: &Gpu, num_blocks: usize) -> Result<(), GpuError> {
        self.kv = None;
        let c = &self.config;
        let layer_len = num_blocks * self.block_size * c.num_key_value_heads * c.head_dim;
        let total = layer_len * c.num_hidden_layers;
        self.kv = Some(DeviceKvCache {
            num_blocks,
            k: gpu.stream.alloc_zeros(total)?,
            v: gpu.stream.alloc_zeros(total)?,
            layer_len,
        });
        Ok(())
    }

    /// Drops the KV cache (sleep, shutdown, or before a resize).
    pub fn free_kv_cache(&mut self) {
        self.kv = None;
    }

    /// Runs one step and returns each sequence's last-token logits.
    pub fn execute_model(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<Logits, GpuError> {
        let (ns, vocab) = (input.seqs.len(), self.config.vocab_size);
        let logits = self.forward(gpu, input)?;
        let data = gpu.stream.memcpy_dtov(&logits.slice(..ns * vocab))?;
        Ok(Logits {
            num_seqs: ns,
            vocab_size: vocab,
            data,
        })
    }

    /// The forward pass; the logits stay on the device (for device sampling).
    pub fn forward(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<&CudaSlice<f32>, GpuError> {
        let Self {
            config: c,
            block_size,
            max_model_len,
            weights: w,
            act: a,
            kv,
        } = self;
        let kv = kv.as_mut().ok_or_else(|| {
            GpuError::Unsupported(
                "the KV cache is not allocated; call initialize_kv_cache first".into(),
            )
        })?;
        let n = input.token_ids.len();
        let limits = crate::model_runner::InputLimits {
            vocab_size: c.vocab_size,
            max_model_len: *max_model_len,
            max_num_batched_tokens: a.tokens,
            num_blocks: kv.num_blocks,
            block_size: *block_size,
        };
        input
            .validate(&limits)
            .map_err(|e| GpuError::Unsupported(e.to_string()))?;
        let meta = AttentionMetadata::build(input, *block_size, 0);
        let s = &gpu.stream;
        let ids: Vec<i32> = input.token_ids.iter().map(|&t| t as i32).collect();
        let positions: Vec<i32> = input.positions.iter().map(|&p| p as i32).collect();
        let ids = s.memcpy_stod(&ids)?;
        let positions = s.memcpy_stod(&positions)?;
        let slots = s.memcpy_stod(&meta.slot_mapping)?;
        let qstart = s.memcpy_stod(&meta.query_start)?;
        let seq_lens = s.memcpy_stod(&meta.seq_lens)?;
        let tables = s.memcpy_stod(&meta.block_tables)?;
        let last_rows = s.memcpy_stod(&meta.logits_rows)?;

        let hid = c.hidden_size as i32;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i32,
            c.num_key_value_heads as i32,
            c.head_dim as i32,
        );
        let qd = (c.num_attention_heads * c.head_dim) as usize;
        let stride = (qd + 2 * c.num_key_value_heads * c.head_dim) as i32;
        let inter = c.intermediate_size;
        let (eps, ntok) = (c.rms_norm_eps, n as u32);
        let rows = grid(ntok, 256);
        let norm = |out: &mut CudaSlice<u16>,
                    res: &mut CudaSlice<u16>,
                    x: &CudaSlice<u16>,
                    wt: &CudaSlice<f32>,
                    add: i32| {
            let mut b = s.launch_builder(gpu.func("fused_add_rms_norm"));
            b.arg(out)
                .arg(res)
                .arg(x)
                .arg(wt)
                .arg(&eps)
                .arg(&hid)
                .arg(&add);
            unsafe { b.launch(rows) }.map(|_| ())
        };

        // The embedding goes where layer 0's norm reads its input.
        let mut b = s.launch_builder(gpu.func("gather_rows"));
        b.arg(&mut a.o).arg(&w.embed).arg(&ids).arg(&hid);
        unsafe { b.launch(rows) }?;
        let scale = 1.0f32 / (c.head_dim as f32).sqrt();
        let row_tiles = (meta.max_query_len * (c.num_attention_heads / c.num_key_value_heads))
            .div_ceil(ATTN_ROWS);
        let attn_grid = LaunchConfig {
            grid_dim: (row_tiles as u32, nkv as u32, input.seqs.len() as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (max_blocks, bs) = (meta.max_blocks as i32, *block_size as i32);
        for (i, l) in w.layers.iter().enumerate() {
            // Layer 0 takes the embedding as its residual; later ones add
            // the previous MLP output to it.
            norm(&mut a.x, &mut a.h, &a.o, &l.attn_norm, i32::from(i > 0))?;
            gpu.gemm(
                &mut a.qkv.slice_mut(..n * stride as usize),
                &a.x.slice(..n * c.hidden_size),
                &l.qkv,
                n,
                stride as usize,
                c.hidden_size,
            )?;
            let mut b = s.launch_builder(gpu.func("rope_qk"));
            let rope_dim = c.rope_dim as i32;
            b.arg(&mut a.qkv)
                .arg(&positions)
                .arg(&stride)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&rope_dim)
                .arg(&c.rope_theta);
            unsafe { b.launch(rows) }?;
            let at = i * kv.layer_len;
            let mut kl = kv.k.slice_mut(at..at + kv.layer_len);
            let mut vl = kv.v.slice_mut(at..at + kv.layer_len);
            let mut b = s.launch_builder(gpu.func("reshape_and_cache"));
            b.arg(&mut kl)
                .arg(&mut vl)
                .arg(&a.qkv)
                .arg(&slots)
                .arg(&stride)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd);
            unsafe { b.launch(rows) }?;
            drop((kl, vl));
            let kl = kv.k.slice(at..at + kv.layer_len);
            let vl = kv.v.slice(at..at + kv.layer_len);
            let mut b = s.launch_builder(gpu.func("paged_attention"));
            b.arg(&mut a.attn)
                .arg(&a.qkv)
                .arg(&kl)
                .arg(&vl)
                .arg(&tables)
                .arg(&qstart)
                .arg(&seq_lens);
            b.arg(&max_blocks)
                .arg(&stride)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&bs)
                .arg(&scale);
            unsafe { b.launch(attn_grid) }?;
            gpu.gemm(
                &mut a.o.slice_mut(..n * c.hidden_size),
                &a.attn.slice(..n * qd),
                &l.wo,
                n,
                c.hidden_size,
                qd,
            )?;
            norm(&mut a.x, &mut a.h, &a.o, &l.ffn_norm, 1)?;
            gpu.gemm(
                &mut a.gate_up.slice_mut(..n * 2 * inter),
                &a.x.slice(..n * c.hidden_size),
                &l.gate_up,
                n,
                2 * inter,
                c.hidden_size,
            )?;
            let mut b = s.launch_builder(gpu.func("silu_and_mul"));
            let (inter_i, n_i) = (inter as i32, n as i32);
            b.arg(&mut a.act).arg(&a.gate_up).arg(&inter_i).arg(&n_i);
            unsafe { b.launch(grid(((n * inter).div_ceil(256)).min(65_535) as u32, 256)) }?;
            gpu.gemm(
                &mut a.o.slice_mut(..n * c.hidden_size),
                &a.act.slice(..n * inter),
                &l.down,
                n,
                c.hidden_size,
                inter,
            )?;
        }
        norm(&mut a.x, &mut a.h, &a.o, &w.final_norm, 1)?;
        let ns = input.seqs.len();
        let mut b = s.launch_builder(gpu.func("gather_rows"));
        b.arg(&mut a.last).arg(&a.x).arg(&last_rows).arg(&hid);
        unsafe { b.launch(grid(ns as u32, 256)) }?;
        gpu.gemm(
            &mut a.logits.slice_mut(..ns * c.vocab_size),
            &a.last.slice(..ns * c.hidden_size),
            w.output(),
            ns,
            c.vocab_size,
            c.hidden_size,
        )?;
        Ok(&a.logits)
    }
}
