//! `WorkerProc`: a worker in its own process (the hidden `host worker`
//! command that the `mp` executor starts once per rank).
//!
//! Pipes, as in vLLM's `make_worker_process`, carried on the standard
//! streams so no descriptor has to be passed by number:
//! - **stdin** brings one JSON line, the [`Bootstrap`] (rank, configuration
//!   as TOML, the broadcast queue's handle), and then serves as the **death
//!   pipe**: the parent never writes to it again, so end-of-file means the
//!   parent closed it (shutdown) or died, even by SIGKILL (the kernel closes
//!   a dead process's descriptors); either way the worker exits at once.
//! - **stdout** is the **ready pipe**: one JSON line, [`ReadyMessage`]:
//!   READY with the worker's response-queue handle, or FAILED with the error.
//!
//! Start-up: init_device → load_model → response queue → attach to the
//! broadcast queue → READY → wait for the parent to attach → busy loop. The
//! rest of the lifecycle (determine_available_memory, initialize_from_config,
//! compile_or_warm_up_model) arrives as calls, like every step.

use std::io::{BufRead, Read, Write};
use std::time::Duration;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::registry::WorkerMethods;
use super::{Worker, WorkerConfig, WorkerDevice};
use crate::config::EngineConfig;
use crate::distributed::{GroupHandle, TpGroup};
use crate::message_queue::{Handle, MessageQueue, QueueConfig, QueueError};
use crate::step::{RpcReply, RpcRequest};

/// What the parent sends a worker process on its stdin.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Bootstrap {
    /// This worker's rank.
    pub rank: usize,
    /// Number of workers.
    pub world_size: usize,
    /// The engine configuration, as TOML.
    pub config_toml: String,
    /// The tokenizer's end-of-sequence token (the worker has no tokenizer).
    pub eos_token_id: Option<u32>,
    /// The broadcast queue the calls arrive on.
    pub rpc_handle: Handle,
    /// How long to wait for the parent to attach to the response queue.
    pub attach_timeout: Duration,
    /// The tensor-parallel all-reduce group, when `world_size > 1`.
    pub all_reduce: Option<GroupHandle>,
    /// Set for a rank on another machine than the engine's (a headless
    /// node fills it in): the address to listen on for the engine, whose
    /// reads of the response queue then come over TCP.
    #[serde(default)]
    pub response_bind: Option<String>,
}

impl Bootstrap {
    /// A bootstrap for protocol tests: nothing in it is started.
    #[cfg(test)]
    pub(crate) fn for_tests(rank: usize, world_size: usize) -> Bootstrap {
        Bootstrap {
            rank,
            world_size,
            config_toml: String::new(),
            eos_token_id: None,
            rpc_handle: MessageQueue::new_writer(1, QueueConfig::default())
                .expect("a test queue")
                .export_handle(),
            attach_timeout: Duration::from_secs(1),
            all_reduce: None,
            response_bind: None,
        }
    }
}

/// What a worker process answers on its stdout once started.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ReadyMessage {
    /// Started; the parent attaches to this response queue as its reader.
    Ready {
        /// The worker's response queue.
        response_handle: Handle,
        /// Seconds `load_model` took (the engine reports it when it
        /// restarts a worker group).
        #[serde(default)]
        load_s: f64,
    },
    /// Start-up failed; the process exits.
    Failed {
        /// Why.
        error: String,
    },
}

/// The worker configuration the engine configuration describes.
pub fn worker_config(
    config: &EngineConfig,
    eos_token_id: Option<u32>,
) -> anyhow::Result<WorkerConfig> {
    Ok(WorkerConfig {
        model: config.model.path.clone(),
        load_format: config.model.load_format,
        num_threads: match config.worker.num_threads {
            // Tensor-parallel ranks share the cores.
            0 => (default_threads() / config.parallel.tensor_parallel_size.max(1)).max(1),
            n => n,
        },
        device: worker_device(&config.worker.cls, config.parallel.tensor_parallel_size)?,
        kv_cache_memory_bytes: config
            .cache
            .kv_cache_memory_bytes
            .map(usize::try_from)
            .transpose()
            .context("cache.kv_cache_memory_bytes does not fit this machine's address space")?,
        gpu_memory_utilization: config.cache.gpu_memory_utilization,
        block_size: config.cache.block_size,
        cache_dtype: config.cache.cache_dtype,
        max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
        max_num_seqs: config.scheduler.max_num_seqs,
        enforce_eager: config.model.enforce_eager,
        max_model_len: (config.model.max_model_len > 0).then_some(config.model.max_model_len),
        eos_token_id,
    })
}

