//! Executors: how the engine core reaches its workers (vLLM's `Executor`).
//! `uni` runs the one worker in the engine's own process
//! ([`UniProcExecutor`]); `mp` runs one worker process per rank and talks to
//! them over shared-memory queues ([`MultiprocExecutor`]), or over TCP for
//! the ranks on other machines of a multi-node group (`nodes`, and
//! `headless` for the other machines' side). The backend is chosen by name
//! from the config.
//!
//! Every call to a worker goes through [`Executor::collective_rpc`]: the
//! method is named, runs on every rank, and one rank (or all) replies. The
//! step itself (`execute_model`, then `sample_tokens`) is two such calls.

use std::time::Duration;

use thiserror::Error;

use crate::config::{EngineConfig, EXECUTOR_BACKENDS};
use crate::message_queue::QueueError;
use crate::step::{ModelRunnerOutput, RpcValue, SchedulerOutput};

mod headless;
mod monitor;
mod multiproc;
mod nodes;
mod rpc;
mod uniproc;

pub use headless::run as run_headless_node;
pub(crate) use multiproc::worker_executable;
pub use multiproc::MultiprocExecutor;
pub use rpc::RpcFuture;
pub use uniproc::UniProcExecutor;

/// A failure of the executor or a worker. A method error leaves the
/// executor usable; the others mean the engine cannot go on.
#[derive(Debug, Error)]
pub enum ExecutorError {
    /// The configured backend does not exist.
    #[error("unknown executor backend `{0}`; known backends: {known}", known = EXECUTOR_BACKENDS.join(", "))]
    UnknownBackend(String),
    /// A worker method failed; the worker carries on.
    #[error("worker rank {rank}: {method} failed: {message}")]
    Worker {
        /// The rank that replied with the failure.
        rank: usize,
        /// The method called.
        method: String,
        /// The worker's error message.
        message: String,
    },
    /// A worker process exited.
    #[error("worker rank {rank} (pid {pid}) died: {status}")]
    WorkerDied {
        /// Its rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it ended (exit status or signal).
        status: String,
    },
    /// No reply arrived in time.
    #[error("collective_rpc `{method}` timed out after {waited:?} waiting for worker rank {rank}; the worker is alive but did not answer (raise the timeout if the call is legitimately slow)")]
    Timeout {
        /// The method called.
        method: String,
        /// The rank whose reply was missing.
        rank: usize,
        /// How long the call waited.
        waited: Duration,
    },
    /// A worker process could not be started.
    #[error("worker rank {rank} failed to start: {message}")]
    Start {
        /// Its rank.
        rank: usize,
        /// Why.
        message: String,
    },
    /// The call itself is malformed (a rank that does not exist, a reply
    /// of the wrong shape).
    #[error("collective_rpc: {0}")]
    Call(String),
    /// A message queue failed.
    #[error("{what}: {source}")]
    Queue {
        /// What the executor was doing.
        what: String,
        /// The queue's error.
        source: QueueError,
    },
}

/// Drives the workers for the engine core.
pub trait Executor: Send {
    /// The backend's name (`uni`, `mp`).
    fn name(&self) -> &'static str;

    /// Number of workers (ranks).
    fn world_size(&self) -> usize;

    /// The rank whose reply carries a step's output.
    fn output_rank(&self) -> usize {
        0
    }

    /// The deadline for one step's calls (`None`: wait while the workers live).
    fn execute_model_timeout(&self) -> Option<Duration>;

    /// The recorded death of a worker, if one died: what an idle engine
    /// core checks between steps, so it notices without a call failing
    /// first. In-process workers cannot die on their own.
    fn worker_death(&self) -> Option<ExecutorError> {
        None
    }

    /// Stops the workers now (they may be dead already), so a new group
    /// can take their place; the executor answers no call after it.
    /// In-process workers stop when the executor is dropped.
    fn shutdown(&mut self) {}

