//! The client's end of an engine-core process: starts it, writes client
//! messages to its input queue, and runs two threads — a reader that hands
//! outputs to the requests' streams, and a supervisor that reaps the
//! process and, when it dies unexpectedly, starts a new one and replays
//! every unfinished request there (`supervisor.rs`).
//!
//! One mutex, the [`Link`], orders what races with a restart: a request is
//! registered for replay and sent to the current process under it, and the
//! supervisor cuts the link and, later, takes the replay set and connects
//! the new process under it. So every request reaches each process once:
//! either it was registered before the replay set was taken (the replay
//! sends it) or after the new process was connected (it is sent there).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use super::launch::{self, Launcher};
use super::process::DeathPipe;
use super::supervisor::{self, Supervisor};
use super::{ClientMessage, EngineCoreRestarts};
use crate::config::EngineConfig;
use crate::engine::client::EngineCoreError;
use crate::engine::core::EngineCoreRequest;
use crate::engine::shared::{Shared, StreamItem};
use crate::message_queue::{MessageQueue, QueueError};

/// Callers waiting for utility answers, by call number.
pub(super) type Pending = Arc<Mutex<HashMap<u64, SyncSender<Result<Value, EngineCoreError>>>>>;

/// How long an aborting shutdown waits for the process before SIGKILL.
const ABORT_GRACE: Duration = Duration::from_secs(5);

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The way to the current engine-core process.
pub(super) struct Link {
    /// Its input queue and death pipe; `None` from its death until a new
    /// process is connected (sends then leave their request to the replay).
    pub conn: Option<Conn>,
    /// The current (or starting) process's id, on its own machine.
    pub pid: u32,
    /// Whether that process runs on this machine (only then may a
    /// shutdown signal it).
    pub local: bool,
    /// A shutdown was asked for: the next exit is expected, and nothing is
    /// restarted.
    pub shutting_down: bool,
}

/// A connected process's input queue and death pipe.
pub(super) struct Conn {
    /// The queue client messages go to.
    pub input: MessageQueue,
    /// Held for its drop: closing it tells the process its client is gone.
    pub _death_pipe: DeathPipe,
}

/// How many times the process was replaced, and requests replayed.
#[derive(Default)]
pub(super) struct Counts {
    /// Processes connected in place of a dead one.
    pub restarts: AtomicU64,
    /// Requests an earlier process had, resubmitted to a new one.
    pub replayed: AtomicU64,
}

/// A running engine-core process, replaced when it dies.
pub struct ProcessTransport {
    link: Arc<Mutex<Link>>,
    shared: Arc<Shared>,
    pending: Pending,
    next_call: AtomicU64,
    counts: Arc<Counts>,
    exited: Mutex<mpsc::Receiver<()>>,
    supervisor: Mutex<Option<JoinHandle<()>>>,
}

impl ProcessTransport {
    /// Starts `host engine-core` for `config` where `launcher` says and
    /// connects to it. Returns the transport, the state its streams live
    /// in, and the longest context a request may have.
    pub(crate) fn start(
        config: &EngineConfig,
        launcher: Launcher,
    ) -> anyhow::Result<(ProcessTransport, Arc<Shared>, usize)> {
        let launched = launch::spawn(config, &launcher)?.handshake()?;
        let max_model_len = launched.max_model_len;
        let shared = Arc::new(Shared::new(launched.stats));
        let pending: Pending = Arc::default();
        let reader = supervisor::spawn_reader(launched.output, &shared, &pending)?;
        let link = Arc::new(Mutex::new(Link {
            conn: Some(Conn {
                input: launched.input,
                _death_pipe: launched.death_pipe,
            }),
            pid: launched.process.id(),
            local: launched.process.is_local(),
            shutting_down: false,
        }));
        let counts = Arc::new(Counts::default());
        let (exited_tx, exited) = mpsc::channel();
        let supervisor = Supervisor {
            config: config.clone(),
            launcher,
            budget: crate::engine::restart::RestartBudget::new(&config.engine),
            link: Arc::clone(&link),
            shared: Arc::clone(&shared),
            pending: Arc::clone(&pending),
            counts: Arc::clone(&counts),
            exited: exited_tx,
        }
        .spawn(launched.process, reader)?;
        let transport = ProcessTransport {
            link,
            shared: Arc::clone(&shared),
            pending,
            next_call: AtomicU64::new(0),
            counts,
            exited: Mutex::new(exited),
            supervisor: Mutex::new(Some(supervisor)),
        };
        Ok((transport, shared, max_model_len))
    }

    /// The current engine-core process's id.
    pub(crate) fn pid(&self) -> u32 {
        lock(&self.link).pid
    }

    /// The restarts so far.
    pub(crate) fn restarts(&self) -> EngineCoreRestarts {
        EngineCoreRestarts {
            restarts: self.counts.restarts.load(Ordering::Relaxed),
            replayed_requests: self.counts.replayed.load(Ordering::Relaxed),
        }
    }

