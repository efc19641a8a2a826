//! Activation buffers, allocated once for the largest step
//! (`max_num_batched_tokens` tokens) so the forward pass never allocates
//! per layer.

use super::attention::{SeqSpan, WorkItem};
use super::RunnerError;
use crate::model::LlamaConfig;

/// Every intermediate of a forward pass, row-major `[tokens, width]`.
pub(crate) struct Scratch {
    /// The residual stream, `[T, hidden]`.
    pub h: Vec<f32>,
    /// Normalised input of a sub-block, `[T, hidden]`.
    pub x: Vec<f32>,
    /// Fused Q, K, V projections, `[T, (heads + 2 kv_heads) * head_dim]`.
    pub qkv: Vec<f32>,
    /// Attention output, `[T, heads * head_dim]`.
    pub attn: Vec<f32>,
    /// Output of `wo` or of `w_down`, `[T, hidden]`.
    pub proj: Vec<f32>,
    /// Fused gate and up projections, `[T, 2 * intermediate]`; after SwiGLU
    /// the first `T * intermediate` floats hold the activations.
    pub gate_up: Vec<f32>,
    /// Attention scores, one `max_model_len` row per thread.
    pub scores: Vec<f32>,
    /// The step's sequences.
    pub spans: Vec<SeqSpan>,
    /// The step's attention plan.
    pub items: Vec<WorkItem>,
}

impl Scratch {
    /// Buffers for steps of up to `max_tokens` tokens and contexts of up to
    /// `max_model_len` tokens on `n_threads` threads.
    pub fn new(
        c: &LlamaConfig,
        max_tokens: usize,
        max_model_len: usize,
        n_threads: usize,
    ) -> Result<Scratch, RunnerError> {
        let qkv_width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
        let buf = |width: usize| -> Result<Vec<f32>, RunnerError> {
            let n = max_tokens.checked_mul(width).ok_or_else(|| {
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
        Ok(Scratch {
            h: buf(c.hidden_size)?,
            x: buf(c.hidden_size)?,
            qkv: buf(qkv_width)?,
            attn: buf(c.num_attention_heads * c.head_dim)?,
            proj: buf(c.hidden_size)?,
            gate_up: buf(2 * c.intermediate_size)?,
            scores: vec![0.0; n_threads * max_model_len],
            spans: Vec::new(),
            items: Vec::new(),
        })
    }
}
