//! The client's end of an engine-core process: starts it, writes client
//! messages to its input queue, and runs two threads — a reader that hands
//! outputs to the requests' streams, and a watcher that reaps the process
//! and turns an unexpected exit into the engine-dead sentinel.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

use super::{Bootstrap, ClientMessage, CoreMessage, Ready};
use crate::config::EngineConfig;
use crate::engine::client::EngineCoreError;
use crate::engine::executor::worker_executable;
use crate::engine::shared::Shared;
use crate::message_queue::{MessageQueue, QueueConfig, QueueError};

/// Callers waiting for utility answers, by call number.
type Pending = Arc<Mutex<HashMap<u64, SyncSender<Result<Value, String>>>>>;

/// How long an aborting shutdown waits for the process before SIGKILL.
const ABORT_GRACE: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running engine-core process.
pub struct ProcessTransport {
    input: Mutex<MessageQueue>,
    pending: Pending,
    next_call: AtomicU64,
    pid: u32,
    /// Closing it tells the process its client is gone.
    death_pipe: Mutex<Option<ChildStdin>>,
    shutting_down: Arc<AtomicBool>,
    exited: Mutex<mpsc::Receiver<()>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl ProcessTransport {
    /// Starts `host engine-core` for `config` and connects to it. Returns
    /// the transport, the state its streams live in, and the longest
    /// context a request may have.
    pub(crate) fn start(
        config: &EngineConfig,
    ) -> anyhow::Result<(ProcessTransport, Arc<Shared>, usize)> {
        let exe = worker_executable(config.parallel.worker_executable.as_deref())?;
        let input = MessageQueue::new_writer(1, QueueConfig::default())?;
        let boot = Bootstrap {
            config_toml: config.to_toml(),
            input_handle: input.export_handle(),
        };
        let mut child = Command::new(&exe)
            .arg("engine-core")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot run {} engine-core", exe.display()))?;
        let (mut stdin, stdout) = (
            child.stdin.take().expect("piped"),
            child.stdout.take().expect("piped"),
        );
        writeln!(stdin, "{}", serde_json::to_string(&boot)?)?;
        stdin.flush()?;
        // The process loads the model before it answers; it exits if that fails.
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let ready = match serde_json::from_str::<Ready>(&line) {
            Ok(Ready::Ready {
                output_handle,
                max_model_len,
                stats,
            }) => (output_handle, max_model_len, stats),
            Ok(Ready::Failed(reason)) => {
                let _ = child.wait();
                bail!("the engine-core process failed to start: {reason}");
            }
            Err(_) => {
                let status = child.wait()?;
                bail!("the engine-core process exited before it was ready ({status}); its stderr says why");
            }
        };
        let (output_handle, max_model_len, stats) = ready;
        let output = MessageQueue::create_from_handle(&output_handle, 0)?;
        input
            .wait_until_ready(Duration::from_secs(60))
            .context("waiting for the engine core to attach")?;

        let shared = Arc::new(Shared::new(stats));
        let pending: Pending = Arc::default();
        let shutting_down = Arc::new(AtomicBool::new(false));
        let (exited_tx, exited) = mpsc::channel();
        let pid = child.id();
        let reader = {
            let (shared, pending) = (Arc::clone(&shared), Arc::clone(&pending));
            std::thread::Builder::new()
                .name("engine-client-reader".into())
                .spawn(move || read_outputs(&output, &shared, &pending))?
        };
        let watcher = {
            let (shared, pending, shutting_down) = (
                Arc::clone(&shared),
                Arc::clone(&pending),
                Arc::clone(&shutting_down),
            );
            std::thread::Builder::new()
                .name("engine-client-watcher".into())
                .spawn(move || {
                    let status = child.wait();
                    let expected = shutting_down.load(Ordering::SeqCst)
                        && status.as_ref().is_ok_and(|s| s.success());
                    let reason = match status {
                        Ok(s) => format!("the engine-core process (pid {pid}) exited: {s}"),
                        Err(e) => format!(
                            "the engine-core process (pid {pid}) could not be waited for: {e}"
                        ),
                    };
                    shared.stop((!expected).then_some(reason));
                    lock(&pending).clear();
                    let _ = exited_tx.send(());
                })?
        };
        let transport = ProcessTransport {
            input: Mutex::new(input),
            pending,
            next_call: AtomicU64::new(0),
            pid,
            death_pipe: Mutex::new(Some(stdin)),
            shutting_down,
            exited: Mutex::new(exited),
            threads: Mutex::new(vec![reader, watcher]),
        };
        Ok((transport, shared, max_model_len))
    }

    /// The engine-core process's id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Writes a message to the engine core.
    pub(crate) fn send(&self, msg: &ClientMessage) -> Result<(), QueueError> {
        lock(&self.input).enqueue(msg, None)
    }

    /// A utility call, answered through the output queue.
    pub(crate) fn call_utility(
        &self,
        method: &str,
        args: &Value,
    ) -> Result<Value, EngineCoreError> {
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        lock(&self.pending).insert(call_id, tx);
        let msg = ClientMessage::Utility {
            call_id,
            method: method.to_string(),
            args_json: args.to_string(),
        };
        let dead = || EngineCoreError::Dead("the engine-core process is gone".into());
        if self.send(&msg).is_err() {
            lock(&self.pending).remove(&call_id);
            return Err(dead());
        }
        match rx.recv() {
            Ok(result) => result.map_err(EngineCoreError::Utility),
            // The watcher dropped the waiting callers: the process died.
            Err(_) => Err(dead()),
        }
    }

    /// Stops the process: asks it to drain or abort, waits for it (an
    /// aborting stop at most [`ABORT_GRACE`], then SIGKILL) and joins the
    /// client's threads.
    pub(crate) fn shutdown(&self, drain: bool) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let _ = self.send(&ClientMessage::Shutdown { drain });
        let exited = lock(&self.exited);
        let done = if drain {
            exited.recv().is_ok()
        } else {
            exited.recv_timeout(ABORT_GRACE).is_ok()
        };
        if !done {
            tracing::warn!(
                pid = self.pid,
                "the engine-core process did not stop in time; killing it"
            );
            // SAFETY: kill(2) with a pid we started and have not reaped.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
        }
        lock(&self.death_pipe).take();
        lock(&self.input).shutdown();
        for t in std::mem::take(&mut *lock(&self.threads)) {
            let _ = t.join();
        }
    }
}

