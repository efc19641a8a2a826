//! Replacing a dead worker group. A worker process that dies (killed, out
//! of memory, a crash) takes its group's KV cache with it, but not the
//! requests: each is its prompt plus the tokens it already produced, so the
//! engine core treats the death as "every request was preempted". It drops
//! the steps in flight (their tokens were never reported), starts a new
//! group with the same configuration and KV cache size, and lets the
//! scheduler recompute every request where it stood. Streams carry on with
//! no token lost, repeated or reordered.
//!
//! Restarts are bounded by the [`RestartBudget`]; a group that dies again
//! while starting (a crash loop, a model that no longer loads) spends it,
//! and the engine then dies with the cause.

use std::time::{Duration, Instant};

use super::{EngineCore, EngineError};
use crate::config::RestartConfig;
use crate::engine::executor::{Executor, ExecutorError};
use crate::engine::restart::RestartBudget;

/// How long a failed step waits for the monitor to name a dead worker: a
/// step fails as soon as a peer notices (a closed queue, a tensor-parallel
/// rank whose all-reduce lost a peer) while the monitor polls every 100 ms.
const DEATH_CONFIRMATION: Duration = Duration::from_millis(500);

/// Starts a worker group in place of a dead one: the same configuration
/// and KV cache size, plugins loaded again.
pub type Respawn = Box<dyn FnMut() -> anyhow::Result<Respawned> + Send>;

/// A new worker group, ready to step, and what its start cost.
pub struct Respawned {
    /// The executor over the new workers.
    pub executor: Box<dyn Executor>,
    /// Seconds from spawning the processes to their READY, less the load.
    pub spawn_s: f64,
    /// Seconds the slowest worker took to load the model.
    pub load_s: f64,
    /// Seconds to size and allocate the KV cache, warm up and load plugins.
    pub init_s: f64,
}

/// The engine core's means and record of restarting its workers.
pub(super) struct WorkerRestart {
    respawn: Respawn,
    budget: RestartBudget,
    /// When the latest restart resumed stepping, until its first tokens.
    resumed: Option<Instant>,
    /// Restarts so far.
    pub(super) num_restarts: u64,
    /// Requests replayed by them.
    pub(super) num_replayed: u64,
    /// The latest method a client called on the workers: what it changed
    /// (new weights, an extension's state) a new group does not have.
    changed_by: Option<String>,
}

impl WorkerRestart {
    /// Records a client's `collective_rpc`, which may have changed the
    /// workers' state.
    pub(super) fn note_collective_rpc(&mut self, method: &str) {
        self.changed_by = Some(method.to_string());
    }

    /// Logs the recompute time once the first tokens after a restart are out.
    pub(super) fn note_outputs(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(resumed) = self.resumed.take() {
            tracing::warn!(
                "first tokens after the worker restart: recompute took {:.3} s",
                resumed.elapsed().as_secs_f64()
            );
        }
    }
}

impl EngineCore {
    /// Replaces a dead worker group through `respawn`, within `config`'s
    /// budget, instead of dying with it.
    pub fn with_worker_restart(mut self, respawn: Respawn, config: &RestartConfig) -> EngineCore {
        self.restart = Some(WorkerRestart {
            respawn,
            budget: RestartBudget::new(config),
            resumed: None,
            num_restarts: 0,
            num_replayed: 0,
            changed_by: None,
        });
        self
    }

    /// Recovers from `error` when it is a worker's death and a restart is
    /// configured and allowed; any other error, or a restart that fails, is
    /// returned (the engine is dead).
    pub fn recover(&mut self, error: EngineError) -> Result<(), EngineError> {
        if self.restart.is_none() {
            return Err(error);
        }
        let Some(first_death) = self.death_behind(&error) else {
            return Err(error);
        };
        let mut death = first_death.clone();
        let mut failed_starts = 0;
        loop {
            let restart = self.restart.as_mut().expect("checked above");
            let number = match restart.budget.take(Instant::now()) {
                Ok(n) => n,
                Err(refusal) => {
                    let crash_loop = if failed_starts > 0 {
                        format!(
                            "; crash loop: the last {failed_starts} restart(s) died while starting"
                        )
                    } else {
                        String::new()
                    };
                    return Err(EngineError::Restart(format!(
                        "{death}; {refusal}{crash_loop}"
                    )));
                }
            };
            let (max, window) = (restart.budget.max(), restart.budget.window().as_secs_f64());
            let replayed = self.scheduler.forget_worker_state();
            tracing::error!(
                "{death}; restarting the worker group (restart {number} of {max} within {window} s), \
                 {replayed} request(s) to replay"
            );
            match self.restart_workers() {
                Ok(()) => {
                    let restart = self.restart.as_mut().expect("checked above");
                    restart.num_restarts += 1;
                    restart.num_replayed += replayed as u64;
                    return Ok(());
                }
                Err(e) => {
                    tracing::error!("the new worker group failed to start: {e:#}");
                    failed_starts += 1;
                    death = format!(
                        "{first_death}; then the restarted worker group failed to start: {e:#}"
                    );
                }
            }
        }
    }

    /// The worker death behind a failed step or health check, if one is.
    /// A peer may notice before the monitor does, so a step that failed
    /// otherwise waits briefly for the monitor's word.
    fn death_behind(&self, error: &EngineError) -> Option<String> {
        let EngineError::Executor(e) = error else {
            return None;
        };
        if let ExecutorError::WorkerDied { .. } = e {
            return Some(e.to_string());
        }
        let deadline = Instant::now() + DEATH_CONFIRMATION;
        loop {
            if let Some(death) = self.executor.worker_death() {
                return Some(format!("{death} ({e})"));
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops what is left of the old group and starts a new one; the
    /// scheduler has already forgotten the old group's state.
    fn restart_workers(&mut self) -> anyhow::Result<()> {
        let t0 = Instant::now();
        // The steps in flight never report: their tokens were not streamed
        // and are sampled again after the recompute.
        self.in_flight.clear();
        self.executor.shutdown();
        let stopped_s = t0.elapsed().as_secs_f64();
        let restart = self.restart.as_mut().expect("only called with a restart");
        if let Some(method) = &restart.changed_by {
            tracing::warn!(
                "the new workers start from the configuration: what `collective_rpc` calls \
                 changed on the old ones (the latest: `{method}`) is not replayed"
            );
        }
        let new = (restart.respawn)()?;
        self.executor = new.executor;
        self.sleeping = false;
        restart.resumed = Some(Instant::now());
        tracing::warn!(
            "worker group restarted in {:.3} s: stopping the old group {stopped_s:.3} s, \
             respawn {:.3} s, model load {:.3} s, KV cache, warm-up and plugins {:.3} s",
            t0.elapsed().as_secs_f64(),
            new.spawn_s,
            new.load_s,
            new.init_s
        );
        Ok(())
    }
}
