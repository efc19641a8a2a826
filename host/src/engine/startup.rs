//! Starting a worker and a tokenizer from the configuration, with a progress
//! spinner while the model loads.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::core::EngineCore;
use super::executor::executor_for;
use crate::config::EngineConfig;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::model::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use crate::worker::{Worker, WorkerConfig};

/// A worker whose KV cache is allocated, and the model's tokenizer.
pub struct Started {
    /// The model's tokenizer (or the configured `tokenizer.json`).
    pub tokenizer: Tokenizer,
    /// The worker, warmed up.
    pub worker: Worker,
    /// Blocks in the worker's KV cache.
    pub num_blocks: usize,
}

/// Threads for `worker.num_threads = 0`: every core.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Loads the tokenizer and runs the worker's start-up sequence:
/// init_device → load_model → determine_available_memory →
/// initialize_from_config → compile_or_warm_up_model.
pub fn start(config: &EngineConfig) -> anyhow::Result<Started> {
    let path = &config.model.path;
    let spinner = spinner(format!("loading {}", path.display()));
    let tokenizer = load_tokenizer(path, config.model.tokenizer.as_deref())?;
    let num_threads = match config.worker.num_threads {
        0 => default_threads(),
        n => n,
    };
    let mut worker = Worker::new(WorkerConfig {
        model: path.clone(),
        load_format: config.model.load_format,
        num_threads,
        kv_cache_memory_bytes: usize::try_from(config.cache.kv_cache_memory_bytes)
            .context("cache.kv_cache_memory_bytes does not fit this machine's address space")?,
        block_size: config.cache.block_size,
        max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
        max_model_len: (config.model.max_model_len > 0).then_some(config.model.max_model_len),
        eos_token_id: tokenizer.eos_token_id(),
    })?;
    worker.init_device()?;
    worker.load_model()?;
    let num_blocks = worker.determine_available_memory()? / worker.bytes_per_block()?;
    if num_blocks == 0 {
        anyhow::bail!(
            "cache.kv_cache_memory_bytes = {} is smaller than one KV block ({} bytes); raise it",
            config.cache.kv_cache_memory_bytes,
            worker.bytes_per_block()?
        );
    }
    worker.initialize_from_config(num_blocks)?;
    worker.compile_or_warm_up_model()?;
    spinner.finish_and_clear();
    Ok(Started { tokenizer, worker, num_blocks })
}

/// Starts the workers through the configured executor and sizes a scheduler
/// to their KV cache: the engine core, ready to step, and the tokenizer the
/// frontend needs.
pub fn build_engine_core(config: &EngineConfig) -> anyhow::Result<(EngineCore, Tokenizer)> {
    let started = start(config)?;
    let max_model_len = started.worker.max_model_len()?;
    let sched = &config.scheduler;
    let scheduler = Scheduler::new(SchedulerConfig {
        max_num_seqs: u32::try_from(sched.max_num_seqs)?,
        max_num_batched_tokens: u32::try_from(sched.max_num_batched_tokens)?,
        max_model_len: u32::try_from(max_model_len)?,
        long_prefill_token_threshold: u32::try_from(sched.long_prefill_token_threshold)?,
        enable_chunked_prefill: sched.enable_chunked_prefill,
        block_size: u32::try_from(config.cache.block_size)?,
        num_blocks: u32::try_from(started.num_blocks)?,
        enable_prefix_caching: config.cache.enable_prefix_caching,
        eos_token_id: started.tokenizer.eos_token_id(),
        policy: sched.policy.clone(),
    })?;
    let executor = executor_for(&config.parallel.distributed_executor_backend, started.worker)?;
    Ok((EngineCore::new(scheduler, executor), started.tokenizer))
}

/// The tokenizer: an explicit `tokenizer.json`, the one beside a Hugging
/// Face checkpoint, or the GGUF file's own.
fn load_tokenizer(model: &Path, explicit: Option<&Path>) -> anyhow::Result<Tokenizer> {
    if let Some(json) = explicit {
        return Ok(Tokenizer::from_file(json)?);
    }
    if model.is_dir() {
        return Ok(Tokenizer::from_file(&model.join("tokenizer.json"))?);
    }
    let gguf = GgufFile::open(model)?;
    Ok(Tokenizer::from_gguf(&gguf)?)
}

/// A spinner on stderr while the model loads (indicatif draws it only on a
/// terminal, so logs and pipes stay clean).
fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(message);
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("static template"));
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
