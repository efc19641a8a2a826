//! Activation buffers, allocated once for the largest step
//! (`max_num_batched_tokens` tokens) so the forward pass never allocates
//! per layer.

use super::attention::{AttnDims, AttnPlan, AttnScratch, SeqSpan};
use super::RunnerError;
use crate::model::LlamaConfig;

/// Every intermediate of a forward pass, row-major `[tokens, width]`.
/// Rows the MLP runs at once: its gate/up activations, the widest of a
/// step, are held for this many tokens, not the whole step. 256 rows keep
/// the matmuls' per-call cost (a fork-join, one pass over the weights, which
/// stay in cache) small against their work.
pub(crate) const MLP_CHUNK_TOKENS: usize = 256;

pub(crate) struct Scratch {
    /// The residual stream, `[T, hidden]`.
    pub h: Vec<f32>,
    /// Normalised input of a sub-block, `[T, hidden]`; between the QKV
    /// projection (its last reader) and the next norm, the attention
    /// output, `[T, heads * head_dim]`. Rows are `max(hidden, heads *
    /// head_dim)` wide.
    pub x: Vec<f32>,
    /// Fused Q, K, V projections, `[T, (heads + 2 kv_heads) * head_dim]`;
    /// once attention has read them, the output of `wo` or of `w_down`,
    /// `[T, hidden]`. Rows are wide enough for either.
    pub qkv: Vec<f32>,
    /// Fused gate and up projections of one MLP chunk,
    /// `[MLP_CHUNK_TOKENS, 2 * intermediate]`.
    pub gate_up: Vec<f32>,
    /// SwiGLU of one MLP chunk, `[MLP_CHUNK_TOKENS, intermediate]`: its own
    /// buffer, not `gate_up` compacted in place, so that threads can share
    /// the rows and no copy follows.
    pub act: Vec<f32>,
    /// Attention's scores and partial results.
    pub attn: AttnScratch,
    /// The step's sequences.
    pub spans: Vec<SeqSpan>,
    /// The step's attention plan.
    pub plan: AttnPlan,
}

impl Scratch {
    /// Buffers for steps of up to `max_tokens` tokens and contexts of up to
    /// `max_model_len` tokens on `n_threads` threads.
    pub fn new(
        c: &LlamaConfig,
        dims: AttnDims,
        max_tokens: usize,
        max_model_len: usize,
        n_threads: usize,
    ) -> Result<Scratch, RunnerError> {
        let qkv_width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
        let buf_rows = |rows: usize, width: usize| -> Result<Vec<f32>, RunnerError> {
            let n = rows.checked_mul(width).ok_or_else(|| {
                RunnerError::Config(format!(
                    "max_num_batched_tokens = {max_tokens} makes a buffer overflow usize"
                ))
            })?;
            let mut v = Vec::new();
            v.try_reserve_exact(n).map_err(|e| {
                RunnerError::Config(format!(
                    "cannot allocate activation buffers for max_num_batched_tokens = {max_tokens}: {e}; lower it"
                ))
            })?;
            v.resize(n, 0.0);
            Ok(v)
        };
        let buf = |width: usize| buf_rows(max_tokens, width);
        // Two buffers each serve two values whose lives do not overlap (see
        // the fields): a step holds three `[T, ~hidden]` buffers, not five.
        let q_width = c.num_attention_heads * c.head_dim;
        Ok(Scratch {
            h: buf(c.hidden_size)?,
            x: buf(c.hidden_size.max(q_width))?,
            qkv: buf(qkv_width.max(c.hidden_size))?,
            gate_up: buf_rows(max_tokens.min(MLP_CHUNK_TOKENS), 2 * c.intermediate_size)?,
            act: buf_rows(max_tokens.min(MLP_CHUNK_TOKENS), c.intermediate_size)?,
            attn: AttnScratch::new(dims, n_threads, max_model_len),
            spans: Vec::new(),
            plan: AttnPlan::default(),
        })
    }
}