/// The device `worker.cls` names: `auto` is the GPU when this host was
/// built with CUDA, a GPU is visible and there is one rank (tensor
/// parallelism runs on CPU workers), else the CPU. `gpu` with no visible
/// GPU is an error (the configuration's validation refused it in a build
/// without CUDA).
pub fn worker_device(cls: &str, tensor_parallel_size: usize) -> anyhow::Result<WorkerDevice> {
    Ok(match cls {
        "gpu" if !gpu_visible() => anyhow::bail!(
            "worker.cls is `gpu` but no CUDA GPU is visible (no libcuda, or no device); use `auto` or `cpu`"
        ),
        "gpu" => WorkerDevice::Gpu,
        "auto" if tensor_parallel_size <= 1 && gpu_visible() => WorkerDevice::Gpu,
        _ => WorkerDevice::Cpu,
    })
}

/// Whether this build can drive a visible CUDA GPU.
fn gpu_visible() -> bool {
    #[cfg(feature = "cuda")]
    return crate::cuda::device::device_count() > 0;
    #[cfg(not(feature = "cuda"))]
    false
}

/// Every core: `worker.num_threads = 0` gives each tensor-parallel rank its
/// share of them.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs a worker process: bootstrap from stdin, start, READY on stdout,
/// then serve calls until the parent goes away. Returns only on an error
/// (a normal end exits the process from the death-pipe watcher or when the
/// broadcast queue shuts down).
pub fn run() -> anyhow::Result<()> {
    let boot: Bootstrap = bootstrap_from_parent("host worker", "the mp executor")?;
    let started = start(&boot);
    let message = match &started {
        Ok((_, _, response, _, load_s)) => ReadyMessage::Ready {
            response_handle: response.export_handle(),
            load_s: *load_s,
        },
        Err(e) => ReadyMessage::Failed {
            error: format!("{e:#}"),
        },
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&message)?)?;
    out.flush()?;
    drop(out);
    let (mut worker, rpc, response, methods, _) = started?;
    response.wait_until_ready(boot.attach_timeout)?;
    busy_loop(boot.rank, &mut worker, &methods, &rpc, &response)
}

/// init_device → load_model → response queue → attach to the broadcast.
/// The methods are the built-ins plus the configured worker extensions'.
/// What a started worker process runs with, and the seconds its model took
/// to load.
type Started = (Worker, MessageQueue, MessageQueue, WorkerMethods, f64);

fn start(boot: &Bootstrap) -> anyhow::Result<Started> {
    let config: EngineConfig =
        toml::from_str(&boot.config_toml).context("the bootstrap's configuration")?;
    let mut worker = Worker::new(worker_config(&config, boot.eos_token_id)?)?;
    worker.init_device()?;
    if let Some(handle) = &boot.all_reduce {
        let group = TpGroup::attach(handle, boot.rank).with_context(|| {
            format!(
                "worker rank {} attaching to the tensor-parallel group",
                boot.rank
            )
        })?;
        worker.set_tensor_parallel(std::sync::Arc::new(group));
    }
    let load = std::time::Instant::now();
    worker.load_model()?;
    let load_s = load.elapsed().as_secs_f64();
    let response = match &boot.response_bind {
        Some(host) => MessageQueue::new_writer_with_remote(1, &[0], host, QueueConfig::default())
            .with_context(|| format!("worker rank {} listening on {host}", boot.rank))?,
        None => MessageQueue::new_writer(1, QueueConfig::default())?,
    };
    let rpc = MessageQueue::create_from_handle(&boot.rpc_handle, boot.rank)
        .with_context(|| format!("worker rank {} attaching to the broadcast queue", boot.rank))?;
    tracing::info!(
        rank = boot.rank,
        world_size = boot.world_size,
        "worker process ready"
    );
    let mut methods = WorkerMethods::builtin();
    methods.register_extensions(&config)?;
    Ok((worker, rpc, response, methods, load_s))
}

/// Serves calls: each arrives on the broadcast queue, runs through the
/// registry, and the output rank (or every rank) replies SUCCESS or
/// FAILURE. A failing method does not stop the loop; a shut-down or
/// writerless queue ends it normally, a corrupted frame with an error.
pub fn busy_loop(
    rank: usize,
    worker: &mut Worker,
    methods: &WorkerMethods,
    rpc: &MessageQueue,
    response: &MessageQueue,
) -> anyhow::Result<()> {
    loop {
        let req: RpcRequest = match rpc.dequeue(None) {
            Ok(req) => req,
            Err(QueueError::Shutdown | QueueError::WriterDead { .. }) => return Ok(()),
            Err(e) => {
                return Err(e).with_context(|| format!("worker rank {rank} reading its next call"))
            }
        };
        let reply = match methods.call(worker, &req.method, req.args) {
            Ok(value) => RpcReply::Success(value),
            Err(message) => {
                tracing::warn!(rank, method = %req.method, %message, "worker method failed");
                RpcReply::Failure(message)
            }
        };
        if req.output_rank.is_none_or(|r| r as usize == rank) {
            match response.enqueue(&reply, None) {
                Ok(()) => {}
                Err(QueueError::Shutdown) => return Ok(()),
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("worker rank {rank} replying to {}", req.method))
                }
            }
        }
    }
}

