//! `EngineCoreClient`: how a frontend (the HTTP server, tests) talks to an
//! engine core running on its own threads in this process, or in its own
//! process over shared-memory queues (vLLM's `InprocClient` / `MPClient`
//! over an `EngineCoreProc`). Requests go in as messages;
//! each request's outputs come back on its own stream, which works from
//! async and blocking code alike. Dropping a stream before its request
//! finished aborts the request, so a client that goes away frees its KV
//! blocks without any extra bookkeeping.

use std::sync::mpsc::{self as std_mpsc, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde_json::Value;
use thiserror::Error;
use tokio::sync::mpsc;

use super::core::{EngineCoreOutput, EngineCoreRequest, EngineStats};
use super::core_proc::{run_busy_loop, run_output_thread, CoreInput, UtilityReply};
use super::ipc::{EngineCoreRestarts, ProcessTransport};
use super::shared::{Liveness, Shared, StreamItem};
use super::startup;
use crate::config::EngineConfig;
use crate::tokenizer::Tokenizer;

/// Why a request or call got no answer from the engine core.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum EngineCoreError {
    /// The scheduler refused the request (e.g. it can never fit the KV
    /// cache); the engine carries on.
    #[error("request refused: {0}")]
    Rejected(String),
    /// The engine is dead or shut down; nothing more will run.
    #[error("the engine is not running: {0}")]
    Dead(String),
    /// A utility call failed; the engine carries on.
    #[error("{0}")]
    Utility(String),
    /// The engine core cannot answer now: its process died while the call
    /// ran, or is being replaced. The engine carries on; retry shortly.
    #[error("{0}")]
    Unavailable(String),
}

/// A handle on a running engine core; cheap to clone, usable from any
/// thread.
#[derive(Clone)]
pub struct EngineCoreClient {
    inner: Arc<Inner>,
}

struct Inner {
    transport: Transport,
    shared: Arc<Shared>,
    max_model_len: usize,
}

/// How messages reach the engine core.
// One value per client, held behind its `Arc`: the size difference between
// the variants costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Transport {
    /// Its threads in this process.
    InProcess {
        input: Sender<CoreInput>,
        threads: Mutex<Vec<JoinHandle<()>>>,
    },
    /// Its own process.
    Process(ProcessTransport),
}

