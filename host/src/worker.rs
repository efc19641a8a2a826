//! The worker: the object an executor drives, step by step, on one device,
//! shaped after vLLM V1's `GPUWorker` so the executor and the scheduler
//! call it the same way on the CPU and (`--features cuda`) on a GPU: the
//! device-specific part is the [`DeviceRunner`] it drives.
//!
//! Lifecycle, in order: [`Worker::new`] → [`Worker::init_device`] (thread
//! pool, or GPU selection and memory snapshot) → [`Worker::load_model`] →
//! [`Worker::determine_available_memory`] and [`Worker::bytes_per_block`]
//! (the engine divides one by the other) → [`Worker::initialize_from_config`]
//! (allocate the KV cache) → [`Worker::compile_or_warm_up_model`] →
//! [`Worker::execute_model`] and [`Worker::sample_tokens`] per step; between
//! steps [`Worker::sleep`], [`Worker::wake_up`] and
//! [`Worker::update_weights`] (`sleep.rs`). Calling a method before its
//! prerequisites is an error that names the missing step.

use std::path::PathBuf;
use std::sync::Arc;

use thiserror::Error;

mod host_api;
mod input_batch;
mod output;
pub mod proc;
mod registry;
mod rpc;
mod sleep;

pub use host_api::LentModel;
pub use output::{Logprobs, ModelRunnerOutput};
pub use registry::{DuplicateMethod, Handler, WorkerMethods};
pub use rpc::{RpcReply, RpcRequest, RpcValue};
pub use sleep::{SleepLevel, WakeTags};

use crate::distributed::AllReduceGroup;
use crate::kernels::{MatmulPath, ThreadPool};
use crate::model::{self, LlamaConfig, LoadFormat, ModelError, ModelWeights};
use crate::model_runner::{
    CpuModelRunner, DeviceRunner, KvCacheBudget, Logits, ModelInput, RunnerConfig, RunnerError,
};
use crate::scheduler::SchedulerOutput;
use input_batch::{BatchError, InputBatch, StepPlan};
use sleep::Asleep;

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
    /// `update_weights` was given an unknown name, a wrong size, or a value
    /// that is not finite; nothing changed.
    #[error("update_weights: {0}")]
    UpdateWeights(String),
    /// A call that needs the model awake ran while it sleeps.
    #[error("worker: {called} cannot run while the worker sleeps ({what} asleep); call wake_up first")]
    Asleep {
        /// The method called.
        called: &'static str,
        /// What sleeps: `weights`, `kv_cache` or both.
        what: String,
    },
}

/// The device a worker opened in `init_device`.
enum Device {
    /// The CPU's thread pool.
    Cpu(Arc<ThreadPool>),
    /// A CUDA GPU, its kernels loaded.
    #[cfg(feature = "cuda")]
    Gpu(crate::cuda::GpuDevice),
}

/// A step between `execute_model` and `sample_tokens`.
enum Pending {
    /// Its logits, for the host sampler.
    Host(StepPlan, Logits),
    /// The tokens the device sampled, one per sampled row in plan order.
    Device(StepPlan, Vec<u32>),
}

/// A worker: one device, one model runner, the persistent batch.
pub struct Worker {
    /// Its configuration.
    config: WorkerConfig,
    /// The device, after `init_device`.
    device: Option<Device>,
    /// The model runner, after `load_model` (absent while lent to a worker
    /// extension, or asleep at level 2).
    runner: Option<Box<dyn DeviceRunner>>,
    /// The tensor-parallel group this worker is a rank of, if any.
    all_reduce: Option<Arc<AllReduceGroup>>,
    /// The weights the runner was prepared from (memory-mapped), kept for
    /// worker extensions and `update_weights` to read and change, and to
    /// prepare the runner again after a level-2 sleep.
    weights: Option<ModelWeights>,
    /// Blocks of the KV cache, once allocated (0 before).
    num_blocks: usize,
    /// What sleeps, between `sleep` and the `wake_up` that wakes all.
    asleep: Option<Asleep>,
    /// The requests the scheduler is running, kept across steps.
    input_batch: InputBatch,
    /// The step being built (reused to avoid allocating).
    step_input: ModelInput,
    /// The step run by `execute_model`, until `sample_tokens`.
    pending: Option<Pending>,
}