    /// Registers `req`'s stream (kept for a replay) and sends it; returns
    /// the client's id and the internal one. While the process is being
    /// replaced the request is only registered: the replay sends it.
    pub(crate) fn add(
        &self,
        mut req: EngineCoreRequest,
        tx: UnboundedSender<StreamItem>,
    ) -> Result<(String, String), EngineCoreError> {
        let link = lock(&self.link);
        let client_id = self
            .shared
            .register(&mut req, tx, Some(link.conn.is_some()))?;
        let internal_id = req.request_id.clone();
        let Some(conn) = &link.conn else {
            return Ok((client_id, internal_id));
        };
        match conn.input.enqueue(&ClientMessage::Add(Box::new(req)), None) {
            Ok(()) => Ok((client_id, internal_id)),
            // The process died: the supervisor replays the request.
            Err(e) if reader_died(&e) => Ok((client_id, internal_id)),
            Err(e) => {
                self.shared.unregister(&internal_id);
                Err(EngineCoreError::Dead(format!(
                    "the request could not be sent to the engine-core process: {e}"
                )))
            }
        }
    }

    /// Aborts requests (by internal id) in the current process; one being
    /// replaced has nothing to abort (the caller already unregistered them,
    /// so the replay leaves them out).
    pub(crate) fn abort(&self, internal_ids: Vec<String>) {
        if let Some(conn) = &lock(&self.link).conn {
            let _ = conn
                .input
                .enqueue(&ClientMessage::Abort(internal_ids), None);
        }
    }

    /// A utility call, answered through the output queue. Fails while the
    /// process is being replaced, and when it dies during the call.
    pub(crate) fn call_utility(
        &self,
        method: &str,
        args: &Value,
    ) -> Result<Value, EngineCoreError> {
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        let msg = ClientMessage::Utility {
            call_id,
            method: method.to_string(),
            args_json: args.to_string(),
        };
        {
            let link = lock(&self.link);
            let Some(conn) = &link.conn else {
                return Err(self.not_connected());
            };
            // Registered under the link, so the supervisor's failing of
            // every pending call at a death cannot miss this one.
            lock(&self.pending).insert(call_id, tx);
            if let Err(e) = conn.input.enqueue(&msg, None) {
                lock(&self.pending).remove(&call_id);
                return Err(EngineCoreError::Unavailable(format!(
                    "`{method}` could not be sent to the engine-core process: {e}"
                )));
            }
        }
        match rx.recv() {
            Ok(result) => result,
            // Dropped unanswered: the transport is going away.
            Err(_) => Err(self.not_connected()),
        }
    }

    /// Why nothing can be sent now: the engine stopped, or its process is
    /// being replaced.
    fn not_connected(&self) -> EngineCoreError {
        self.shared.liveness().stopped_error().unwrap_or_else(|| {
            EngineCoreError::Unavailable(
                "the engine-core process died and is being restarted; try again once it is back"
                    .into(),
            )
        })
    }

    /// Stops the process: asks it to drain or abort, waits for it (an
    /// aborting stop at most [`ABORT_GRACE`], then SIGKILL) and joins the
    /// client's threads. A process being started as a replacement is
    /// ended as soon as it is up.
    pub(crate) fn shutdown(&self, drain: bool) {
        {
            let mut link = lock(&self.link);
            link.shutting_down = true;
            if let Some(conn) = &link.conn {
                let _ = conn.input.enqueue(&ClientMessage::Shutdown { drain }, None);
            }
        }
        let exited = lock(&self.exited);
        // Disconnected: the supervisor is gone, the process reaped already.
        let done = if drain {
            let _ = exited.recv();
            true
        } else {
            !matches!(
                exited.recv_timeout(ABORT_GRACE),
                Err(RecvTimeoutError::Timeout)
            )
        };
        let (pid, local) = {
            let link = lock(&self.link);
            (link.pid, link.local)
        };
        if !done && !local {
            // Another machine's: closing its connection (below) makes that
            // machine stop it.
            tracing::warn!(pid, "the remote engine-core process did not stop in time");
        } else if !done {
            tracing::warn!(
                pid,
                "the engine-core process did not stop in time; killing it"
            );
            // SAFETY: kill(2) with a pid we started; the supervisor has
            // not reaped it (it reports that on `exited` first).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        lock(&self.link).conn.take();
        if let Some(t) = lock(&self.supervisor).take() {
            let _ = t.join();
        }
    }
}

impl Drop for ProcessTransport {
    fn drop(&mut self) {
        // Without a shutdown, closing the death pipe ends the process; the
        // supervisor takes that exit as asked for.
        let mut link = lock(&self.link);
        link.shutting_down = true;
        link.conn.take();
    }
}

/// Whether an enqueue failed because the process reading the queue died.
fn reader_died(e: &QueueError) -> bool {
    match e {
        QueueError::Full { behind, .. } => behind.iter().any(|l| !l.alive),
        // One on another machine, or its connection.
        QueueError::ConnectionLost { .. } => true,
        _ => false,
    }
}
