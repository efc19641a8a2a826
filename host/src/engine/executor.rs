//! Executors: how the engine core reaches its workers. `uni` runs the one
//! worker in the engine's own process (vLLM's `UniProcExecutor`, the default
//! for one device). The backend is chosen by name from the config.

use thiserror::Error;

use crate::config::EXECUTOR_BACKENDS;
use crate::scheduler::SchedulerOutput;
use crate::worker::{ModelRunnerOutput, Worker, WorkerError};

/// A failure of the executor or a worker; the engine cannot go on after it.
#[derive(Debug, Error)]
pub enum ExecutorError {
    /// The configured backend does not exist.
    #[error("unknown executor backend `{0}`; known backends: {known}", known = EXECUTOR_BACKENDS.join(", "))]
    UnknownBackend(String),
    /// A worker method failed.
    #[error("worker (rank {rank}): {source}")]
    Worker {
        /// The worker's rank.
        rank: usize,
        /// What it reported.
        source: WorkerError,
    },
}

/// Drives the workers for the engine core, one step at a time.
pub trait Executor: Send {
    /// The backend's name (`uni`, …).
    fn name(&self) -> &'static str;

    /// Runs the step `so` describes on every worker and returns the tokens
    /// sampled for the requests that reached the end of their known tokens
    /// (vLLM's `execute_model` followed by `sample_tokens`).
    fn execute_model(&mut self, so: &SchedulerOutput) -> Result<ModelRunnerOutput, ExecutorError>;
}

/// The worker in the engine's process.
pub struct UniProcExecutor {
    worker: Worker,
}

impl UniProcExecutor {
    /// Wraps a started worker (its KV cache allocated).
    pub fn new(worker: Worker) -> UniProcExecutor {
        UniProcExecutor { worker }
    }
}

impl Executor for UniProcExecutor {
    fn name(&self) -> &'static str {
        "uni"
    }

    fn execute_model(&mut self, so: &SchedulerOutput) -> Result<ModelRunnerOutput, ExecutorError> {
        let wrap = |source| ExecutorError::Worker { rank: 0, source };
        self.worker.execute_model(so).map_err(wrap)?;
        self.worker.sample_tokens().map_err(wrap)
    }
}

/// The executor `backend` names, over a started worker.
pub fn executor_for(backend: &str, worker: Worker) -> Result<Box<dyn Executor>, ExecutorError> {
    match backend {
        "uni" => Ok(Box::new(UniProcExecutor::new(worker))),
        other => Err(ExecutorError::UnknownBackend(other.to_string())),
    }
}
