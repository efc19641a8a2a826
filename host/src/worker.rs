//! The worker: the object an executor drives, step by step, on one device,
//! shaped after vLLM V1's `GPUWorker` so the executor and the scheduler can
//! call it the same way (here on the CPU).
//!
//! Lifecycle, in order: [`Worker::new`] → [`Worker::init_device`] (thread
//! pool) → [`Worker::load_model`] → [`Worker::determine_available_memory`]
//! and [`Worker::bytes_per_block`] (the engine divides one by the other) →
//! [`Worker::initialize_from_config`] (allocate the KV cache) →
//! [`Worker::compile_or_warm_up_model`] → [`Worker::execute_model`] per step.
//! Calling a method before its prerequisites is an error that names the
//! missing step. Sampling is not here: it runs on the logits this returns.

use std::path::PathBuf;
use std::sync::Arc;

use thiserror::Error;

mod host_api;
mod input_batch;
mod output;
pub mod proc;
mod registry;
mod rpc;

pub use host_api::LentModel;
pub use output::{Logprobs, ModelRunnerOutput};
pub use registry::{DuplicateMethod, Handler, WorkerMethods};
pub use rpc::{RpcReply, RpcRequest, RpcValue};

use crate::distributed::AllReduceGroup;
use crate::kernels::{MatmulPath, ThreadPool};
use crate::scheduler::SchedulerOutput;
use input_batch::{BatchError, InputBatch, StepPlan};
use crate::model::{self, LlamaConfig, LoadFormat, ModelError};
use crate::model_runner::{
    CpuModelRunner, Logits, ModelInput, RunnerConfig, RunnerError,
};

/// Everything a worker needs to know before it starts.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    /// The model: a GGUF file, a safetensors directory, or a config for
    /// dummy weights.
    pub model: PathBuf,
    /// How to read it (`Auto` picks by path).
    pub load_format: LoadFormat,
    /// Threads for the forward pass (the caller's thread included).
    pub num_threads: usize,
    /// Memory for the KV cache, in bytes (vLLM's `kv_cache_memory_bytes`).
    pub kv_cache_memory_bytes: usize,
    /// Token slots per KV-cache block.
    pub block_size: usize,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
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
            num_threads: 1,
            kv_cache_memory_bytes: 1 << 20,
            block_size: 16,
            max_num_batched_tokens: 64,
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
    #[error("cannot load model {}: {source}", path.display())]
    Load {
        /// The model file.
        path: PathBuf,
        /// The loader's reason.
        source: ModelError,
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
}

/// A CPU worker.
pub struct Worker {
    /// Its configuration.
    config: WorkerConfig,
    /// The thread pool, after `init_device`.
    pool: Option<Arc<ThreadPool>>,
    /// The model runner, after `load_model`.
    runner: Option<CpuModelRunner>,
    /// The tensor-parallel group this worker is a rank of, if any.
    all_reduce: Option<Arc<AllReduceGroup>>,
    /// The weights the runner was prepared from (memory-mapped), kept for
    /// worker extensions to read and update (`host_api.rs`).
    weights: Option<crate::model::ModelWeights>,
    /// Whether the KV cache is allocated.
    kv_ready: bool,
    /// The requests the scheduler is running, kept across steps.
    input_batch: InputBatch,
    /// The step being built (reused to avoid allocating).
    step_input: ModelInput,
    /// Logits of the step run by `execute_model`, until `sample_tokens`.
    pending: Option<(StepPlan, Logits)>,
}

