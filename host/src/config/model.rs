//! `[model]`, `[scheduler]`, `[cache]` and `[worker]`: what runs, and the
//! resources it runs with.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::default_model_path;

/// Which loader to use (vLLM's `load_format`; `model.load_format` in the
/// config, written in lower case).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// A `.gguf` file is GGUF; a directory with `config.json` is safetensors.
    #[default]
    Auto,
    /// A GGUF file.
    Gguf,
    /// A Hugging Face directory: `config.json` and `.safetensors` shards.
    Safetensors,
    /// Random weights shaped by a config; see [`crate::model::dummy_config`] for where
    /// the config comes from.
    Dummy,
}

/// The element type of the KV cache (`cache.cache_dtype`, vLLM's
/// `--kv-cache-dtype`).
///
/// `auto` stores K and V as the runner computes them: f32 on the CPU,
/// bfloat16 on a GPU. The half-width types halve the cache's memory and
/// the bytes a long-context decode reads, at the cost of rounding each K
/// and V value to 11 (`float16`) or 8 (`bfloat16`) significant bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CacheDtype {
    /// The runner's compute type.
    #[default]
    Auto,
    /// IEEE single precision (the CPU's `auto`).
    Float32,
    /// IEEE half precision (llama.cpp's default).
    Float16,
    /// bfloat16 (the GPU's `auto`).
    Bfloat16,
}

impl CacheDtype {
    /// The canonical name (what the config and `/metrics` show).
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::Auto => "auto",
            CacheDtype::Float32 => "float32",
            CacheDtype::Float16 => "float16",
            CacheDtype::Bfloat16 => "bfloat16",
        }
    }
}

impl std::str::FromStr for CacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<CacheDtype, String> {
        Ok(match s {
            "auto" => CacheDtype::Auto,
            "float32" | "fp32" | "float" => CacheDtype::Float32,
            "float16" | "fp16" | "half" => CacheDtype::Float16,
            "bfloat16" | "bf16" => CacheDtype::Bfloat16,
            _ if s.starts_with("fp8") => {
                return Err(format!(
                    "{s:?}: 8-bit KV caches are not implemented; use auto, float32, float16 or bfloat16"
                ))
            }
            _ => {
                return Err(format!(
                    "{s:?} is not a KV-cache type; use auto, float32, float16 or bfloat16"
                ))
            }
        })
    }
}

impl TryFrom<String> for CacheDtype {
    type Error = String;

    fn try_from(s: String) -> Result<CacheDtype, String> {
        s.parse()
    }
}

impl From<CacheDtype> for String {
    fn from(d: CacheDtype) -> String {
        d.name().to_string()
    }
}

/// `[model]`: the checkpoint, its tokenizer and its limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A `.gguf` file or a Hugging Face directory (config.json + safetensors).
    /// Relative paths are resolved against the current directory.
    pub path: PathBuf,
    /// How to read `path`.
    pub load_format: LoadFormat,
    /// A `tokenizer.json` to use instead of the model's own tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// The chat template to use instead of the model's own (vLLM's
    /// `--chat-template`): a Jinja file's path, or the template itself.
    pub chat_template: Option<String>,
    /// The longest sequence (prompt + output) to serve; 0 takes the model's
    /// trained context length, lowered to what the KV cache holds. A value
    /// the KV cache cannot hold is refused at start-up.
    pub max_model_len: usize,
    /// Seed of the dummy weights (`load_format = "dummy"`).
    pub seed: u64,
    /// Run every step eagerly: no CUDA graphs on a GPU worker (vLLM's
    /// `enforce_eager`); the CPU worker always runs eagerly.
    pub enforce_eager: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            path: default_model_path(Path::new(".")),
            load_format: LoadFormat::Auto,
            tokenizer: None,
            chat_template: None,
            max_model_len: 0,
            seed: 0,
            enforce_eager: false,
        }
    }
}

/// `[scheduler]`: vLLM V1's scheduler knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most requests in one step.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps.
    pub enable_chunked_prefill: bool,
    /// A prefill longer than this is chunked to it; 0 disables the cap.
    pub long_prefill_token_threshold: usize,
    /// The scheduling policy by qualified name; `auto` takes the one
    /// scheduling-policy plugin given by `--plugin` / `plugins.paths`, else
    /// `builtin:fcfs`.
    pub policy: String,
    /// Schedule step N+1 while step N runs (vLLM's async scheduling): the
    /// engine's own work per step overlaps the forward pass. The outputs
    /// are the same either way. Off while speculative decoding is on (a
    /// step's drafts come from the step before).
    pub async_scheduling: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            policy: "auto".into(),
            async_scheduling: true,
        }
    }
}

/// `[cache]`: the paged KV cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory given to the KV cache, in bytes (vLLM's
    /// `kv_cache_memory_bytes`). Unset: on a CPU worker, what
    /// `scheduler.max_num_seqs` sequences of `model.max_model_len` tokens
    /// fill, at most [`DEFAULT_CPU_KV_CACHE_BYTES`]; on a GPU worker, what
    /// `gpu_memory_utilization` leaves.
    pub kv_cache_memory_bytes: Option<u64>,
    /// The fraction of the GPU's memory the engine may use (weights,
    /// activations and KV cache together) when `kv_cache_memory_bytes` is
    /// unset; ignored by the CPU worker.
    pub gpu_memory_utilization: f64,
    /// Reuse the KV blocks of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// The KV cache's element type (vLLM's `cache_dtype`).
    pub cache_dtype: CacheDtype,
}

/// The most a CPU worker's KV cache takes when `cache.kv_cache_memory_bytes`
/// is unset.
pub const DEFAULT_CPU_KV_CACHE_BYTES: u64 = 256 << 20;

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 16,
            kv_cache_memory_bytes: None,
            gpu_memory_utilization: 0.9,
            enable_prefix_caching: true,
            cache_dtype: CacheDtype::Auto,
        }
    }
}

/// `[worker]`: the worker and its model runner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Which worker: `auto` picks the GPU worker when this host was built
    /// with `--features cuda` and a CUDA GPU is visible, the CPU worker
    /// otherwise; `cpu` and `gpu` ask for one (`gpu` without a GPU is an
    /// error at start-up).
    pub cls: String,
    /// Compute threads per worker; 0 uses every core.
    pub num_threads: usize,
    /// Worker-extension plugins (vLLM's `worker_extension_cls`) by
    /// qualified name, one or a list: their methods are reachable as
    /// `collective_rpc("<name>.<method>")` on every worker.
    #[serde(deserialize_with = "one_or_many")]
    pub extension: Vec<String>,
}

/// A string or a list of strings, as a list.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    match OneOrMany::deserialize(d).map_err(|_| {
        serde::de::Error::custom(
            "expected a qualified name or a list of them, e.g. \"engine:weight-tools\"",
        )
    })? {
        OneOrMany::One(name) => Ok(vec![name]),
        OneOrMany::Many(names) => Ok(names),
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            cls: "auto".into(),
            num_threads: 0,
            extension: Vec::new(),
        }
    }
}