impl EngineCoreClient {
    /// Loads the model and starts the engine core on its own threads (the
    /// busy loop and the output thread) in this process. Returns the client
    /// and the tokenizer the frontend needs.
    pub fn start_in_process(
        config: &EngineConfig,
    ) -> anyhow::Result<(EngineCoreClient, Tokenizer)> {
        let (core, tokenizer) = startup::build_engine_core(config)?;
        let max_model_len = core.scheduler().config().max_model_len as usize;
        let shared = Arc::new(Shared::new(core.stats()));
        let (input_tx, input_rx) = std_mpsc::channel();
        let (output_tx, output_rx) = std_mpsc::channel();
        let busy = std::thread::Builder::new()
            .name("engine-core".into())
            .spawn(move || run_busy_loop(core, input_rx, output_tx))?;
        let output = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("engine-output".into())
                .spawn(move || run_output_thread(output_rx, &shared))?
        };
        let transport = Transport::InProcess {
            input: input_tx,
            threads: Mutex::new(vec![busy, output]),
        };
        let inner = Inner {
            transport,
            shared,
            max_model_len,
        };
        Ok((
            EngineCoreClient {
                inner: Arc::new(inner),
            },
            tokenizer,
        ))
    }

    /// Starts the engine core in its own process (the hidden `host
    /// engine-core` command, which loads the model) and connects to it over
    /// shared memory. A crash of that process is survived: a new one is
    /// started and every unfinished request replayed there, streams staying
    /// open, within `[engine]`'s restart budget; past it every stream ends
    /// with [`EngineCoreError::Dead`], naming the exit status.
    pub fn start_process(config: &EngineConfig) -> anyhow::Result<(EngineCoreClient, Tokenizer)> {
        let tokenizer = startup::load_tokenizer(config)?;
        let (transport, shared, max_model_len) = ProcessTransport::start(config)?;
        let inner = Inner {
            transport: Transport::Process(transport),
            shared,
            max_model_len,
        };
        Ok((
            EngineCoreClient {
                inner: Arc::new(inner),
            },
            tokenizer,
        ))
    }

    /// Queues a request; its outputs arrive on the returned stream. An id
    /// that is already live is refused.
    pub fn add_request(&self, mut req: EngineCoreRequest) -> Result<OutputStream, EngineCoreError> {
        self.check_alive()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (request_id, internal_id) = match &self.inner.transport {
            Transport::InProcess { input, .. } => {
                let request_id = self.inner.shared.register(&mut req, tx, None)?;
                let internal_id = req.request_id.clone();
                if input.send(CoreInput::Add(Box::new(req))).is_err() {
                    self.inner.shared.unregister(&internal_id);
                    return Err(self.dead_error());
                }
                (request_id, internal_id)
            }
            Transport::Process(p) => p.add(req, tx)?,
        };
        Ok(OutputStream {
            request_id,
            internal_id,
            rx,
            client: self.clone(),
            finished: false,
        })
    }

    /// Aborts requests by id; unknown or finished ids are ignored.
    pub fn abort_requests(&self, request_ids: Vec<String>) {
        let internal = self.inner.shared.unregister_client_ids(&request_ids);
        self.abort_internal(internal);
    }

    fn abort_internal(&self, internal_ids: Vec<String>) {
        if internal_ids.is_empty() {
            return;
        }
        match &self.inner.transport {
            // A dead engine has nothing left to abort.
            Transport::InProcess { input, .. } => {
                let _ = input.send(CoreInput::Abort(internal_ids));
            }
            Transport::Process(p) => p.abort(internal_ids),
        }
    }

    /// The engine-core process's id, when it runs in its own process: after
    /// a death, its replacement's as soon as that is spawned.
    pub fn process_id(&self) -> Option<u32> {
        match &self.inner.transport {
            Transport::InProcess { .. } => None,
            Transport::Process(p) => Some(p.pid()),
        }
    }

    /// How often a dead engine-core process was replaced and requests
    /// replayed (always zero on the engine core's threads in this process).
    pub fn restarts(&self) -> EngineCoreRestarts {
        match &self.inner.transport {
            Transport::InProcess { .. } => EngineCoreRestarts::default(),
            Transport::Process(p) => p.restarts(),
        }
    }

    /// The longest context (prompt + output) a request may have.
    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// The counters as of the latest step (totals over every engine-core
    /// process, when one was replaced).
    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats()
    }

    /// True while the busy loop runs (not dead, not shut down); also while
    /// a dead engine-core process is being replaced.
    pub fn is_alive(&self) -> bool {
        self.inner.shared.liveness() == Liveness::Alive
    }

    /// Calls an engine method by name (a UTILITY request; see
    /// [`super::EngineCore::call_utility`]) and waits for its result. Blocks:
    /// from async code, call it on a blocking thread.
    pub fn call_utility(&self, method: &str, args: Value) -> Result<Value, EngineCoreError> {
        self.check_alive()?;
        let input = match &self.inner.transport {
            Transport::InProcess { input, .. } => input,
            Transport::Process(p) => return p.call_utility(method, &args),
        };
        let (reply, answer) = std_mpsc::sync_channel(1);
        let msg = CoreInput::Utility {
            method: method.to_string(),
            args: Ok(args),
            reply: UtilityReply::Local(reply),
        };
        input.send(msg).map_err(|_| self.dead_error())?;
        match answer.recv() {
            Ok(result) => result.map_err(EngineCoreError::Utility),
            Err(_) => Err(self.dead_error()),
        }
    }

    /// Stops the engine core and waits for it: `drain` lets the running and
    /// waiting requests finish first, otherwise they are aborted. Streams
    /// still open then end with [`EngineCoreError::Dead`].
    pub fn shutdown(&self, drain: bool) {
        match &self.inner.transport {
            Transport::InProcess { input, threads } => {
                let _ = input.send(CoreInput::Shutdown { drain });
                let threads =
                    std::mem::take(&mut *threads.lock().unwrap_or_else(|e| e.into_inner()));
                for t in threads {
                    let _ = t.join();
                }
            }
            Transport::Process(p) => p.shutdown(drain),
        }
    }

    /// Resolves when the engine core stops: `Some(reason)` if it died of an
    /// error, `None` after a shutdown.
    pub async fn stopped(&self) -> Option<String> {
        let mut rx = self.inner.shared.watch_liveness();
        let state = rx
            .wait_for(|l| *l != Liveness::Alive)
            .await
            .map(|l| l.clone());
        match state {
            Ok(Liveness::Dead(reason)) => Some(reason),
            _ => None,
        }
    }

    fn check_alive(&self) -> Result<(), EngineCoreError> {
        self.inner
            .shared
            .liveness()
            .stopped_error()
            .map_or(Ok(()), Err)
    }

    /// Why a message could not reach the engine core: it stopped (or is
    /// stopping, when the channel closed before the liveness changed).
    fn dead_error(&self) -> EngineCoreError {
        let stopped = self.inner.shared.liveness().stopped_error();
        stopped.unwrap_or_else(|| EngineCoreError::Dead("the engine was shut down".into()))
    }
}

/// The outputs of one request, in order; the last one carries its
/// `finish_reason`. Dropping the stream earlier aborts the request.
pub struct OutputStream {
    request_id: String,
    internal_id: String,
    rx: mpsc::UnboundedReceiver<StreamItem>,
    client: EngineCoreClient,
    finished: bool,
}

impl OutputStream {
    /// The request's id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The request's next output; `None` after its last.
    pub async fn next(&mut self) -> Option<Result<EngineCoreOutput, EngineCoreError>> {
        let item = self.rx.recv().await;
        self.observe(item)
    }

    /// [`OutputStream::next`] for blocking code (not on an async runtime's
    /// threads).
    pub fn blocking_next(&mut self) -> Option<Result<EngineCoreOutput, EngineCoreError>> {
        let item = self.rx.blocking_recv();
        self.observe(item)
    }

    fn observe(&mut self, item: Option<StreamItem>) -> Option<StreamItem> {
        match &item {
            Some(Ok(out)) if out.finish_reason.is_none() => {}
            // The last output, a rejection, the dead sentinel, or the end.
            _ => self.finished = true,
        }
        item
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        if !self.finished && self.client.inner.shared.unregister(&self.internal_id) {
            self.client
                .abort_internal(vec![std::mem::take(&mut self.internal_id)]);
        }
    }
}
