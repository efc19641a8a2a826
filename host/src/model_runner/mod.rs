//! The model runner: one forward pass of a llama-family model over a
//! flattened batch that mixes prefill chunks and decodes, reading and writing
//! a paged KV cache (vLLM's `GPUModelRunner`, on the CPU).
//!
//! - [`input`]: what a step runs ([`ModelInput`]) and its validation;
//! - [`kv_cache`]: the paged K/V storage ([`KvCache`]);
//! - [`attention`]: causal paged attention over the block tables;
//! - [`cpu`]: [`CpuModelRunner`], the forward pass itself;
//! - [`profile`]: [`StepProfile`], where a forward pass's time goes;
//! - [`device_runner`]: [`DeviceRunner`], what the worker drives, on the
//!   CPU or (`crate::cuda`) a GPU.

mod attention;
mod cpu;
mod device_runner;
mod input;
mod kv_cache;
mod layer;
mod profile;
mod scratch;

use thiserror::Error;

pub use cpu::{CpuModelRunner, RunnerConfig, LOGITS_CHUNK_ROWS};
pub use device_runner::{DeviceRunner, DeviceSampleRow, KvCacheBudget};
/// The limits a step is validated against (shared with the CUDA runner).
#[cfg(feature = "cuda")]
pub(crate) use input::Limits as InputLimits;
pub use input::{ModelInput, SeqInput};
pub use kv_cache::{KvCache, KvCacheShape, KvDtype};
pub use profile::{Op, StepProfile};

use crate::distributed::AllReduceError;
use crate::kernels::KernelError;

/// Logits of the last query token of each sequence of a step, row-major
/// `[num_seqs, vocab_size]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    /// Number of rows (sequences).
    pub num_seqs: usize,
    /// Row width (vocabulary size).
    pub vocab_size: usize,
    /// `num_seqs * vocab_size` values.
    pub data: Vec<f32>,
}

impl Logits {
    /// The logits of sequence `seq`.
    ///
    /// # Panics
    /// When `seq >= num_seqs` (a caller bug, like slice indexing).
    pub fn row(&self, seq: usize) -> &[f32] {
        &self.data[seq * self.vocab_size..(seq + 1) * self.vocab_size]
    }

    /// Iterates over the rows, first sequence first.
    pub fn rows(&self) -> impl Iterator<Item = &[f32]> {
        self.data.chunks_exact(self.vocab_size.max(1))
    }
}

/// Query tokens of one sequence of a step whose logits are wanted besides
/// the last one's (prompt logprobs): tokens `first..first + len` of
/// sequence `seq`'s query tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogitsSpan {
    /// The sequence's index in the step.
    pub seq: usize,
    /// Its first query token wanted (0 is the step's first of the sequence).
    pub first: usize,
    /// How many.
    pub len: usize,
}

/// Where a runner hands the rows of [`LogitsSpan`]s, one at a time:
/// `(span index, row within the span, logits row)`.
pub type LogitsSink<'a> = dyn FnMut(usize, usize, &[f32]) + 'a;

/// Why the runner cannot be built or cannot run a step. Input errors name
/// the sequence and the offending value so a caller can fix its batch.
#[derive(Debug, Error)]
pub enum RunnerError {
    /// A weight matrix cannot be prepared for the kernels.
    #[error("cannot prepare weight `{name}` for the CPU kernels: {source}")]
    Weight {
        /// The tensor name.
        name: String,
        /// The kernel's reason.
        source: KernelError,
    },
    /// The weights do not fit the configuration the runner supports.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A runner option is out of range.
    #[error("invalid runner configuration: {0}")]
    Config(String),
    /// `execute_model` ran before `initialize_kv_cache`.
    #[error("the KV cache is not allocated; call initialize_kv_cache(num_blocks) first")]
    NoKvCache,
    /// The KV cache cannot be allocated.
    #[error("cannot allocate a KV cache of {num_blocks} blocks ({bytes} bytes): {reason}")]
    KvAlloc {
        /// Blocks requested.
        num_blocks: usize,
        /// Bytes requested (saturated on overflow).
        bytes: usize,
        /// What failed.
        reason: String,
    },
    /// The batch is malformed (lengths, positions, ids, block tables).
    #[error("invalid model input: {0}")]
    Input(String),
    /// The tensor-parallel all-reduce failed (a peer rank died or stalled).
    #[error(transparent)]
    AllReduce(#[from] AllReduceError),
    /// The weights cannot be sharded into the tensor-parallel group.
    #[error(transparent)]
    Shard(#[from] crate::model::shard::ShardError),
    /// The GPU failed (a driver, cuBLAS or kernel error, or out of memory).
    #[error("{device}: {message}")]
    Device {
        /// Which device (`cuda:0`).
        device: String,
        /// The device's error.
        message: String,
    },
}
