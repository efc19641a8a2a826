//! The llama forward pass on the device as one sequence of launches on the
//! runner's stream, reading a step only through device buffers: the packed
//! step metadata ([`StepLayout`]), the activations, the weights and the KV
//! cache. Nothing here allocates, frees or synchronises, so the same code
//! runs eagerly and inside a CUDA-graph capture.
//!
//! Per layer: fused add+RMSNorm → QKV GEMM → RoPE → K/V into the cache →
//! paged attention → O GEMM → fused add+RMSNorm → gate/up GEMM → SiLU·mul →
//! down GEMM. Activation buffers are allocated once for
//! `max_num_batched_tokens`, so the activation peak is known exactly.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::attention::{PagedAttention, StepShape};
use super::device::{grid, Gpu, GpuError};
use super::metadata::StepLayout;
use super::weights::DeviceWeights;
use crate::model::LlamaConfig;

/// Activation buffers for up to `tokens` tokens.
pub(crate) struct Activations {
    /// Rows every buffer holds (`max_num_batched_tokens`).
    pub tokens: usize,
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
    pub logits: CudaSlice<f32>,
}

impl Activations {
    /// Buffers for `tokens` tokens of model `c`.
    pub fn new(gpu: &Gpu, c: &LlamaConfig, tokens: usize) -> Result<Activations, GpuError> {
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

    /// Bytes of all the buffers.
    pub fn bytes(&self) -> u64 {
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
    pub(crate) k: CudaSlice<u16>,
    pub(crate) v: CudaSlice<u16>,
    /// Elements of one layer's K (or V).
    pub(crate) layer_len: usize,
}

/// What the forward pass computes with: the model, its activations and its
/// attention (the split-K workspace).
pub(crate) struct Model {
    pub config: LlamaConfig,
    pub weights: DeviceWeights,
    pub act: Activations,
    pub attn: PagedAttention,
}

impl Model {
    /// Launches one step's forward pass: token ids, positions and attention
    /// metadata from `step` (laid out as `layout`), K/V into `kv`, each
    /// sequence's last-token logits into rows `0..layout.seqs` of
    /// `act.logits`. Every launch's grid and arguments are functions of
    /// `layout` and `shape` only, which is what lets a graph replay it.
    pub fn run(
        &mut self,
        gpu: &Gpu,
        kv: &mut DeviceKvCache,
        step: &CudaSlice<i32>,
        layout: StepLayout,
        shape: &StepShape,
    ) -> Result<(), GpuError> {
        let Model {
            config: c,
            weights: w,
            act: a,
            attn,
        } = self;
        let s = &gpu.stream;
        let ids = step.slice(layout.token_ids());
        let positions = step.slice(layout.positions());
        let slots = step.slice(layout.slot_mapping());
        let qstart = step.slice(layout.query_start());
        let seq_lens = step.slice(layout.seq_lens());
        let last_rows = step.slice(layout.logits_rows());
        let tables = step.slice(layout.block_tables());
        let (n, ns) = (layout.tokens, layout.seqs);

        let hid = c.hidden_size as i32;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i32,
            c.num_key_value_heads as i32,
            c.head_dim as i32,
        );
        let qd = c.num_attention_heads * c.head_dim;
        let stride = (qd + 2 * c.num_key_value_heads * c.head_dim) as i32;
        let inter = c.intermediate_size;
        let eps = c.rms_norm_eps;
        let rows = grid(n as u32, 256);
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
            {
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
            }
            let kl = kv.k.slice(at..at + kv.layer_len);
            let vl = kv.v.slice(at..at + kv.layer_len);
            attn.launch(
                gpu,
                &mut a.attn,
                &a.qkv,
                &kl,
                &vl,
                &tables,
                &qstart,
                &seq_lens,
                shape,
            )?;
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
        Ok(())
    }
}
