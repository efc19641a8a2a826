//! `EngineCoreProc`: the engine core on its own threads (vLLM's
//! `EngineCoreProc`). The busy loop takes client messages, steps the core
//! while it has work and blocks on its input queue when it has none, so an
//! idle engine uses no CPU (it wakes a few times a second only to check that
//! its workers live). An output thread takes each step's outputs off
//! the loop — to the requests' streams in this process, or encoded onto the
//! shared-memory queue to a client in another ([`super::ipc`]) — so that
//! work overlaps the next step.
//!
//! A step is sent to the workers, then the loop reads the ADDs and ABORTs
//! that arrived, then it waits for the step's tokens and applies them
//! ([`EngineCore::submit`], [`EngineCore::collect`]). Under async
//! scheduling (the default) the next step is scheduled and sent while the
//! previous one still runs, so the loop's own work hides behind the
//! forward pass.
//!
//! A step that fails because a worker died hands the error to
//! [`EngineCore::recover`], which replaces the worker group and replays
//! every request by recompute when `[engine]` allows it.
//!
//! Every client message goes through one ordered queue: an ABORT can never
//! overtake the ADD of the same request. The loop reads it before each step
//! and again while the step runs, so an abort takes effect before the
//! tokens of the step in flight are applied: what vLLM's separate abort
//! queue is for, without the reordering a second queue allows.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::time::Duration;

use serde_json::Value;

use super::core::{EngineCore, EngineCoreOutput, EngineCoreRequest, EngineError, EngineStats};
use super::shared::Shared;
use crate::kv_cache::KvCacheEvent;

/// How often an idle busy loop checks that its workers are alive: with the
/// worker monitor's own poll, a death is seen well within the second the
/// server promises for `/health`; five wake-ups a second cost nothing.
const IDLE_HEALTH_CHECK: Duration = Duration::from_millis(200);

/// A message from a client to the busy loop.
pub(crate) enum CoreInput {
    /// ADD: queue a request (boxed: a request is far larger than the
    /// other messages).
    Add(Box<EngineCoreRequest>),
    /// ABORT: drop requests by id.
    Abort(Vec<String>),
    /// UTILITY: call an engine method by name; the answer goes to `reply`.
    Utility {
        /// The method.
        method: String,
        /// Its arguments (or why they could not be read).
        args: Result<Value, String>,
        /// Where the result goes.
        reply: UtilityReply,
    },
    /// Stop: finish the running requests first (`drain`) or abort them.
    Shutdown {
        /// Drain rather than abort.
        drain: bool,
    },
}

/// Where a utility call's result goes.
pub(crate) enum UtilityReply {
    /// A caller in this process, waiting on the channel.
    Local(SyncSender<Result<Value, String>>),
    /// A client in another process, by its call number (the result travels
    /// with the outputs).
    Remote(u64),
}

/// What the busy loop hands the output thread.
pub(crate) enum CoreOutput {
    /// One step's outputs, the counters after it and the prefix cache's
    /// events for a data-parallel router.
    Step(Vec<EngineCoreOutput>, EngineStats, Vec<KvCacheEvent>),
    /// The result of a remote client's utility call.
    Utility {
        /// The client's call number.
        call_id: u64,
        /// The method's result or error.
        result: Result<Value, String>,
    },
    /// A request the scheduler refused, with the reason.
    Rejected {
        /// The request.
        request_id: String,
        /// Why.
        reason: String,
    },
    /// The engine died; the sentinel every live request receives.
    Dead(String),
}