impl Worker {
    /// Checks the configuration; starts nothing.
    pub fn new(config: WorkerConfig) -> Result<Worker, WorkerError> {
        let positive = [
            ("num_threads", config.num_threads),
            ("block_size", config.block_size),
            ("max_num_batched_tokens", config.max_num_batched_tokens),
            ("max_num_seqs", config.max_num_seqs),
            ("max_model_len", config.max_model_len.unwrap_or(1)),
            ("kv_cache_memory_bytes", config.kv_cache_memory_bytes.unwrap_or(1)),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(WorkerError::Config(format!(
                "{name} is 0; it must be at least 1"
            )));
        }
        let input_batch = InputBatch::new(config.eos_token_id);
        Ok(Worker {
            config,
            device: None,
            runner: None,
            all_reduce: None,
            weights: None,
            num_blocks: 0,
            asleep: None,
            input_batch,
            step_input: ModelInput::default(),
            pending: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Opens the device: on the CPU, starts the thread pool and logs the
    /// SIMD features the kernels can use; on a GPU, selects it, loads the
    /// kernels and takes the memory snapshot the profile run is measured
    /// against.
    pub fn init_device(&mut self) -> Result<(), WorkerError> {
        self.device = Some(match self.config.device {
            WorkerDevice::Cpu => {
                tracing::info!(threads = self.config.num_threads, features = %cpu_features(), "worker: CPU device");
                Device::Cpu(Arc::new(ThreadPool::new(self.config.num_threads)))
            }
            #[cfg(feature = "cuda")]
            WorkerDevice::Gpu => {
                let gpu = crate::cuda::GpuDevice::open(0)?;
                self.input_batch.set_samples_on_device();
                Device::Gpu(gpu)
            }
            #[cfg(not(feature = "cuda"))]
            WorkerDevice::Gpu => {
                return Err(WorkerError::Config(
                    "the GPU worker needs a host built with `--features cuda`".into(),
                ))
            }
        });
        Ok(())
    }

    /// Makes this worker one rank of a tensor-parallel group (before
    /// `load_model`, which then loads only the rank's shard).
    pub fn set_tensor_parallel(&mut self, group: Arc<AllReduceGroup>) {
        self.all_reduce = Some(group);
    }

    /// Loads the weights and prepares them for the device.
    pub fn load_model(&mut self) -> Result<(), WorkerError> {
        if self.device.is_none() {
            return Err(WorkerError::OutOfOrder {
                called: "load_model",
                missing: "init_device",
            });
        }
        let path = &self.config.model;
        let weights =
            model::load(path, self.config.load_format).map_err(|source| WorkerError::Load {
                path: path.clone(),
                source,
            })?;
        self.runner = Some(self.prepare_runner(&weights)?);
        self.weights = Some(weights);
        self.num_blocks = 0;
        self.asleep = None;
        Ok(())
    }

    /// A runner for `weights` on this worker's device.
    fn prepare_runner(&self, weights: &ModelWeights) -> Result<Box<dyn DeviceRunner>, WorkerError> {
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
        match self.device.as_ref() {
            Some(Device::Cpu(pool)) => Ok(Box::new(CpuModelRunner::new_rank(
                weights,
                pool.clone(),
                limits,
                self.all_reduce.clone(),
            )?)),
            #[cfg(feature = "cuda")]
            Some(Device::Gpu(gpu)) => Ok(Box::new(crate::cuda::GpuRunner::load(
                gpu,
                weights,
                limits,
                self.config.max_num_seqs,
                self.config.enforce_eager,
            )?)),
            None => Err(WorkerError::OutOfOrder {
                called: "load_model",
                missing: "init_device",
            }),
        }
    }

    /// The loaded runner, or the error naming the missing step.
    fn runner(&self, called: &'static str) -> Result<&dyn DeviceRunner, WorkerError> {
        match &self.runner {
            Some(r) => Ok(r.as_ref()),
            None => Err(self.no_runner(called)),
        }
    }

    /// The loaded runner, mutably.
    fn runner_mut(&mut self, called: &'static str) -> Result<&mut dyn DeviceRunner, WorkerError> {
        if self.runner.is_none() {
            return Err(self.no_runner(called));
        }
        Ok(self.runner.as_deref_mut().expect("checked above"))
    }

    /// Why there is no runner: never loaded, or asleep at level 2.
    fn no_runner(&self, called: &'static str) -> WorkerError {
        match &self.asleep {
            Some(a) => WorkerError::Asleep { called, what: a.what() },
            None => WorkerError::OutOfOrder { called, missing: "load_model" },
        }
    }

    /// The loaded model's hyper-parameters.
    pub fn model_config(&self) -> Result<&LlamaConfig, WorkerError> {
        match (&self.runner, &self.weights) {
            (Some(r), _) => Ok(r.model_config()),
            // Asleep at level 2: the runner is gone, the weights know.
            (None, Some(w)) if self.asleep.is_some() => Ok(&w.config),
            _ => Err(self.no_runner("model_config")),
        }
    }

    /// The longest context this worker runs (the configured one, or the
    /// model's).
    pub fn max_model_len(&self) -> Result<usize, WorkerError> {
        Ok(self.runner("max_model_len")?.runner_config().max_model_len)
    }

    /// Bytes one KV-cache block takes across all layers (K and V).
    pub fn bytes_per_block(&self) -> Result<usize, WorkerError> {
        Ok(self.runner("bytes_per_block")?.bytes_per_block())
    }

    /// Memory available for the KV cache: the configured budget, or on a
    /// GPU what `gpu_memory_utilization` leaves after a profile run at
    /// `max_num_batched_tokens`.
    pub fn determine_available_memory(&mut self) -> Result<usize, WorkerError> {
        let budget = KvCacheBudget {
            bytes: self.config.kv_cache_memory_bytes,
            gpu_memory_utilization: self.config.gpu_memory_utilization,
        };
        Ok(self
            .runner_mut("determine_available_memory")?
            .determine_available_memory(&budget)?)
    }

    /// Allocates the KV cache with `num_blocks` blocks.
    pub fn initialize_from_config(&mut self, num_blocks: usize) -> Result<(), WorkerError> {
        let runner = self.runner_mut("initialize_from_config")?;
        runner.initialize_kv_cache(num_blocks)?;
        let (device, bytes) = (runner.device_name(), num_blocks * runner.bytes_per_block());
        self.num_blocks = num_blocks;
        tracing::info!(num_blocks, bytes, device, "worker: KV cache");
        Ok(())
    }

    /// Runs one small dummy step so first-touch costs are paid before the
    /// first request; on a GPU, also captures the decode CUDA graphs.
    pub fn compile_or_warm_up_model(&mut self) -> Result<(), WorkerError> {
        if self.num_blocks == 0 {
            return Err(WorkerError::OutOfOrder {
                called: "compile_or_warm_up_model",
                missing: "initialize_from_config",
            });
        }
        Ok(self.runner_mut("compile_or_warm_up_model")?.warm_up()?)
    }

    /// Runs one flattened batch and returns the logits of each sequence's
    /// last token: the runner's entry point, for benchmarks and tests that
    /// build their own batches.
    pub fn execute_model_input(&mut self, input: &ModelInput) -> Result<Logits, WorkerError> {
        self.check_awake("execute_model_input")?;
        Ok(self.runner_mut("execute_model_input")?.execute_model(input)?)
    }

    /// Applies a scheduler step's deltas to the persistent batch and runs
    /// its forward pass (vLLM's `execute_model`); the logits wait for
    /// [`Worker::sample_tokens`]. On a GPU, a step the device can sample
    /// is sampled here, where its logits are, and only the tokens wait.
    pub fn execute_model(&mut self, so: &SchedulerOutput) -> Result<(), WorkerError> {
        self.check_awake("execute_model")?;
        if self.num_blocks == 0 {
            return Err(WorkerError::OutOfOrder { called: "execute_model", missing: "initialize_from_config" });
        }
        let plan = self.input_batch.prepare(so, &mut self.step_input)?;
        self.pending = None;
        if !self.step_input.seqs.is_empty() {
            let runner = self
                .runner
                .as_deref_mut()
                .ok_or(WorkerError::OutOfOrder { called: "execute_model", missing: "load_model" })?;
            if let Some(rows) = self.input_batch.device_rows(&plan) {
                if let Some(tokens) = runner.execute_and_sample(&self.step_input, &rows) {
                    self.pending = Some(Pending::Device(plan, tokens?));
                    return Ok(());
                }
            }
            let logits = runner.execute_model(&self.step_input)?;
            self.pending = Some(Pending::Host(plan, logits));
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
            Some(Pending::Device(plan, tokens)) => Ok(self.input_batch.record_sampled(&plan, &tokens)?),
            Some(Pending::Host(plan, mut logits)) => match self.input_batch.apply_processors(&plan, &mut logits) {
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
    fn the_cpu_worker_samples_on_the_host_even_when_every_row_is_device_eligible() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut w = Worker::new(WorkerConfig {
            model: crate::config::default_model_path(&root),
            ..config()
        })
        .unwrap();
        w.init_device().unwrap();
        w.load_model().unwrap();
        w.initialize_from_config(8).unwrap();
        let prompt = vec![1u32, 504, 3458, 282];
        let so = SchedulerOutput {
            scheduled_new_reqs: vec![crate::scheduler::NewRequestData {
                handle: crate::scheduler::ReqHandle(0),
                request_id: "r0".into(),
                prompt_token_ids: prompt.clone(),
                // Greedy, no logprobs: a row the device sampler could take.
                sampling_params: crate::sampling::SamplingParams { temperature: 0.0, ..Default::default() },
                block_ids: vec![0],
                num_computed_tokens: 0,
            }],
            num_scheduled_tokens: vec![(crate::scheduler::ReqHandle(0), prompt.len() as u32)],
            ..SchedulerOutput::default()
        };
        // The CPU runner does not sample on a device.
        let rows = [crate::model_runner::DeviceSampleRow {
            params: &crate::sampling::SamplingParams::default(),
            seed: 0,
            position: 4,
            logits_row: 0,
        }];
        let input = ModelInput::single(&prompt, 0, vec![0]);
        assert!(w.runner_mut("test").unwrap().execute_and_sample(&input, &rows).is_none());
        w.execute_model(&so).unwrap();
        let Some(Pending::Host(_, logits)) = &w.pending else {
            panic!("the CPU worker left no logits for the host sampler");
        };
        let want = crate::sampling::select::argmax(&logits.data[..logits.vocab_size]) as u32;
        let out = w.sample_tokens().unwrap();
        assert_eq!(out.sampled, vec![(crate::scheduler::ReqHandle(0), [want])]);
    }

    #[test]
    fn a_missing_model_file_is_a_load_error_naming_it() {
        let mut w = Worker::new(config()).unwrap();
        w.init_device().unwrap();
        let err = w.load_model().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    }
}
