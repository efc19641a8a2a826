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

use std::sync::Arc;

mod config;
mod extensions;
mod host_api;
mod input_batch;
pub mod proc;
mod registry;
mod sleep;

pub use config::{WorkerConfig, WorkerDevice, WorkerError};
pub use host_api::LentModel;
pub use registry::{DuplicateMethod, Handler, WorkerMethods};
pub use sleep::{SleepLevel, WakeTags};

use crate::distributed::TpGroup;
use crate::kernels::{cpu_description, CpuKernels, MatmulPath, ThreadPool};
use crate::model::{self, LlamaConfig, ModelWeights};
use crate::model_runner::{
    CpuModelRunner, DeviceRunner, KvCacheBudget, Logits, ModelInput, RunnerConfig, StepProfile,
};
use crate::step::{ModelRunnerOutput, SchedulerOutput};
use input_batch::{InputBatch, StepPlan};
use sleep::Asleep;

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
    all_reduce: Option<Arc<TpGroup>>,
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
    /// The model's vocabulary for logits processors, once the engine sent
    /// it (`set_vocabulary`); the worker has no tokenizer of its own.
    vocabulary: Option<crate::sampling::Vocabulary>,
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
            (
                "kv_cache_memory_bytes",
                config.kv_cache_memory_bytes.unwrap_or(1),
            ),
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
            vocabulary: None,
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
                tracing::info!(threads = self.config.num_threads, kernels = %cpu_kernels(), "worker: CPU device");
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
    pub fn set_tensor_parallel(&mut self, group: Arc<TpGroup>) {
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
            model::load(path, self.config.load_format).map_err(|reason| WorkerError::Load {
                path: path.clone(),
                reason: Box::new(reason),
            })?;
        let runner = self.prepare_runner(&weights)?;
        weights.release_mapped_pages();
        // A runner that cannot compute prompt logprobs fails the requests
        // asking for them, saying so; the others are served.
        self.input_batch
            .set_no_prompt_logprobs((!runner.computes_span_logits()).then(|| {
                format!(
                    "prompt_logprobs (and echo with logprobs) are not supported on {}; \
                 the CPU worker computes them",
                    runner.device_name()
                )
            }));
        self.runner = Some(runner);
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
            cache_dtype: self.config.cache_dtype,
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
            Some(a) => WorkerError::Asleep {
                called,
                what: a.what(),
            },
            None => WorkerError::OutOfOrder {
                called,
                missing: "load_model",
            },
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
            max_num_seqs: self.config.max_num_seqs,
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
        Ok(self
            .runner_mut("execute_model_input")?
            .execute_model(input)?)
    }

    /// Starts (from zero) or stops timing each operation of the runner's
    /// steps (`host bench --profile`); `false` when the runner cannot.
    pub fn set_profiling(&mut self, on: bool) -> Result<bool, WorkerError> {
        Ok(self.runner_mut("set_profiling")?.set_profiling(on))
    }

    /// The time per operation since profiling started, if it is on.
    pub fn profile(&self) -> Option<&StepProfile> {
        self.runner.as_deref().and_then(|r| r.profile())
    }

    /// Applies a scheduler step's deltas to the persistent batch and runs
    /// its forward pass (vLLM's `execute_model`); the logits wait for
    /// [`Worker::sample_tokens`]. On a GPU, a step the device can sample
    /// is sampled here, where its logits are, and only the tokens wait.
    pub fn execute_model(&mut self, so: &SchedulerOutput) -> Result<(), WorkerError> {
        self.check_awake("execute_model")?;
        if self.num_blocks == 0 {
            return Err(WorkerError::OutOfOrder {
                called: "execute_model",
                missing: "initialize_from_config",
            });
        }
        let mut plan = self.input_batch.prepare(so, &mut self.step_input)?;
        self.pending = None;
        if self.step_input.seqs.is_empty() && plan.has_failures() {
            // Nothing runs, but the failures must reach the scheduler.
            let none = Logits {
                num_seqs: 0,
                vocab_size: 0,
                data: Vec::new(),
            };
            self.pending = Some(Pending::Host(plan, none));
        } else if !self.step_input.seqs.is_empty() {
            let runner = self.runner.as_deref_mut().ok_or(WorkerError::OutOfOrder {
                called: "execute_model",
                missing: "load_model",
            })?;
            if !plan.is_last_rows_only() {
                // Prompt logprobs: the runner hands the extra rows to the
                // plan as it computes them, in bounded chunks.
                let spans = std::mem::take(&mut plan.spans);
                let logits = runner.execute_model_with_spans(
                    &self.step_input,
                    &spans,
                    &mut |span, row, logits| plan.accept_logits_row(span, row, logits),
                )?;
                plan.spans = spans;
                self.pending = Some(Pending::Host(plan, logits));
                return Ok(());
            }
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
    /// the next step on (the `load_logits_processors` worker method); the
    /// one named `structured_outputs_backend` is asked only about requests
    /// that ask for structured output.
    pub fn load_logits_processors(
        &mut self,
        plugins: &str,
        structured_outputs_backend: &str,
    ) -> Result<(), WorkerError> {
        let config: crate::config::PluginsConfig = serde_json::from_str(plugins).map_err(|e| {
            WorkerError::Config(format!(
                "load_logits_processors: invalid [plugins] JSON: {e}"
            ))
        })?;
        let host = crate::plugins::host_from_config(&config)?;
        if let Some(mut processors) = host.logits_processors(&config.logits_processors)? {
            let key = crate::sampling::STRUCTURED_OUTPUTS_KEY;
            processors.claim_only_with(structured_outputs_backend, key);
            if let Some(vocabulary) = &self.vocabulary {
                processors.set_vocabulary(vocabulary)?;
            }
            self.input_batch.set_processors(processors);
        }
        if let Some(sampler) = host.sampler(&config.sampler, config.sampler_top_k)? {
            self.input_batch.set_sampler(sampler);
        }
        Ok(())
    }

    /// Keeps the model's vocabulary (JSON of [`crate::sampling::Vocabulary`],
    /// which the engine builds from its tokenizer) for the logits processors
    /// loaded after it (the `set_vocabulary` worker method, called before
    /// `load_logits_processors`). Set once: a different vocabulary later is
    /// refused, so a `collective_rpc` caller cannot change what the
    /// processors see.
    pub fn set_vocabulary(&mut self, json: &str) -> Result<(), WorkerError> {
        let vocabulary: crate::sampling::Vocabulary = serde_json::from_str(json)
            .map_err(|e| WorkerError::Config(format!("set_vocabulary: invalid JSON: {e}")))?;
        vocabulary
            .validate()
            .map_err(|e| WorkerError::Config(format!("set_vocabulary: {e}")))?;
        match &self.vocabulary {
            Some(v) if *v != vocabulary => Err(WorkerError::Config(
                "set_vocabulary: refused, the worker already has the engine's vocabulary".into(),
            )),
            _ => {
                self.vocabulary = Some(vocabulary);
                Ok(())
            }
        }
    }

    /// Samples the step [`Worker::execute_model`] ran: one token for each
    /// request that reached the end of its known tokens, or for a request
    /// verifying drafts the drafts it kept and one token after them.
    pub fn sample_tokens(&mut self) -> Result<ModelRunnerOutput, WorkerError> {
        let (mut plan, mut out) = match self.pending.take() {
            Some(Pending::Device(plan, tokens)) => {
                let out = self.input_batch.record_sampled(&plan, &tokens)?;
                (plan, out)
            }
            Some(Pending::Host(mut plan, mut logits)) => {
                let out = self.input_batch.sample_step(&mut plan, &mut logits)?;
                (plan, out)
            }
            None => return Ok(ModelRunnerOutput::default()),
        };
        plan.finish_output(&mut out);
        out.plugin_faults = self.input_batch.take_plugin_faults();
        Ok(out)
    }
}

/// The kernel family the worker runs and the CPU flags behind the choice,
/// as `host bench` prints them, so a log says which path served it.
fn cpu_kernels() -> String {
    let family = CpuKernels::from_env().map_or_else(|e| e, |k| k.name().to_string());
    match cpu_description() {
        Some((_, flags)) if !flags.is_empty() => format!("{family} kernels ({})", flags.join(" ")),
        _ => format!("{family} kernels"),
    }
}

#[cfg(test)]
mod tests;
