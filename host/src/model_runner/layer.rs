//! One transformer block: its weights in kernel layout and its forward pass
//! over all tokens of a step.

use std::sync::Arc;

use super::attention::{paged_attention, AttnArgs, AttnDims};
use super::kv_cache::KvCache;
use super::profile::{Laps, Op, StepProfile};
use super::scratch::{Scratch, MLP_CHUNK_TOKENS};
use super::RunnerError;
use crate::distributed::TpGroup;
use crate::kernels::{
    matmul_with, rms_norm, swiglu, MatmulPath, RopeTable, ThreadPool, WeightMatrix,
};
use crate::model::{dequant, DType, LayerWeights, Storage, Tensor};

/// A block's weights: Q/K/V fused into one matrix and gate/up into another,
/// so a step runs four matmuls per layer instead of seven (each matmul is a
/// parallel section; fewer sections means less fork-join overhead per
/// decoded token).
pub(crate) struct Layer {
    /// RMSNorm weight before attention.
    attn_norm: Vec<f32>,
    /// `[wq; wk; wv]`, `[(heads + 2 kv_heads) * head_dim, hidden]`.
    wqkv: WeightMatrix,
    /// Attention output projection.
    wo: WeightMatrix,
    /// RMSNorm weight before the MLP.
    ffn_norm: Vec<f32>,
    /// `[w_gate; w_up]`, `[2 * intermediate, hidden]`.
    w_gate_up: WeightMatrix,
    /// Down projection.
    w_down: WeightMatrix,
}

/// A norm weight as f32.
pub(crate) fn norm_weight(t: &Tensor) -> Vec<f32> {
    dequant::dequantize(t)
}

/// A weight matrix in kernel layout, with the tensor named on failure.
pub(crate) fn weight_matrix(t: &Tensor) -> Result<WeightMatrix, RunnerError> {
    WeightMatrix::from_tensor(t).map_err(|source| RunnerError::Weight {
        name: t.name.clone(),
        source,
    })
}

/// Stacks matrices with the same columns row-wise. GGUF rows are whole
/// blocks, so stacking is byte concatenation when the types agree; mixed
/// types are widened to f32 first (correct, only slower).
fn stack_rows(name: &str, parts: &[&Tensor]) -> Result<WeightMatrix, RunnerError> {
    let cols = parts[0].cols();
    if let Some(p) = parts
        .iter()
        .find(|p| p.shape.len() != 2 || p.cols() != cols)
    {
        return Err(RunnerError::Unsupported(format!(
            "`{}` has shape {:?}, but it is stacked with matrices of {cols} columns",
            p.name, p.shape
        )));
    }
    let same_type = parts.iter().all(|p| p.dtype == parts[0].dtype);
    let widened: Vec<Tensor>;
    let parts: Vec<&Tensor> = if same_type {
        parts.to_vec()
    } else {
        widened = parts.iter().map(|p| dequant::to_f32(p)).collect();
        widened.iter().collect()
    };
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.storage.bytes().len()).sum());
    for p in &parts {
        bytes.extend_from_slice(p.storage.bytes());
    }
    let dtype: DType = parts[0].dtype;
    weight_matrix(&Tensor {
        name: name.to_string(),
        dtype,
        shape: vec![parts.iter().map(|p| p.rows()).sum(), cols],
        storage: Storage::Owned(Arc::new(bytes)),
    })
}

impl Layer {
    /// Repacks one block's weights for the kernels.
    pub fn new(w: &LayerWeights) -> Result<Layer, RunnerError> {
        let base = w.wq.name.trim_end_matches("attn_q.weight");
        Ok(Layer {
            attn_norm: norm_weight(&w.attn_norm),
            wqkv: stack_rows(&format!("{base}attn_qkv (fused)"), &[&w.wq, &w.wk, &w.wv])?,
            wo: weight_matrix(&w.wo)?,
            ffn_norm: norm_weight(&w.ffn_norm),
            w_gate_up: stack_rows(&format!("{base}ffn_gate_up (fused)"), &[&w.w_gate, &w.w_up])?,
            w_down: weight_matrix(&w.w_down)?,
        })
    }

    /// Its weight matrices.
    pub fn matrices_mut(&mut self) -> [&mut WeightMatrix; 4] {
        [
            &mut self.wqkv,
            &mut self.wo,
            &mut self.w_gate_up,
            &mut self.w_down,
        ]
    }
}

/// What a block's forward pass needs besides its weights and buffers.
pub(crate) struct StepCtx<'a> {
    /// The thread pool.
    pub pool: &'a ThreadPool,
    /// The matmul kernel family.
    pub path: MatmulPath,
    /// Attention shapes.
    pub dims: AttnDims,
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE angles.
    pub rope: &'a RopeTable,
    /// Each sequence's block table.
    pub block_tables: &'a [&'a [u32]],
    /// The position of each token.
    pub positions: &'a [u32],
    /// The tensor-parallel group that completes the row-parallel
    /// projections' partial sums; `None` on a single rank.
    pub all_reduce: Option<&'a TpGroup>,
    /// Where each operation's time goes, when profiling.
    pub profile: Option<&'a StepProfile>,
}

