//! `EngineCoreProc`: the engine core on its own threads (vLLM's
//! `EngineCoreProc`). The busy loop takes client messages, steps the core
//! while it has work and blocks on its input queue when it has none, so an
//! idle engine uses no CPU. An output thread hands each step's outputs to the
//! requests' streams, so that work overlaps the next step.
//!
//! Every client message goes through one ordered queue: an ABORT can never
//! overtake the ADD of the same request, and the loop reads every pending
//! message before each step, so an abort takes effect at the next step
//! boundary — the earliest the core can act on it anyway.

use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;

use serde_json::Value;

use super::core::{EngineCore, EngineCoreOutput, EngineCoreRequest, EngineError};
use super::shared::Shared;

/// A message from a client to the busy loop.
pub(crate) enum CoreInput {
    /// ADD: queue a request.
    Add(EngineCoreRequest),
    /// ABORT: drop requests by id.
    Abort(Vec<String>),
    /// UTILITY: call an engine method by name; the answer goes to `reply`.
    Utility {
        /// The method.
        method: String,
        /// Its arguments.
        args: Value,
        /// Where the result goes.
        reply: SyncSender<Result<Value, String>>,
    },
    /// Stop: finish the running requests first (`drain`) or abort them.
    Shutdown {
        /// Drain rather than abort.
        drain: bool,
    },
}

/// What the busy loop hands the output thread.
pub(crate) enum CoreOutput {
    /// One step's outputs.
    Step(Vec<EngineCoreOutput>),
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

/// Runs the busy loop until shutdown or a fatal error, then tells the
/// output thread (the engine-dead sentinel on an error).
pub(crate) fn run_busy_loop(mut core: EngineCore, inputs: Receiver<CoreInput>, outputs: Sender<CoreOutput>, shared: Arc<Shared>) {
    let mut stopping: Option<bool> = None;
    let result = loop {
        // Block while there is nothing to do: no spinning when idle.
        if !core.has_work() && stopping.is_none() {
            match inputs.recv() {
                Ok(msg) => handle(&mut core, msg, &outputs, &mut stopping),
                Err(_) => break Ok(()),
            }
        }
        while let Ok(msg) = inputs.try_recv() {
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
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| core.step()));
        match stepped.unwrap_or_else(|panic| Err(EngineError::Panic(panic_message(&*panic)))) {
            Ok(outs) => {
                shared.publish_stats(core.stats());
                if !outs.is_empty() && outputs.send(CoreOutput::Step(outs)).is_err() {
                    break Ok(());
                }
            }
            Err(e) => break Err(format!("{e:#}")),
        }
    };
    shared.publish_stats(core.stats());
    match result {
        Ok(()) => shared.mark_stopped(None),
        Err(reason) => {
            tracing::error!("engine core died: {reason}");
            shared.mark_stopped(Some(reason.clone()));
            let _ = outputs.send(CoreOutput::Dead(reason));
        }
    }
}

fn handle(core: &mut EngineCore, msg: CoreInput, outputs: &Sender<CoreOutput>, stopping: &mut Option<bool>) {
    match msg {
        CoreInput::Add(req) => {
            let request_id = req.request_id.clone();
            if let Err(e) = core.add_request(req) {
                let _ = outputs.send(CoreOutput::Rejected { request_id, reason: e.to_string() });
            }
        }
        CoreInput::Abort(ids) => core.abort_requests(&ids),
        CoreInput::Utility { method, args, reply } => {
            let _ = reply.send(core.call_utility(&method, args));
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

/// Hands outputs to the streams of their requests until the busy loop ends.
pub(crate) fn run_output_thread(outputs: Receiver<CoreOutput>, shared: Arc<Shared>) {
    for msg in outputs {
        match msg {
            CoreOutput::Step(outs) => shared.dispatch(outs),
            CoreOutput::Rejected { request_id, reason } => shared.reject(&request_id, reason),
            CoreOutput::Dead(reason) => shared.fail_all(&reason),
        }
    }
    // The loop ended without an error (shutdown): streams still open end.
    shared.close_all();
}
