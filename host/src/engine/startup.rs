//! Start-up from the configuration: the tokenizer, the executor and its
//! workers, and the KV cache sized over every worker; with a progress
//! spinner while the model loads.
//!
//! The lifecycle after load_model runs as `collective_rpc` calls, the same
//! for `uni` and `mp`: determine_available_memory and bytes_per_block on
//! every rank (the engine takes the fewest blocks any worker can hold) →
//! initialize_from_config → compile_or_warm_up_model.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::core::EngineCore;
use super::executor::{executor_for, Executor, UniProcExecutor};
use crate::config::EngineConfig;
use crate::model::gguf::GgufFile;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::step::RpcValue;
use crate::tokenizer::Tokenizer;
use crate::worker::{proc::worker_config, Worker};

/// A worker in this process, its KV cache allocated, and the model's
/// tokenizer: for callers that drive the model runner directly.
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
    crate::worker::proc::default_threads()
}

/// Loads the tokenizer and starts one worker in this process through its
/// whole start-up sequence (`host bench` drives it directly).
pub fn start(config: &EngineConfig) -> anyhow::Result<Started> {
    let spinner = spinner(format!("loading {}", config.model.path.display()));
    let tokenizer = load_tokenizer(config)?;
    let mut executor = UniProcExecutor::start(worker_config(config, tokenizer.eos_token_id())?)?;
    let num_blocks = initialize_kv_cache(&mut executor, config)?;
    spinner.finish_and_clear();
    Ok(Started {
        tokenizer,
        worker: executor.into_worker(),
        num_blocks,
    })
}

/// Starts the workers through the configured executor and sizes a scheduler
/// to their KV cache: the engine core, ready to step, and the tokenizer the
/// frontend needs.
pub fn build_engine_core(config: &EngineConfig) -> anyhow::Result<(EngineCore, Tokenizer)> {
    let spinner = spinner(format!("loading {}", config.model.path.display()));
    let tokenizer = load_tokenizer(config)?;
    let mut executor = executor_for(config, tokenizer.eos_token_id())?;
    let num_blocks = initialize_kv_cache(executor.as_mut(), config)?;
    let timeout = start_timeout(config);
    let max_model_len = counts(
        executor.call("max_model_len", RpcValue::Unit, None, timeout)?,
        "max_model_len",
    )?
    .into_iter()
    .min()
    .context("max_model_len: no worker replied")?;
    let max_model_len = fit_to_kv_cache(
        usize::try_from(max_model_len)?,
        num_blocks * config.cache.block_size,
        config.model.max_model_len > 0,
    )?;
    if !config.plugins.logits_processors.is_empty() || !config.plugins.sampler.is_empty() {
        if !config.plugins.logits_processors.is_empty() {
            // Logits processors (0.3) learn the vocabulary; only the engine
            // has the tokenizer, so it sends each token's bytes first.
            let vocabulary = vocabulary_json(&tokenizer);
            executor.call("set_vocabulary", RpcValue::Json(vocabulary), None, timeout)?;
        }
        // The workers load what their own copy of the operator's [plugins]
        // names; the call carries nothing a caller could widen.
        executor.call("load_logits_processors", RpcValue::Unit, None, timeout)?;
    }
    spinner.finish_and_clear();
    let sched = &config.scheduler;
    let policy = scheduling_policy(config)?;
    let scheduler = Scheduler::with_policy(
        SchedulerConfig {
            eos_token_id: tokenizer.eos_token_id(),
            policy: policy.name().to_string(),
            ..SchedulerConfig::from_engine_config(
                config,
                max_model_len,
                u32::try_from(num_blocks)?,
            )?
        },
        policy,
    )?;
    let core = EngineCore::new(scheduler, executor).with_async_scheduling(sched.async_scheduling);
    Ok((core, tokenizer))
}

/// The longest context the engine accepts: the model's (or the configured)
/// `max_model_len`, so that one request of that length fits the KV cache.
/// An explicitly configured length that does not fit is an error, as in
/// vLLM; the model's own is lowered to what fits, with a warning, so the
/// defaults always start.
fn fit_to_kv_cache(
    max_model_len: usize,
    kv_tokens: usize,
    explicit: bool,
) -> anyhow::Result<usize> {
    if max_model_len <= kv_tokens {
        return Ok(max_model_len);
    }
    if explicit {
        anyhow::bail!(
            "model.max_model_len = {max_model_len} is more than the KV cache holds ({kv_tokens} tokens); \
             lower model.max_model_len or raise cache.kv_cache_memory_bytes"
        );
    }
    tracing::warn!(
        "the KV cache holds {kv_tokens} tokens, fewer than the model's context of {max_model_len}; \
         serving at most {kv_tokens} (raise cache.kv_cache_memory_bytes for more)"
    );
    Ok(kv_tokens)
}