/// Runs the busy loop until shutdown or a fatal error; on an error the last
/// message to the output thread is the engine-dead sentinel.
pub(crate) fn run_busy_loop(
    mut core: EngineCore,
    inputs: Receiver<CoreInput>,
    outputs: Sender<CoreOutput>,
) {
    let mut stopping: Option<bool> = None;
    // A message read mid-step that must wait for the step boundary.
    let mut deferred: Vec<CoreInput> = Vec::new();
    let result = loop {
        // Block while there is nothing to do: no spinning when idle. The
        // wait wakes every IDLE_HEALTH_CHECK to look at the workers, so an
        // idle engine whose worker died reports it (and `/health` turns
        // 503) without waiting for a request to fail.
        if !core.has_work() && stopping.is_none() && deferred.is_empty() {
            match inputs.recv_timeout(IDLE_HEALTH_CHECK) {
                Ok(msg) => handle(&mut core, msg, &outputs, &mut stopping),
                Err(RecvTimeoutError::Timeout) => {
                    match core.check_health().or_else(|e| core.recover(e)) {
                        Ok(()) => continue,
                        Err(e) => break Err(format!("{e:#}")),
                    }
                }
                Err(RecvTimeoutError::Disconnected) => break Ok(()),
            }
        }
        for msg in deferred.drain(..).chain(inputs.try_iter()) {
            handle(&mut core, msg, &outputs, &mut stopping);
        }
        match stopping {
            Some(false) => {
                core.abort_all();
                break Ok(());
            }
            Some(true) if !core.has_work() => break Ok(()),
            _ => {}
        }
        if !core.has_work() {
            continue;
        }
        // A panic inside a step (a bug, never user input) must still reach
        // the clients as the engine-dead sentinel rather than leave them
        // waiting on a thread that is gone.
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            core.submit()?;
            // While the workers run the step: requests that arrived meanwhile,
            // so that an abort takes effect before the tokens of the step in
            // flight are applied (vLLM's separate abort queue serves this).
            take_requests(&mut core, &inputs, &outputs, &mut deferred);
            core.collect()
        }));
        match stepped.unwrap_or_else(|panic| Err(EngineError::Panic(panic_message(&*panic)))) {
            Ok(outs) => {
                let step = CoreOutput::Step(outs, core.stats(), core.take_routed_events());
                if outputs.send(step).is_err() {
                    break Ok(());
                }
            }
            // A dead worker group is replaced and its requests replayed
            // when the configuration allows; anything else is fatal.
            Err(e) => match core.recover(e) {
                Ok(()) => {}
                Err(e) => break Err(format!("{e:#}")),
            },
        }
    };
    if let Err(reason) = result {
        tracing::error!("engine core died: {reason}");
        let _ = outputs.send(CoreOutput::Dead(reason));
    }
}

/// Takes the ADDs and ABORTs waiting on `inputs`, in order, while a step is
/// in flight; the first message of another kind (a utility call or a
/// shutdown, which belong between steps) is set aside in `deferred` and
/// ends the batch, so no message overtakes an earlier one.
fn take_requests(
    core: &mut EngineCore,
    inputs: &Receiver<CoreInput>,
    outputs: &Sender<CoreOutput>,
    deferred: &mut Vec<CoreInput>,
) {
    if !deferred.is_empty() {
        return;
    }
    while let Ok(msg) = inputs.try_recv() {
        match msg {
            CoreInput::Add(_) | CoreInput::Abort(_) => handle(core, msg, outputs, &mut None),
            other => {
                deferred.push(other);
                return;
            }
        }
    }
}

fn handle(
    core: &mut EngineCore,
    msg: CoreInput,
    outputs: &Sender<CoreOutput>,
    stopping: &mut Option<bool>,
) {
    match msg {
        CoreInput::Add(req) => {
            let request_id = req.request_id.clone();
            if let Err(e) = core.add_request(*req) {
                let _ = outputs.send(CoreOutput::Rejected {
                    request_id,
                    reason: e.to_string(),
                });
            }
        }
        CoreInput::Abort(ids) => core.abort_requests(&ids),
        CoreInput::Utility {
            method,
            args,
            reply,
        } => {
            let result = args.and_then(|args| core.call_utility(&method, args));
            match reply {
                UtilityReply::Local(tx) => {
                    let _ = tx.send(result);
                }
                UtilityReply::Remote(call_id) => {
                    let _ = outputs.send(CoreOutput::Utility { call_id, result });
                }
            }
        }
        CoreInput::Shutdown { drain } => *stopping = Some(drain && stopping.unwrap_or(true)),
    }
}

/// The text a panic carried.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".into(),
    }
}

/// Hands outputs to the streams of their requests (in this process) until
/// the busy loop ends, then marks the engine stopped or dead.
pub(crate) fn run_output_thread(outputs: Receiver<CoreOutput>, shared: &Shared) {
    let mut died = None;
    for msg in outputs {
        match msg {
            CoreOutput::Step(outs, stats, events) => {
                shared.publish_stats(stats);
                shared.record_kv_events(events);
                shared.dispatch(outs);
            }
            CoreOutput::Rejected { request_id, reason } => shared.reject(&request_id, reason),
            CoreOutput::Dead(reason) => died = Some(reason),
            // Local callers are answered by the busy loop directly.
            CoreOutput::Utility { .. } => {}
        }
    }
    shared.stop(died);
}