impl Layer {
    /// Runs the block over the step's `n` tokens: reads and updates the
    /// residual stream `s.h`, writes this layer's K/V into `cache`. Fails
    /// only when the tensor-parallel all-reduce does.
    pub fn forward(
        &self,
        layer: usize,
        ctx: &StepCtx<'_>,
        s: &mut Scratch,
        cache: &mut KvCache,
    ) -> Result<(), RunnerError> {
        let n = ctx.positions.len();
        let (hid, d) = (ctx.hidden, ctx.dims);
        let (qw, kvw) = (d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim);
        let qkv_w = qw + 2 * kvw;
        let mut laps = Laps::start(ctx.profile);
        let x = &mut s.x[..n * hid];
        norm_rows(ctx, &self.attn_norm, &s.h[..n * hid], x);
        laps.lap(Op::AttnNorm);
        let qkv = &mut s.qkv[..n * qkv_w];
        matmul_with(ctx.pool, &self.wqkv, x, n, qkv, ctx.path);
        laps.lap(Op::QkvProj);
        let (positions, rope) = (ctx.positions, ctx.rope);
        ctx.pool.for_each_row(qkv, qkv_w, |t, row| {
            for head in row[..qw + kvw].chunks_exact_mut(d.head_dim) {
                rope.apply(head, positions[t] as usize);
            }
        });
        laps.lap(Op::Rope);
        self.store_kv(layer, ctx, s, cache, n);
        laps.lap(Op::StoreKv);
        // The normalised input is dead: the attention output takes its place.
        let attn = &mut s.x[..n * qw];
        let args = AttnArgs {
            cache,
            layer,
            seqs: &s.spans,
            block_tables: ctx.block_tables,
            plan: &s.plan,
            q: &s.qkv[..n * qkv_w],
            q_stride: qkv_w,
        };
        paged_attention(ctx.pool, d, &args, attn, &mut s.attn);
        laps.lap(Op::Attention);
        // Q, K and V are dead: the projections back to `hidden` take their
        // place.
        let proj = &mut s.qkv[..n * hid];
        matmul_with(ctx.pool, &self.wo, attn, n, proj, ctx.path);
        laps.lap(Op::OutProj);
        reduce(ctx, proj)?;
        laps.lap(Op::AllReduce);
        let h = &mut s.h[..n * hid];
        add_rows(ctx, h, proj);
        laps.lap(Op::Residual);

        let x = &mut s.x[..n * hid];
        norm_rows(ctx, &self.ffn_norm, h, x);
        laps.lap(Op::FfnNorm);
        // The MLP in chunks of rows: its [T, 2·intermediate] activations are
        // the step's widest, and every row is independent (the kernels give
        // a row the same bits whatever its batch), so the buffer holds one
        // chunk instead of a whole long prefill.
        let ff = ctx.intermediate;
        for first in (0..n).step_by(MLP_CHUNK_TOKENS) {
            let rows = first..n.min(first + MLP_CHUNK_TOKENS);
            let m = rows.len();
            let gu = &mut s.gate_up[..m * 2 * ff];
            let xs = &x[rows.start * hid..rows.end * hid];
            matmul_with(ctx.pool, &self.w_gate_up, xs, m, gu, ctx.path);
            laps.lap(Op::GateUpProj);
            let act = &mut s.act[..m * ff];
            swiglu(ctx.pool, gu, ff, act);
            laps.lap(Op::SiluMul);
            let out = &mut proj[rows.start * hid..rows.end * hid];
            matmul_with(ctx.pool, &self.w_down, act, m, out, ctx.path);
            laps.lap(Op::DownProj);
        }
        reduce(ctx, proj)?;
        laps.lap(Op::AllReduce);
        add_rows(ctx, h, proj);
        laps.lap(Op::Residual);
        Ok(())
    }

    /// Writes every token's K and V to its slot (positions were validated
    /// against the block tables before the step).
    fn store_kv(
        &self,
        layer: usize,
        ctx: &StepCtx<'_>,
        s: &Scratch,
        cache: &mut KvCache,
        n: usize,
    ) {
        let d = ctx.dims;
        let (qw, kvw) = (d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim);
        let qkv_w = qw + 2 * kvw;
        for (span, table) in s.spans.iter().zip(ctx.block_tables) {
            for t in span.token_start..span.token_start + span.query_len {
                let pos = ctx.positions[t] as usize;
                let row = &s.qkv[t * qkv_w..(t + 1) * qkv_w];
                let block = table[pos / d.block_size] as usize;
                cache.write(
                    layer,
                    block,
                    pos % d.block_size,
                    &row[qw..qw + kvw],
                    &row[qw + kvw..],
                );
            }
        }
        debug_assert_eq!(s.spans.iter().map(|sp| sp.query_len).sum::<usize>(), n);
    }
}

/// Sums a row-parallel projection's partial results over the ranks (a
/// no-op on a single rank).
fn reduce(ctx: &StepCtx<'_>, partial: &mut [f32]) -> Result<(), RunnerError> {
    match ctx.all_reduce {
        Some(group) => Ok(group.all_reduce_sum(partial)?),
        None => Ok(()),
    }
}

/// `h += x`, elementwise, row by row on the pool.
fn add_rows(ctx: &StepCtx<'_>, h: &mut [f32], x: &[f32]) {
    let hid = ctx.hidden;
    ctx.pool.for_each_row(h, hid, |t, h| {
        for (a, b) in h.iter_mut().zip(&x[t * hid..(t + 1) * hid]) {
            *a += b;
        }
    });
}

/// `x = rms_norm(h) * weight`, row by row on the pool.
fn norm_rows(ctx: &StepCtx<'_>, weight: &[f32], h: &[f32], x: &mut [f32]) {
    let (hid, eps) = (ctx.hidden, ctx.eps);
    ctx.pool.for_each_row(x, hid, |t, x| {
        rms_norm(&h[t * hid..(t + 1) * hid], weight, eps, x)
    });
}