    /// Calls `method` with `args` on every worker (vLLM's `collective_rpc`).
    /// Only `unique_reply_rank` replies, or every rank when it is `None`;
    /// the future's result holds the replies in rank order. With `non_block`
    /// the call returns as soon as it is sent; otherwise it has waited and
    /// the future is already resolved (an error is returned directly).
    /// Futures resolve in call order: a later future's result first drains
    /// the replies of the earlier ones. `timeout` bounds the wait for
    /// replies (in-process workers cannot be interrupted and ignore it).
    fn collective_rpc(
        &mut self,
        method: &str,
        args: RpcValue,
        unique_reply_rank: Option<usize>,
        non_block: bool,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture, ExecutorError>;

    /// A blocking [`Executor::collective_rpc`]: the replies in rank order.
    fn call(
        &mut self,
        method: &str,
        args: RpcValue,
        unique_reply_rank: Option<usize>,
        timeout: Option<Duration>,
    ) -> Result<Vec<RpcValue>, ExecutorError> {
        self.collective_rpc(method, args, unique_reply_rank, false, timeout)?
            .result()
    }

    /// Sends the step `so` describes to every worker (vLLM's
    /// `execute_model` followed by `sample_tokens`, both sent before either
    /// reply is awaited) and returns at once; [`StepFuture::wait`] returns
    /// the tokens sampled for the requests that reached the end of their
    /// known tokens. Workers run steps in the order they were sent, so the
    /// engine can schedule the next step while this one runs (async
    /// scheduling); an in-process worker has run it before this returns.
    fn submit_step(&mut self, so: &SchedulerOutput) -> Result<StepFuture, ExecutorError> {
        let rank = Some(self.output_rank());
        let timeout = self.execute_model_timeout();
        let step = RpcValue::SchedulerOutput(Box::new(so.clone()));
        let executed = self.collective_rpc("execute_model", step, rank, true, timeout)?;
        let sampled = self.collective_rpc("sample_tokens", RpcValue::Unit, rank, true, timeout)?;
        Ok(StepFuture { executed, sampled })
    }

    /// [`Executor::submit_step`] and wait: one step, one round trip.
    fn execute_model(&mut self, so: &SchedulerOutput) -> Result<ModelRunnerOutput, ExecutorError> {
        self.submit_step(so)?.wait()
    }
}

/// A step sent to the workers whose output has not been read yet.
#[must_use = "a step's output must be waited for"]
pub struct StepFuture {
    executed: RpcFuture,
    sampled: RpcFuture,
}

impl StepFuture {
    /// Waits for the step and returns what the output rank sampled.
    pub fn wait(self) -> Result<ModelRunnerOutput, ExecutorError> {
        self.executed.result()?;
        let mut replies = self.sampled.result()?;
        let reply = replies
            .pop()
            .ok_or_else(|| ExecutorError::Call("sample_tokens returned no reply".into()))?;
        reply
            .into_model_runner_output("sample_tokens")
            .map_err(ExecutorError::Call)
    }
}

/// Starts the executor the config's `parallel.distributed_executor_backend`
/// names, with its workers initialised and their models loaded (the KV
/// cache is sized and allocated afterwards, through calls).
pub fn executor_for(
    config: &EngineConfig,
    eos_token_id: Option<u32>,
) -> anyhow::Result<Box<dyn Executor>> {
    match config.parallel.distributed_executor_backend.as_str() {
        "uni" => {
            let worker_config = crate::worker::proc::worker_config(config, eos_token_id)?;
            let mut executor = UniProcExecutor::start(worker_config)?;
            executor.methods_mut().register_extensions(config)?;
            Ok(Box::new(executor))
        }
        "mp" => {
            let world_size = config.parallel.tensor_parallel_size;
            Ok(Box::new(MultiprocExecutor::start(
                config,
                eos_token_id,
                world_size,
            )?))
        }
        other => Err(ExecutorError::UnknownBackend(other.to_string()).into()),
    }
}

/// Checks `unique_reply_rank` against the world size.
fn check_rank(unique_reply_rank: Option<usize>, world_size: usize) -> Result<(), ExecutorError> {
    match unique_reply_rank {
        Some(r) if r >= world_size => Err(ExecutorError::Call(format!(
            "unique_reply_rank {r} does not exist; the ranks are 0..{world_size}"
        ))),
        _ => Ok(()),
    }
}
