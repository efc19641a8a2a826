//! Consistency checks every loader runs before handing weights to the model
//! runner: the config must describe a runnable llama, and every tensor must
//! have the shape, block layout and byte length that config implies.

use thiserror::Error;

use super::{LlamaConfig, ModelWeights, Tensor};

/// A config or tensor that does not fit a llama model.
#[derive(Debug, Error, PartialEq)]
pub enum ShapeError {
    /// The hyper-parameters contradict each other.
    #[error("invalid config: {0}")]
    Config(String),
    /// A tensor's shape differs from what the config implies.
    #[error(
        "tensor `{tensor}` has shape {found:?} but the config implies {expected:?}; \
         the weights and the config belong to different models"
    )]
    Mismatch {
        /// Tensor name (GGUF naming).
        tensor: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// Shape the config implies.
        expected: Vec<usize>,
    },
    /// A quantized tensor's rows are not whole blocks, or its bytes do not
    /// match its shape.
    #[error("tensor `{tensor}`: {reason}")]
    Layout {
        /// Tensor name (GGUF naming).
        tensor: String,
        /// What is inconsistent.
        reason: String,
    },
}

/// Checks that `c` describes a model the runner can execute.
pub fn validate_config(c: &LlamaConfig) -> Result<(), ShapeError> {
    let err = |m: String| Err(ShapeError::Config(m));
    let sizes = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
        ("rope_dim", c.rope_dim),
        ("max_position_embeddings", c.max_position_embeddings),
    ];
    if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
        return err(format!("{name} is 0; it must be positive"));
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return err(format!(
            "num_key_value_heads ({}) must divide num_attention_heads ({})",
            c.num_key_value_heads, c.num_attention_heads
        ));
    }
    if !c.rope_dim.is_multiple_of(2) || c.rope_dim > c.head_dim {
        return err(format!(
            "rope_dim ({}) must be even and at most head_dim ({})",
            c.rope_dim, c.head_dim
        ));
    }
    let elements = |a: usize, b: usize| a.checked_mul(b).and_then(|n| n.checked_mul(c.hidden_size));
    if elements(c.num_attention_heads, c.head_dim).is_none()
        || elements(c.vocab_size, 1).is_none()
        || elements(c.intermediate_size, 1).is_none()
    {
        return err("the sizes are too large: a weight matrix would overflow memory".into());
    }
    if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
        return err(format!(
            "rope_theta ({}) must be a positive number",
            c.rope_theta
        ));
    }
    if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0) {
        return err(format!(
            "rms_norm_eps ({}) must be a positive number",
            c.rms_norm_eps
        ));
    }
    Ok(())
}

/// Checks one tensor's shape against `expected`, its rows against its
/// block size and its byte length against its shape.
pub fn check_tensor(t: &Tensor, expected: &[usize]) -> Result<(), ShapeError> {
    if t.shape != expected {
        return Err(ShapeError::Mismatch {
            tensor: t.name.clone(),
            found: t.shape.clone(),
            expected: expected.to_vec(),
        });
    }
    let layout = |reason: String| {
        Err(ShapeError::Layout {
            tensor: t.name.clone(),
            reason,
        })
    };
    let block = t.dtype.block_len();
    if !t.cols().is_multiple_of(block) {
        return layout(format!(
            "rows of {} elements are not a whole number of {:?} blocks of {block}; \
             quantize this tensor to F32, F16 or BF16 instead",
            t.cols(),
            t.dtype
        ));
    }
    match t.dtype.bytes_for(t.numel()) {
        Some(n) if n == t.storage.bytes().len() => Ok(()),
        n => layout(format!(
            "holds {} bytes but {:?} {:?} needs {n:?}",
            t.storage.bytes().len(),
            t.dtype,
            t.shape
        )),
    }
}

/// Checks the config and every tensor of `w` against it.
pub fn check_weights(w: &ModelWeights) -> Result<(), ShapeError> {
    let c = &w.config;
    validate_config(c)?;
    if w.layers.len() != c.num_hidden_layers {
        return Err(ShapeError::Config(format!(
            "num_hidden_layers is {} but the checkpoint has {} layers",
            c.num_hidden_layers,
            w.layers.len()
        )));
    }
    if c.tie_word_embeddings != w.lm_head.is_none() {
        return Err(ShapeError::Config(format!(
            "tie_word_embeddings is {} but the checkpoint {} an output projection",
            c.tie_word_embeddings,
            if w.lm_head.is_some() { "has" } else { "lacks" }
        )));
    }
    let (h, q, kv, ff) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    check_tensor(&w.embed, &[c.vocab_size, h])?;
    check_tensor(&w.final_norm, &[h])?;
    if let Some(head) = &w.lm_head {
        check_tensor(head, &[c.vocab_size, h])?;
    }
    for l in &w.layers {
        check_tensor(&l.attn_norm, &[h])?;
        check_tensor(&l.wq, &[q, h])?;
        check_tensor(&l.wk, &[kv, h])?;
        check_tensor(&l.wv, &[kv, h])?;
        check_tensor(&l.wo, &[h, q])?;
        check_tensor(&l.ffn_norm, &[h])?;
        check_tensor(&l.w_gate, &[ff, h])?;
        check_tensor(&l.w_up, &[ff, h])?;
        check_tensor(&l.w_down, &[h, ff])?;
    }
    Ok(())
}