/// The policy `scheduler.policy` names: a built-in, or a plugin made known
/// by `[plugins]` (the WebAssembly engine starts only when plugins are
/// configured).
fn scheduling_policy(
    config: &EngineConfig,
) -> anyhow::Result<Box<dyn crate::scheduler::SchedulingPolicy>> {
    crate::scheduler::policy_from_config(&config.scheduler.policy, &config.plugins)
}

/// Sizes the KV cache to the fewest blocks any worker can hold, allocates
/// it on every worker and warms the model up; returns the block count.
fn initialize_kv_cache(
    executor: &mut dyn Executor,
    config: &EngineConfig,
) -> anyhow::Result<usize> {
    let timeout = start_timeout(config);
    let memory = counts(
        executor.call("determine_available_memory", RpcValue::Unit, None, timeout)?,
        "determine_available_memory",
    )?;
    let per_block = counts(
        executor.call("bytes_per_block", RpcValue::Unit, None, timeout)?,
        "bytes_per_block",
    )?;
    let num_blocks = memory
        .iter()
        .zip(&per_block)
        .map(|(m, b)| m / b.max(&1))
        .min()
        .unwrap_or(0);
    if num_blocks == 0 {
        anyhow::bail!(
            "the KV cache budget ({} bytes; cache.kv_cache_memory_bytes) is smaller than one KV block ({} bytes); raise it",
            memory.iter().min().copied().unwrap_or(0),
            per_block.iter().max().copied().unwrap_or(0)
        );
    }
    executor.call(
        "initialize_from_config",
        RpcValue::Count(num_blocks),
        None,
        timeout,
    )?;
    executor.call("compile_or_warm_up_model", RpcValue::Unit, None, timeout)?;
    Ok(usize::try_from(num_blocks)?)
}

/// The deadline for start-up calls (`mp`): the workers' start timeout.
fn start_timeout(config: &EngineConfig) -> Option<Duration> {
    Duration::try_from_secs_f64(config.parallel.worker_start_timeout_s).ok()
}

/// The counts every rank replied, or an error naming `method`.
fn counts(replies: Vec<RpcValue>, method: &str) -> anyhow::Result<Vec<u64>> {
    replies
        .into_iter()
        .map(|v| v.into_count(method).map_err(anyhow::Error::msg))
        .collect()
}

/// The configured model's tokenizer: `model.tokenizer`, the one beside a
/// Hugging Face checkpoint, or the GGUF file's own.
pub fn load_tokenizer(config: &EngineConfig) -> anyhow::Result<Tokenizer> {
    tokenizer_from(&config.model.path, config.model.tokenizer.as_deref())
}

fn tokenizer_from(model: &Path, explicit: Option<&Path>) -> anyhow::Result<Tokenizer> {
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
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// The tokenizer's vocabulary as the workers' `set_vocabulary` reads it
/// (`plugins::Vocabulary` as JSON): every token's bytes flat, each token's
/// end offset, the special ids and EOS.
fn vocabulary_json(tokenizer: &Tokenizer) -> String {
    let mut token_bytes = Vec::new();
    let mut token_ends = Vec::with_capacity(tokenizer.vocab_size());
    let mut special_ids = Vec::new();
    for (id, (bytes, special)) in tokenizer.tokens().enumerate() {
        token_bytes.extend_from_slice(bytes);
        token_ends.push(token_bytes.len() as u32);
        if special {
            special_ids.push(id as u32);
        }
    }
    serde_json::json!({
        "token_bytes": token_bytes,
        "token_ends": token_ends,
        "special_ids": special_ids,
        "eos": tokenizer.eos_token_id(),
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::fit_to_kv_cache;

    #[test]
    fn max_model_len_fits_the_kv_cache() {
        assert_eq!(fit_to_kv_cache(2048, 4096, false).unwrap(), 2048);
        assert_eq!(fit_to_kv_cache(2048, 4096, true).unwrap(), 2048);
        // The model's own context is lowered to what the cache holds.
        assert_eq!(fit_to_kv_cache(8192, 5824, false).unwrap(), 5824);
        // A configured one that does not fit is the user's to fix.
        let err = fit_to_kv_cache(8192, 5824, true).unwrap_err().to_string();
        assert!(
            err.contains("model.max_model_len = 8192") && err.contains("kv_cache_memory_bytes"),
            "{err}"
        );
    }
}
