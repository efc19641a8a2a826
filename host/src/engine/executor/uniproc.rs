//! `UniProcExecutor`: the one worker in the engine's own process (vLLM's
//! default for one device). Calls go through the same method registry as a
//! worker process's, so `uni` and `mp` run the very same code per method.

use std::time::Duration;

use super::{check_rank, Executor, ExecutorError, RpcFuture};
use crate::step::RpcValue;
use crate::worker::{Worker, WorkerConfig, WorkerError, WorkerMethods};

/// The worker in the engine's process.
pub struct UniProcExecutor {
    worker: Worker,
    methods: WorkerMethods,
}

impl UniProcExecutor {
    /// Wraps a worker with the built-in methods.
    pub fn new(worker: Worker) -> UniProcExecutor {
        UniProcExecutor {
            worker,
            methods: WorkerMethods::builtin(),
        }
    }

    /// Creates a worker, initialises its device and loads its model.
    pub fn start(config: WorkerConfig) -> Result<UniProcExecutor, Box<WorkerError>> {
        let mut worker = Worker::new(config)?;
        worker.init_device()?;
        worker.load_model()?;
        Ok(UniProcExecutor::new(worker))
    }

    /// The worker, for callers that drive the model runner directly
    /// (`host bench`).
    pub fn into_worker(self) -> Worker {
        self.worker
    }

    /// The method registry, to add worker-extension methods to.
    pub fn methods_mut(&mut self) -> &mut WorkerMethods {
        &mut self.methods
    }
}

impl Executor for UniProcExecutor {
    fn name(&self) -> &'static str {
        "uni"
    }

    fn world_size(&self) -> usize {
        1
    }

    fn execute_model_timeout(&self) -> Option<Duration> {
        None
    }

    fn collective_rpc(
        &mut self,
        method: &str,
        args: RpcValue,
        unique_reply_rank: Option<usize>,
        non_block: bool,
        _timeout: Option<Duration>,
    ) -> Result<RpcFuture, ExecutorError> {
        check_rank(unique_reply_rank, 1)?;
        let result = self
            .methods
            .call(&mut self.worker, method, args)
            .map(|v| vec![v])
            .map_err(|message| ExecutorError::Worker {
                rank: 0,
                method: method.to_string(),
                message,
            });
        match (non_block, result) {
            (false, Err(e)) => Err(e),
            (_, result) => Ok(RpcFuture::ready(result)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executor() -> UniProcExecutor {
        UniProcExecutor::new(Worker::new(WorkerConfig::for_unit_tests()).unwrap())
    }

    #[test]
    fn calls_reach_the_registry_and_errors_name_rank_and_method() {
        let mut ex = executor();
        assert_eq!(
            ex.call("check_health", RpcValue::Unit, Some(0), None)
                .unwrap(),
            vec![RpcValue::Unit]
        );
        let err = ex
            .call("load_model", RpcValue::Unit, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("worker rank 0: load_model failed") && err.contains("needs init_device"),
            "{err}"
        );
        let err = ex
            .call("check_health", RpcValue::Unit, Some(1), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unique_reply_rank 1 does not exist"), "{err}");
    }

    #[test]
    fn a_non_blocking_call_reports_its_error_from_the_future() {
        let mut ex = executor();
        let future = ex
            .collective_rpc("nope", RpcValue::Unit, None, true, None)
            .expect("sent");
        let err = future.result().unwrap_err().to_string();
        assert!(err.contains("unknown worker method `nope`"), "{err}");
    }
}
