//! The engine-core process (the hidden `host engine-core` command): the
//! busy loop and its output thread of [`crate::engine`], with an input
//! thread that decodes the client's messages from the shared-memory queue
//! and an output loop that encodes the outputs onto the other.

use std::io::Write;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Duration;

use anyhow::Context;

use super::{Bootstrap, ClientMessage, CoreMessage, Ready};
use crate::config::EngineConfig;
use crate::engine::core_proc::{run_busy_loop, CoreInput, CoreOutput, UtilityReply};
use crate::engine::startup::build_engine_core;
use crate::message_queue::{MessageQueue, QueueConfig, QueueError};
use crate::worker::proc::bootstrap_from_parent;

/// How long the client has to attach to the output queue after READY.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the engine-core process until the client shuts it down (exit 0) or
/// the engine dies (exit 1, after the engine-dead sentinel went out).
pub fn run() -> anyhow::Result<()> {
    let boot: Bootstrap = bootstrap_from_parent("host engine-core", "the engine client")?;
    let started = start(&boot);
    let ready = match &started {
        Ok((core, output, _)) => Ready::Ready {
            output_handle: output.export_handle(),
            max_model_len: core.scheduler().config().max_model_len as usize,
            stats: core.stats(),
        },
        Err(e) => Ready::Failed(format!("{e:#}")),
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", serde_json::to_string(&ready)?)?;
    stdout.flush()?;
    drop(stdout);
    let (core, output, input) = started?;
    output
        .wait_until_ready(ATTACH_TIMEOUT)
        .context("waiting for the client to attach to the output queue")?;

    let (input_tx, input_rx) = mpsc::channel();
    let (output_tx, output_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("engine-input".into())
        .spawn(move || forward_inputs(&input, &input_tx))?;
    std::thread::Builder::new()
        .name("engine-core".into())
        .spawn(move || run_busy_loop(core, input_rx, output_tx))?;
    if let Some(reason) = send_outputs(&output_rx, &output)? {
        anyhow::bail!("the engine core died: {reason}");
    }
    Ok(())
}

/// The engine core, its output queue (writer) and the client's input queue
/// (reader).
fn start(
    boot: &Bootstrap,
) -> anyhow::Result<(crate::engine::EngineCore, MessageQueue, MessageQueue)> {
    let config: EngineConfig =
        toml::from_str(&boot.config_toml).context("the bootstrap's configuration")?;
    // The API server detokenizes; the engine core needed the tokenizer
    // only to start.
    let (mut core, tokenizer) = build_engine_core(&config)?;
    drop(tokenizer);
    // Start-up freed the GGUF's parsed metadata, the tokenizer and the
    // repacking scratch; give their pages back for the process's life.
    crate::model::release_freed_heap();
    if config.parallel.data_parallel_size > 1 {
        // The API server routes by what each rank's prefix cache holds.
        core = core.with_routed_kv_events();
    }
    let output = match &boot.output_bind {
        Some(bind) => MessageQueue::new_writer_with_remote(1, &[0], bind, QueueConfig::default())
            .with_context(|| format!("listening for the client on {bind}"))?,
        None => MessageQueue::new_writer(1, QueueConfig::default())?,
    };
    let input = MessageQueue::create_from_handle(&boot.input_handle, 0)
        .context("attaching to the client's queue")?;
    Ok((core, output, input))
}

/// The input thread: decodes client messages onto the busy loop's queue
/// until the client shuts the queue down or goes away.
fn forward_inputs(input: &MessageQueue, to_core: &Sender<CoreInput>) {
    loop {
        let msg = match input.dequeue::<ClientMessage>(None) {
            Ok(msg) => msg,
            // The client is gone (on another machine: its connection is).
            Err(e) if e.other_end_gone() => return,
            Err(e) => {
                // A frame that does not decode is refused, not guessed at;
                // the engine carries on with the next one.
                tracing::error!("engine core: dropped an undecodable client message: {e}");
                continue;
            }
        };
        let msg = match msg {
            ClientMessage::Add(req) => CoreInput::Add(req),
            ClientMessage::Abort(ids) => CoreInput::Abort(ids),
            ClientMessage::Shutdown { drain } => CoreInput::Shutdown { drain },
            ClientMessage::Utility {
                call_id,
                method,
                args_json,
            } => {
                let args = serde_json::from_str(&args_json)
                    .map_err(|e| format!("the arguments of `{method}` are not JSON: {e}"));
                CoreInput::Utility {
                    method,
                    args,
                    reply: UtilityReply::Remote(call_id),
                }
            }
        };
        if to_core.send(msg).is_err() {
            return;
        }
    }
}

/// The output loop: encodes the busy loop's outputs onto the output queue
/// until the loop ends; the reason if it died.
fn send_outputs(
    from_core: &Receiver<CoreOutput>,
    output: &MessageQueue,
) -> anyhow::Result<Option<String>> {
    let mut died = None;
    for msg in from_core {
        let msg = match msg {
            CoreOutput::Step(outs, stats, events) => {
                CoreMessage::Step(outs, Box::new(stats), events)
            }
            CoreOutput::Rejected { request_id, reason } => {
                CoreMessage::Rejected { request_id, reason }
            }
            CoreOutput::Utility { call_id, result } => CoreMessage::Utility {
                call_id,
                result: result.map(|v| v.to_string()),
            },
            CoreOutput::Dead(reason) => {
                died = Some(reason.clone());
                CoreMessage::Dead(reason)
            }
        };
        match output.enqueue(&msg, None) {
            Ok(()) => {}
            // The client is gone: nobody is left to tell.
            Err(QueueError::Shutdown) => break,
            Err(e) => return Err(e).context("sending outputs to the client"),
        }
    }
    Ok(died)
}