impl Worker {
    /// Checks the configuration; starts nothing.
    pub fn new(config: WorkerConfig) -> Result<Worker, WorkerError> {
        let positive = [
            ("num_threads", config.num_threads),
            ("block_size", config.block_size),
            ("max_num_batched_tokens", config.max_num_batched_tokens),
            ("max_model_len", config.max_model_len.unwrap_or(1)),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(WorkerError::Config(format!(
                "{name} is 0; it must be at least 1"
            )));
        }
        let input_batch = InputBatch::new(config.eos_token_id);
        Ok(Worker {
            config,
            pool: None,
            runner: None,
            all_reduce: None,
            weights: None,
            kv_ready: false,
            input_batch,
            step_input: ModelInput::default(),
            pending: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Starts the thread pool and logs the CPU features the kernels can use
    /// (the CPU counterpart of selecting and initialising a GPU).
    pub fn init_device(&mut self) -> Result<(), WorkerError> {
        tracing::info!(threads = self.config.num_threads, features = %cpu_features(), "worker: CPU device");
        self.pool = Some(Arc::new(ThreadPool::new(self.config.num_threads)));
        Ok(())
    }

    /// Makes this worker one rank of a tensor-parallel group (before
    /// `load_model`, which then loads only the rank's shard).
    pub fn set_tensor_parallel(&mut self, group: Arc<AllReduceGroup>) {
        self.all_reduce = Some(group);
    }

    /// Loads the weights and prepares them for the kernels.
    pub fn load_model(&mut self) -> Result<(), WorkerError> {
        let pool = self.pool.clone().ok_or(WorkerError::OutOfOrder {
            called: "load_model",
            missing: "init_device",
        })?;
        let path = &self.config.model;
        let weights =
            model::load(path, self.config.load_format).map_err(|source| WorkerError::Load {
                path: path.clone(),
                source,
            })?;
        let max_model_len = self
            .config
            .max_model_len
            .unwrap_or(weights.config.max_position_embeddings);
        let limits = RunnerConfig {
            max_num_batched_tokens: self.config.max_num_batched_tokens,
            max_model_len,
            block_size: self.config.block_size,
            matmul_path: MatmulPath::Auto,
        };
        self.runner = Some(CpuModelRunner::new_rank(&weights, pool, limits, self.all_reduce.clone())?);
        self.weights = Some(weights);
        self.kv_ready = false;
        Ok(())
    }

    /// The loaded runner, or the error naming the missing step.
    fn runner(&self, called: &'static str) -> Result<&CpuModelRunner, WorkerError> {
        self.runner.as_ref().ok_or(WorkerError::OutOfOrder {
            called,
            missing: "load_model",
        })
    }

    /// The loaded model's hyper-parameters.
    pub fn model_config(&self) -> Result<&LlamaConfig, WorkerError> {
        Ok(self.runner("model_config")?.model_config())
    }

    /// The longest context this worker runs (the configured one, or the
    /// model's).
    pub fn max_model_len(&self) -> Result<usize, WorkerError> {
        Ok(self.runner("max_model_len")?.runner_config().max_model_len)
    }

    /// Bytes one KV-cache block takes across all layers (K and V).
    pub fn bytes_per_block(&self) -> Result<usize, WorkerError> {
        Ok(self
            .runner("bytes_per_block")?
            .kv_cache_shape()
            .bytes_per_block())
    }

    /// Memory available for the KV cache: on the CPU, the configured budget
    /// (vLLM also returns `kv_cache_memory_bytes` as is when it is set).
    pub fn determine_available_memory(&self) -> Result<usize, WorkerError> {
        self.runner("determine_available_memory")?;
        Ok(self.config.kv_cache_memory_bytes)
    }

    /// Allocates the KV cache with `num_blocks` blocks.
    pub fn initialize_from_config(&mut self, num_blocks: usize) -> Result<(), WorkerError> {
        let runner = self.runner.as_mut().ok_or(WorkerError::OutOfOrder {
            called: "initialize_from_config",
            missing: "load_model",
        })?;
        runner.initialize_kv_cache(num_blocks)?;
        self.kv_ready = true;
        tracing::info!(
            num_blocks,
            bytes = num_blocks * runner.kv_cache_shape().bytes_per_block(),
            "worker: KV cache"
        );
        Ok(())
    }

    /// Runs one small dummy forward pass so page faults, thread start-up
    /// and first-touch costs are paid before the first request.
    ///
    /// The dummy writes K/V into the first blocks; that is harmless because
    /// every sequence writes a slot before any step reads it.
    pub fn compile_or_warm_up_model(&mut self) -> Result<(), WorkerError> {
        if !self.kv_ready {
            return Err(WorkerError::OutOfOrder {
                called: "compile_or_warm_up_model",
                missing: "initialize_from_config",
            });
        }
        let runner = self.runner.as_mut().ok_or(WorkerError::OutOfOrder {
            called: "compile_or_warm_up_model",
            missing: "load_model",
        })?;
        let block_size = self.config.block_size;
        let num_blocks = runner.kv_cache().map_or(0, |c| c.num_blocks());
        let n = 8
            .min(self.config.max_num_batched_tokens)
            .min(num_blocks * block_size)
            .min(runner.runner_config().max_model_len);
        let input = ModelInput::single(&vec![0; n], 0, (0..n.div_ceil(block_size) as u32).collect());
        runner.execute_model(&input)?;
        Ok(())
    }

    /// Runs one flattened batch and returns the logits of each sequence's
    /// last token: the runner's entry point, for benchmarks and tests that
    /// build their own batches.
    pub fn execute_model_input(&mut self, input: &ModelInput) -> Result<Logits, WorkerError> {
        let runner = self.runner.as_mut().ok_or(WorkerError::OutOfOrder {
            called: "execute_model_input",
            missing: "load_model",
        })?;
        Ok(runner.execute_model(input)?)
    }

    /// Applies a scheduler step's deltas to the persistent batch and runs
    /// its forward pass (vLLM's `execute_model`); the logits wait for
    /// [`Worker::sample_tokens`].
    pub fn execute_model(&mut self, so: &SchedulerOutput) -> Result<(), WorkerError> {
        if !self.kv_ready {
            return Err(WorkerError::OutOfOrder { called: "execute_model", missing: "initialize_from_config" });
        }
        let plan = self.input_batch.prepare(so, &mut self.step_input)?;
        self.pending = None;
        if !self.step_input.seqs.is_empty() {
            let runner = self
                .runner
                .as_mut()
                .ok_or(WorkerError::OutOfOrder { called: "execute_model", missing: "load_model" })?;
            let logits = runner.execute_model(&self.step_input)?;
            self.pending = Some((plan, logits));
        }
        Ok(())
    }

    /// Loads the logits processors and the sampler `plugins` (the engine's
    /// `[plugins]` section as JSON) names, applied to every sampled row from
    /// the next step on (the `load_logits_processors` worker method).
    pub fn load_logits_processors(&mut self, plugins: &str) -> Result<(), WorkerError> {
        let config: crate::config::PluginsConfig = serde_json::from_str(plugins)
            .map_err(|e| WorkerError::Config(format!("load_logits_processors: invalid [plugins] JSON: {e}")))?;
        let host = crate::plugins::host_from_config(&config)?;
        if let Some(processors) = host.logits_processors(&config.logits_processors)? {
            self.input_batch.set_processors(processors);
        }
        if let Some(sampler) = host.sampler(&config.sampler, config.sampler_top_k)? {
            self.input_batch.set_sampler(sampler);
        }
        Ok(())
    }

    /// Samples the step [`Worker::execute_model`] ran: one token for each
    /// request that reached the end of its known tokens, as `(handle, [token])`.
    pub fn sample_tokens(&mut self) -> Result<ModelRunnerOutput, WorkerError> {
        match self.pending.take() {
            Some((plan, mut logits)) => match self.input_batch.apply_processors(&plan, &mut logits) {
                Ok(()) => Ok(self.input_batch.sample(&plan, &mut logits)?),
                // A processor faulted under `on_error = "fail"`: the requests
                // whose rows it was given fail; the engine and the other
                // requests carry on.
                Err(e) => {
                    self.input_batch.fail(plan.sampling_handles());
                    Ok(ModelRunnerOutput::failed(plan.sampling_handles(), &e.to_string()))
                }
            },
            None => Ok(ModelRunnerOutput::default()),
        }
    }
}

/// The SIMD features that matter to the kernels, for the start-up log.
fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let f = [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
        ];
        let on: Vec<&str> = f.iter().filter(|(_, v)| *v).map(|(n, _)| *n).collect();
        if on.is_empty() {
            "none (scalar kernels)".to_string()
        } else {
            on.join(" ")
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "portable (scalar kernels)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> WorkerConfig {
        WorkerConfig::for_unit_tests()
    }

    #[test]
    fn rejects_zero_sizes() {
        let err = Worker::new(WorkerConfig {
            block_size: 0,
            ..config()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("block_size is 0"), "{err}");
        let err = Worker::new(WorkerConfig {
            max_model_len: Some(0),
            eos_token_id: None,
            ..config()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("max_model_len is 0"), "{err}");
    }

    #[test]
    fn names_the_missing_lifecycle_step() {
        let mut w = Worker::new(config()).unwrap();
        let err = w.load_model().unwrap_err().to_string();
        assert!(err.contains("load_model needs init_device"), "{err}");
        let err = w.determine_available_memory().unwrap_err().to_string();
        assert!(err.contains("needs load_model"), "{err}");
        let err = w.initialize_from_config(4).unwrap_err().to_string();
        assert!(err.contains("needs load_model"), "{err}");
        let err = w.compile_or_warm_up_model().unwrap_err().to_string();
        assert!(err.contains("needs initialize_from_config"), "{err}");
        let err = w
            .execute_model_input(&ModelInput::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs load_model"), "{err}");
    }

    #[test]
    fn a_missing_model_file_is_a_load_error_naming_it() {
        let mut w = Worker::new(config()).unwrap();
        w.init_device().unwrap();
        let err = w.load_model().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    }
}
