//! What a worker is told before it starts ([`WorkerConfig`], resolved
//! from the engine's configuration by `proc::worker_config`), and how its
//! calls fail ([`WorkerError`]).

use std::path::PathBuf;

use thiserror::Error;

use super::input_batch::BatchError;
use crate::config::CacheDtype;
use crate::model::{LoadFormat, ModelError};
use crate::model_runner::RunnerError;

/// Which device a worker computes on (`worker.cls`, resolved).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevice {
    /// The CPU, with `num_threads` threads.
    Cpu,
    /// CUDA device 0 (`--features cuda`).
    Gpu,
}

/// Everything a worker needs to know before it starts.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    /// The model: a GGUF file, a safetensors directory, or a config for
    /// dummy weights.
    pub model: PathBuf,
    /// How to read it (`Auto` picks by path).
    pub load_format: LoadFormat,
    /// The device.
    pub device: WorkerDevice,
    /// Threads for the forward pass (the caller's thread included).
    pub num_threads: usize,
    /// Memory for the KV cache, in bytes (vLLM's `kv_cache_memory_bytes`);
    /// unset: the CPU default, or `gpu_memory_utilization` on a GPU.
    pub kv_cache_memory_bytes: Option<usize>,
    /// The fraction of the GPU the engine may use (GPU only).
    pub gpu_memory_utilization: f64,
    /// Token slots per KV-cache block.
    pub block_size: usize,
    /// The KV cache's element type.
    pub cache_dtype: CacheDtype,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step (the largest CUDA graph).
    pub max_num_seqs: usize,
    /// No CUDA graphs (GPU only).
    pub enforce_eager: bool,
    /// Longest context; `None` means the model's own.
    pub max_model_len: Option<usize>,
    /// The end-of-sequence token, masked while a request is below its
    /// `min_tokens` (from the tokenizer).
    pub eos_token_id: Option<u32>,
}

#[cfg(test)]
impl WorkerConfig {
    /// A small configuration whose model does not exist: enough for the
    /// unit tests of everything up to `load_model`.
    pub(crate) fn for_unit_tests() -> WorkerConfig {
        WorkerConfig {
            model: PathBuf::from("/nonexistent/model.gguf"),
            load_format: LoadFormat::Auto,
            device: WorkerDevice::Cpu,
            num_threads: 1,
            kv_cache_memory_bytes: Some(1 << 20),
            gpu_memory_utilization: 0.9,
            block_size: 16,
            cache_dtype: CacheDtype::Auto,
            max_num_batched_tokens: 64,
            max_num_seqs: 8,
            enforce_eager: false,
            max_model_len: None,
            eos_token_id: None,
        }
    }
}

/// Why a worker call failed.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// A method ran before the lifecycle step it depends on.
    #[error("worker: {called} needs {missing} to have run first")]
    OutOfOrder {
        /// The method called.
        called: &'static str,
        /// The step that has not run.
        missing: &'static str,
    },
    /// A configuration value is out of range.
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// The model cannot be loaded.
    #[error("cannot load model {}: {reason}", path.display())]
    Load {
        /// The model file.
        path: PathBuf,
        /// The loader's reason (boxed: `ModelError` is large, and every
        /// worker call returns this type). Not the error's `source`: the
        /// message already says it, and a chain printed whole (`{:#}`)
        /// would say it twice.
        reason: Box<ModelError>,
    },
    /// The model runner refused (bad input, unsupported model, allocation).
    #[error(transparent)]
    Runner(#[from] RunnerError),
    /// A scheduler output did not fit the persistent batch.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A logits-processor plugin could not be loaded, or failed under
    /// `plugins.on_error = "fail"`.
    #[error(transparent)]
    Plugin(#[from] crate::plugins::PluginError),
    /// `update_weights` was given an unknown name, a wrong size, or a value
    /// that is not finite; nothing changed.
    #[error("update_weights: {0}")]
    UpdateWeights(String),
    /// A call that needs the model awake ran while it sleeps.
    #[error(
        "worker: {called} cannot run while the worker sleeps ({what} asleep); call wake_up first"
    )]
    Asleep {
        /// The method called.
        called: &'static str,
        /// What sleeps: `weights`, `kv_cache` or both.
        what: String,
    },
}
