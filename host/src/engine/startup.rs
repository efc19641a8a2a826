//! Start-up from the configuration: the tokenizer, the executor and its
//! workers, and the KV cache sized over every worker; with a progress
//! spinner while the model loads.
//!
//! The lifecycle after load_model runs as `collective_rpc` calls, the same
//! for `uni` and `mp`: determine_available_memory and bytes_per_block on
//! every rank (the engine takes the fewest blocks any worker can hold) →
//! initialize_from_config → compile_or_warm_up_model.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::core::{EngineCore, Respawn, Respawned};
use super::executor::{executor_for, Executor, MultiprocExecutor, UniProcExecutor};
use super::kv_events::{self, KvEventPublisher};
use crate::config::EngineConfig;
use crate::model::gguf::GgufFile;
use crate::sampling::Vocabulary;
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
    let num_blocks = available_blocks(&mut executor, config)?;
    allocate_kv_cache(&mut executor, config, num_blocks)?;
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
    let num_blocks = available_blocks(executor.as_mut(), config)?;
    allocate_kv_cache(executor.as_mut(), config, num_blocks)?;
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
    // Logits processors (0.3) learn the vocabulary; only the engine has the
    // tokenizer, so it sends each token's bytes.
    let vocabulary = (!config.plugins.logits_processors.is_empty()).then(|| {
        let v = Vocabulary::from_tokens(tokenizer.tokens(), tokenizer.eos_token_id());
        serde_json::to_string(&v).expect("a vocabulary serializes")
    });
    load_worker_plugins(executor.as_mut(), config, vocabulary.as_deref())?;
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
    // A step's drafts come from the tokens of the step before, so with
    // speculative decoding no step is scheduled while another runs.
    let async_scheduling = sched.async_scheduling && !config.speculative.enabled();
    if sched.async_scheduling && !async_scheduling {
        tracing::info!("speculative decoding is on: steps run one at a time (no async scheduling)");
    }
    let mut core = EngineCore::new(scheduler, executor).with_async_scheduling(async_scheduling);
    let rank = config.parallel.data_parallel_rank;
    if config.kv_events.enabled() {
        let kv_events = kv_events::for_rank(&config.kv_events, rank)?;
        core = core.with_kv_events(KvEventPublisher::start(&kv_events, u32::try_from(rank)?)?);
    }
    let eos = tokenizer.eos_token_id();
    if let Some(respawn) = respawn_workers(config, eos, vocabulary, num_blocks) {
        core = core.with_worker_restart(respawn, &config.engine);
    }
    Ok((core, tokenizer))
}

/// Plugins the workers run beside the model: the vocabulary first (when
/// logits processors are configured), then the processors and the sampler
/// the workers' own copy of the operator's `[plugins]` names (the call
/// carries nothing a caller could widen).
fn load_worker_plugins(
    executor: &mut dyn Executor,
    config: &EngineConfig,
    vocabulary: Option<&str>,
) -> anyhow::Result<()> {
    if config.plugins.logits_processors.is_empty() && config.plugins.sampler.is_empty() {
        return Ok(());
    }
    let timeout = start_timeout(config);
    if let Some(vocabulary) = vocabulary {
        let vocabulary = RpcValue::Json(vocabulary.to_string());
        executor.call("set_vocabulary", vocabulary, None, timeout)?;
    }
    executor.call("load_logits_processors", RpcValue::Unit, None, timeout)?;
    Ok(())
}

/// How the engine core replaces a dead worker group (`mp` only: an
/// in-process worker dies with the engine core, which its client restarts
/// instead), unless `engine.max_restarts` is 0. The new group gets the KV
/// cache the scheduler was sized to and the same plugins.
fn respawn_workers(
    config: &EngineConfig,
    eos_token_id: Option<u32>,
    vocabulary: Option<String>,
    num_blocks: usize,
) -> Option<Respawn> {
    if config.parallel.distributed_executor_backend != "mp" || config.engine.max_restarts == 0 {
        return None;
    }
    let config = config.clone();
    Some(Box::new(move || {
        let t0 = Instant::now();
        let tp = config.parallel.tensor_parallel_size;
        let mut executor = MultiprocExecutor::start(&config, eos_token_id, tp)?;
        let load_s = executor.model_load_seconds();
        let spawn_s = (t0.elapsed().as_secs_f64() - load_s).max(0.0);
        let t1 = Instant::now();
        let available = available_blocks(&mut executor, &config)?;
        if available < num_blocks {
            anyhow::bail!(
                "the new workers hold {available} KV blocks, fewer than the {num_blocks} \
                 the engine was sized to at start"
            );
        }
        allocate_kv_cache(&mut executor, &config, num_blocks)?;
        load_worker_plugins(&mut executor, &config, vocabulary.as_deref())?;
        Ok(Respawned {
            executor: Box::new(executor),
            spawn_s,
            load_s,
            init_s: t1.elapsed().as_secs_f64(),
        })
    }))
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

/// The fewest KV blocks any worker can hold.
fn available_blocks(executor: &mut dyn Executor, config: &EngineConfig) -> anyhow::Result<usize> {
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
    Ok(usize::try_from(num_blocks)?)
}

/// Allocates `num_blocks` KV blocks on every worker and warms the model up.
fn allocate_kv_cache(
    executor: &mut dyn Executor,
    config: &EngineConfig,
    num_blocks: usize,
) -> anyhow::Result<()> {
    let timeout = start_timeout(config);
    executor.call(
        "initialize_from_config",
        RpcValue::Count(num_blocks as u64),
        None,
        timeout,
    )?;
    executor.call("compile_or_warm_up_model", RpcValue::Unit, None, timeout)?;
    Ok(())
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
/// Hugging Face checkpoint, or the GGUF file's own; with
/// `model.chat_template` as its chat template when set.
pub fn load_tokenizer(config: &EngineConfig) -> anyhow::Result<Tokenizer> {
    let mut tokenizer = tokenizer_from(&config.model.path, config.model.tokenizer.as_deref())?;
    if let Some(value) = &config.model.chat_template {
        let source = chat_template_source(value)?;
        tokenizer
            .set_chat_template(&source)
            .context("model.chat_template does not compile; fix the template or leave the key out for the model's own")?;
    }
    Ok(tokenizer)
}

/// `model.chat_template`'s template, read as vLLM reads `--chat-template`:
/// the file it names, else the value itself when it reads as a template
/// (it has a brace or a newline, which paths do not).
fn chat_template_source(value: &str) -> anyhow::Result<String> {
    let path = Path::new(value);
    if path.is_file() {
        return std::fs::read_to_string(path)
            .with_context(|| format!("model.chat_template: cannot read `{value}`"));
    }
    if value.contains(['{', '}', '\n']) {
        return Ok(value.to_string());
    }
    anyhow::bail!(
        "model.chat_template: `{value}` is no file and no template; give the path of a Jinja \
         file or the template itself"
    )
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

#[cfg(test)]
mod tests {
    use super::{chat_template_source, fit_to_kv_cache};

    #[test]
    fn a_chat_template_is_a_file_or_the_template_itself() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.jinja");
        std::fs::write(&file, "{{ messages[0].content }}").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(
            chat_template_source(path).unwrap(),
            "{{ messages[0].content }}"
        );
        let inline = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(chat_template_source(inline).unwrap(), inline);
        let missing = dir.path().join("absent.jinja");
        let err = chat_template_source(missing.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.chat_template") && err.contains("absent.jinja"),
            "{err}"
        );
    }

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