/// A child process's start, shared by every child `host` starts (workers,
/// the engine core): reads the bootstrap, the one JSON line the parent
/// writes on stdin, then watches stdin as the death pipe
/// ([`watch_death_pipe`]). `command` and `parent` name who starts the
/// process, for the person who runs it by hand.
pub(crate) fn bootstrap_from_parent<T: DeserializeOwned>(
    command: &str,
    parent: &str,
) -> anyhow::Result<T> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .context("reading the bootstrap line from stdin")?;
    let boot = serde_json::from_str(&line).with_context(|| {
        format!(
            "`{command}` is started by {parent}, which writes its bootstrap on stdin; \
             it is not meant to be run by hand"
        )
    })?;
    std::thread::Builder::new()
        .name("death-pipe".into())
        .spawn(watch_death_pipe)
        .context("starting the death-pipe watcher")?;
    Ok(boot)
}

/// Blocks on stdin until end-of-file (the parent closed the death pipe or
/// died), then ends the process.
fn watch_death_pipe() {
    let mut buf = [0u8; 64];
    loop {
        match std::io::stdin().read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(0) | Err(_) => {
                tracing::info!("the parent closed the death pipe; exiting");
                std::process::exit(0);
            }
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::RpcValue;

    const WAIT: Option<Duration> = Some(Duration::from_secs(10));

    fn worker() -> Worker {
        Worker::new(WorkerConfig::for_unit_tests()).unwrap()
    }

    fn request(method: &str, output_rank: Option<u32>) -> RpcRequest {
        RpcRequest {
            method: method.into(),
            args: RpcValue::Unit,
            output_rank,
        }
    }

    #[test]
    fn auto_picks_the_gpu_only_when_one_is_usable_and_there_is_one_rank() {
        let device = |cls, tp| worker_device(cls, tp).map_err(|e| e.to_string());
        assert_eq!(device("cpu", 1), Ok(WorkerDevice::Cpu));
        // Tensor parallelism runs on CPU workers, whatever the machine has.
        assert_eq!(device("auto", 3), Ok(WorkerDevice::Cpu));
        if gpu_visible() {
            assert_eq!(device("gpu", 1), Ok(WorkerDevice::Gpu));
            assert_eq!(device("auto", 1), Ok(WorkerDevice::Gpu));
        } else {
            let err = device("gpu", 1).unwrap_err();
            assert!(
                err.contains("worker.cls") && err.contains("no CUDA GPU"),
                "{err}"
            );
            assert_eq!(device("auto", 1), Ok(WorkerDevice::Cpu));
        }
    }

    #[test]
    fn the_busy_loop_replies_failures_and_carries_on_until_shutdown() {
        let rpc = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
        let handle = rpc.export_handle();
        let response = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
        let response_handle = response.export_handle();
        // Rank 1 of a world of 2 with only its own queue: it reads the calls
        // as reader 0 of this one-reader broadcast queue.
        let worker_side = std::thread::spawn(move || {
            let rpc = MessageQueue::create_from_handle(&handle, 0).unwrap();
            busy_loop(1, &mut worker(), &WorkerMethods::builtin(), &rpc, &response)
        });
        let replies = MessageQueue::create_from_handle(&response_handle, 0).unwrap();
        rpc.wait_until_ready(Duration::from_secs(10)).unwrap();
        rpc.enqueue(&request("load_model", None), WAIT).unwrap();
        rpc.enqueue(&request("check_health", Some(0)), WAIT)
            .unwrap(); // not rank 1's to answer
        rpc.enqueue(&request("check_health", Some(1)), WAIT)
            .unwrap();
        match replies.dequeue::<RpcReply>(WAIT).unwrap() {
            RpcReply::Failure(message) => {
                assert!(message.contains("needs init_device"), "{message}")
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        assert_eq!(
            replies.dequeue::<RpcReply>(WAIT).unwrap(),
            RpcReply::Success(RpcValue::Unit)
        );
        rpc.shutdown();
        worker_side
            .join()
            .unwrap()
            .expect("a shut-down queue ends the loop normally");
        assert!(replies
            .dequeue::<RpcReply>(Some(Duration::from_millis(50)))
            .is_err());
    }
}
