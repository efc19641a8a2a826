//! Model weights and hyper-parameters: GGUF, Hugging Face safetensors, and
//! dummy weights generated from a config (vLLM's `load_format = "dummy"`).
//!
//! Every loader produces the same [`ModelWeights`], in GGUF conventions:
//! a matrix is `[rows = out_features, cols = in_features]`, row-major, and the
//! Q/K projections are laid out for *interleaved* RoPE (adjacent pairs), as
//! llama.cpp's converter permutes them. Loaders of other formats convert to
//! that convention so the model runner has one code path.

pub mod check;
pub mod dequant;
pub mod dummy;
pub mod gguf;
mod load;
pub mod quant;
pub mod safetensors;
pub mod shard;

use std::sync::Arc;

use memmap2::Mmap;

pub use load::{dummy_config, load, load_dummy, LoadFormat, ModelError, DEFAULT_DUMMY_DTYPE};

/// Hyper-parameters of a llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Number of tokens in the vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention when smaller).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Number of leading dimensions of a head that RoPE rotates.
    pub rope_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Epsilon of RMSNorm.
    pub rms_norm_eps: f32,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// The output projection is the token embedding (no separate `lm_head`).
    pub tie_word_embeddings: bool,
}

/// Element type of a tensor, with GGUF's block-quantized formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: one f16 scale and 32 int8 values (34 bytes).
    Q8_0,
    /// Blocks of 32: one f16 scale and 32 4-bit values offset by 8 (18 bytes).
    Q4_0,
    /// Blocks of 32: f16 scale and f16 minimum, 32 4-bit values (20 bytes).
    Q4_1,
}

impl DType {
    /// Elements per block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
        }
    }

    /// Bytes needed for `n` elements, or `None` when `n` is not a whole
    /// number of blocks (or overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
}

/// Where a tensor's bytes live: in a memory-mapped file or in memory.
#[derive(Clone, Debug)]
pub enum Storage {
    /// A slice `[offset, offset + len)` of a shared memory map.
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
    /// Bytes owned by the tensor (converted or generated weights).
    Owned(Arc<Vec<u8>>),
}

impl Storage {
    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Storage::Owned(v) => v,
        }
    }
}

/// One named tensor. `shape` is outermost-first: a matrix is `[rows, cols]`
/// (GGUF's `ne` reversed), a vector `[len]`.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// The name in the checkpoint (GGUF naming, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// The bytes, `dtype.bytes_for(numel)` long.
    pub storage: Storage,
}

impl Tensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows of a matrix (1 for a vector).
    pub fn rows(&self) -> usize {
        if self.shape.len() >= 2 {
            self.shape[..self.shape.len() - 1].iter().product()
        } else {
            1
        }
    }

    /// Columns of a matrix (the length of a vector).
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
}

/// The weights of one transformer block.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub attn_norm: Tensor,
    /// Query projection, `[heads * head_dim, hidden]`.
    pub wq: Tensor,
    /// Key projection, `[kv_heads * head_dim, hidden]`.
    pub wk: Tensor,
    /// Value projection, `[kv_heads * head_dim, hidden]`.
    pub wv: Tensor,
    /// Attention output projection, `[hidden, heads * head_dim]`.
    pub wo: Tensor,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub ffn_norm: Tensor,
    /// Gate projection, `[intermediate, hidden]`.
    pub w_gate: Tensor,
    /// Up projection, `[intermediate, hidden]`.
    pub w_up: Tensor,
    /// Down projection, `[hidden, intermediate]`.
    pub w_down: Tensor,
}

/// A whole llama-family model.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// Hyper-parameters.
    pub config: LlamaConfig,
    /// Token embedding, `[vocab, hidden]`.
    pub embed: Tensor,
    /// Transformer blocks, first to last.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub final_norm: Tensor,
    /// Output projection `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Tensor>,
}

impl ModelWeights {
    /// Every tensor: embedding, final norm, `lm_head` if any, then each
    /// layer's tensors in order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut all = vec![&self.embed, &self.final_norm];
        all.extend(&self.lm_head);
        for l in &self.layers {
            all.extend([
                &l.attn_norm,
                &l.wq,
                &l.wk,
                &l.wv,
                &l.wo,
                &l.ffn_norm,
                &l.w_gate,
                &l.w_up,
                &l.w_down,
            ]);
        }
        all
    }

    /// Lets the kernel drop this process's resident pages of every mapped
    /// checkpoint file. A runner that has prepared its own copy of the
    /// weights (repacked, or on a GPU) calls this, so the process does not
    /// hold the file twice; the pages come back from the page cache or the
    /// file whenever a tensor is read again (`update_weights`, a reload).
    /// Advisory: a failure only leaves the pages resident.
    pub fn release_mapped_pages(&self) {
        let mut maps: Vec<&Arc<Mmap>> = Vec::new();
        for t in self.tensors() {
            if let Storage::Mapped { map, .. } = &t.storage {
                if !maps.iter().any(|m| Arc::ptr_eq(m, map)) {
                    maps.push(map);
                }
            }
        }
        for map in maps {
            // SAFETY: `DontNeed` discards a private mapping's changes; this
            // map is read-only, so it has none, and a later read sees the
            // file's bytes again (the loaders assume it is not modified).
            if let Err(e) = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) } {
                tracing::debug!("madvise(DONTNEED) on the model file failed: {e}");
            }
        }
    }

    /// The output projection: `lm_head`, or the embedding when tied.
    pub fn output(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Hands the heap memory freed so far (by a load, a repack) back to the
/// system: glibc keeps freed heap pages mapped, and the process's resident
/// size counts them until they are reused. A no-op with other C libraries.
pub fn release_freed_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free pages of the allocator's own
    // arenas; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}