impl Drop for ProcessTransport {
    fn drop(&mut self) {
        // Without a shutdown, closing the death pipe ends the process.
        lock(&self.death_pipe).take();
    }
}

/// The reader thread: outputs to streams, answers to utility callers, until
/// the engine core stops writing.
fn read_outputs(output: &MessageQueue, shared: &Shared, pending: &Pending) {
    loop {
        match output.dequeue::<CoreMessage>(None) {
            Ok(CoreMessage::Step(outs, stats)) => {
                shared.publish_stats(stats);
                shared.dispatch(outs);
            }
            Ok(CoreMessage::Rejected { request_id, reason }) => shared.reject(&request_id, reason),
            Ok(CoreMessage::Utility { call_id, result }) => {
                let result = result.and_then(|text| {
                    serde_json::from_str(&text)
                        .map_err(|e| format!("the engine core answered with invalid JSON: {e}"))
                });
                if let Some(tx) = lock(pending).remove(&call_id) {
                    let _ = tx.send(result);
                }
            }
            Ok(CoreMessage::Dead(reason)) => {
                shared.stop(Some(reason));
                return;
            }
            // The process ended; the watcher reports how.
            Err(QueueError::Shutdown | QueueError::WriterDead { .. }) => return,
            Err(e) => {
                shared.stop(Some(format!(
                    "a message from the engine core could not be read: {e}"
                )));
                return;
            }
        }
    }
}
