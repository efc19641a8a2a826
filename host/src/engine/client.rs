//! `EngineCoreClient`: how a frontend (the HTTP server, tests) talks to an
//! engine core running on its own threads in this process, or in its own
//! process over shared-memory queues (vLLM's `InprocClient` / `MPClient`
//! over an `EngineCoreProc`), or to several such processes, one per
//! data-parallel rank, each request sent to the one the [`DpRouter`]
//! picks (vLLM's `DPLBAsyncMPClient`). Requests go in as messages;
//! each request's outputs come back on its own stream, which works from
//! async and blocking code alike. Dropping a stream before its request
//! finished aborts the request, so a client that goes away frees its KV
//! blocks without any extra bookkeeping.

use std::sync::mpsc::{self as std_mpsc, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use futures_util::future::select_all;
use serde_json::Value;
use thiserror::Error;
use tokio::sync::mpsc;

use super::core::{EngineCoreOutput, EngineCoreRequest, EngineStats};
use super::core_proc::{run_busy_loop, run_output_thread, CoreInput, UtilityReply};
use super::dp_router::{DpRouter, EngineLoad};
use super::ipc::{EngineCoreRestarts, Launcher, ProcessTransport, RemoteEngines};
use super::shared::{sum_engines, Liveness, Shared, StreamItem};
use super::startup;
use crate::config::EngineConfig;
use crate::kv_cache::cache_salt_key;
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

/// A handle on the running engine cores (one, or one per data-parallel
/// rank); cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct EngineCoreClient {
    inner: Arc<Inner>,
}

struct Inner {
    /// By data-parallel rank.
    engines: Vec<Engine>,
    /// Which engine each request goes to; `None` with one engine.
    router: Option<Mutex<DpRouter>>,
    max_model_len: usize,
}

/// One engine core: the way to it and the state its streams live in.
struct Engine {
    transport: Transport,
    shared: Arc<Shared>,
}

/// How messages reach the engine core.
// One value per engine, held behind its `Arc`: the size difference between
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
        let engines = vec![Engine { transport, shared }];
        Ok((
            EngineCoreClient::over(engines, None, max_model_len),
            tokenizer,
        ))
    }

    /// Starts the engine core in its own process (the hidden `host
    /// engine-core` command, which loads the model) and connects to it over
    /// shared memory; with `parallel.data_parallel_size = N`, N of them at
    /// once, each pinned to its share of the cores. A crash of such a
    /// process is survived: a new one is started and every unfinished
    /// request replayed there, streams staying open, within `[engine]`'s
    /// restart budget; past it every stream ends with
    /// [`EngineCoreError::Dead`], naming the exit status.
    pub fn start_process(config: &EngineConfig) -> anyhow::Result<(EngineCoreClient, Tokenizer)> {
        let tokenizer = startup::load_tokenizer(config)?;
        let size = config.parallel.data_parallel_size.max(1);
        let here = config.parallel.local_data_parallel_ranks();
        let remote = if here.end < size {
            Some(RemoteEngines::listen(config)?)
        } else {
            None
        };
        let started: Vec<_> = std::thread::scope(|scope| {
            let starts: Vec<_> = (0..size)
                .map(|rank| {
                    let mut config = config.clone();
                    config.parallel.data_parallel_rank = rank;
                    let launcher = match &remote {
                        Some(remote) if !here.contains(&rank) => {
                            Launcher::Remote(Arc::clone(remote))
                        }
                        _ => Launcher::Local,
                    };
                    scope.spawn(move || ProcessTransport::start(&config, launcher))
                })
                .collect();
            starts
                .into_iter()
                .map(|s| {
                    s.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
                })
                .collect()
        });
        let mut engines = Vec::with_capacity(size);
        let mut max_model_len = usize::MAX;
        let mut failure = None;
        for (rank, result) in started.into_iter().enumerate() {
            match result {
                Ok((transport, shared, len)) => {
                    max_model_len = max_model_len.min(len);
                    engines.push(Engine {
                        transport: Transport::Process(transport),
                        shared,
                    });
                }
                Err(e) if size > 1 => {
                    failure.get_or_insert(e.context(format!("data-parallel rank {rank}")));
                }
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            for engine in &engines {
                engine.shutdown(false);
            }
            return Err(e);
        }
        let router = (size > 1).then(|| Mutex::new(DpRouter::new(size, config.cache.block_size)));
        Ok((
            EngineCoreClient::over(engines, router, max_model_len),
            tokenizer,
        ))
    }

    fn over(
        engines: Vec<Engine>,
        router: Option<Mutex<DpRouter>>,
        max_model_len: usize,
    ) -> EngineCoreClient {
        EngineCoreClient {
            inner: Arc::new(Inner {
                engines,
                router,
                max_model_len,
            }),
        }
    }

    /// Queues a request on the engine the router picks; its outputs arrive
    /// on the returned stream. An id that is already live is refused.
    pub fn add_request(&self, req: EngineCoreRequest) -> Result<OutputStream, EngineCoreError> {
        self.check_alive()?;
        let (tx, rx) = mpsc::unbounded_channel();
        // Routing, the id check across engines and the registration happen
        // under the router's lock: no two engines take the same id, and
        // each request of a burst sees those routed before it as load.
        let mut router = self.inner.router.as_ref().map(lock);
        let rank = match router.as_deref_mut() {
            Some(router) => self.route(router, &req)?,
            None => 0,
        };
        let (request_id, internal_id) = self.inner.engines[rank].add(req, tx)?;
        drop(router);
        Ok(OutputStream {
            request_id,
            internal_id,
            rank,
            rx,
            client: self.clone(),
            finished: false,
        })
    }

    /// The engine for `req`: the best prefix-cache match against the least
    /// load, from what every engine reported since the last request.
    fn route(
        &self,
        router: &mut DpRouter,
        req: &EngineCoreRequest,
    ) -> Result<usize, EngineCoreError> {
        let engines = &self.inner.engines;
        if engines
            .iter()
            .any(|e| e.shared.has_client_id(&req.request_id))
        {
            return Err(EngineCoreError::Rejected(format!(
                "request id `{}` is already in use",
                req.request_id
            )));
        }
        for (rank, engine) in engines.iter().enumerate() {
            router.apply(rank, &engine.shared.take_kv_events());
        }
        let loads: Vec<EngineLoad> = engines.iter().map(Engine::load).collect();
        let salt = req.cache_salt.as_deref().map(cache_salt_key);
        Ok(router.choose(&req.prompt_token_ids, salt, &loads))
    }

    /// Aborts requests by id; unknown or finished ids are ignored.
    pub fn abort_requests(&self, request_ids: Vec<String>) {
        for engine in &self.inner.engines {
            engine.abort(engine.shared.unregister_client_ids(&request_ids));
        }
    }

    /// The engine-core process's id, when it runs in its own process: after
    /// a death, its replacement's as soon as that is spawned. With data
    /// parallelism, rank 0's ([`EngineCoreClient::process_ids`] has all).
    pub fn process_id(&self) -> Option<u32> {
        self.process_ids().first().copied()
    }

    /// Every engine-core process's id, by data-parallel rank (none when the
    /// engine core runs on threads of this process).
    pub fn process_ids(&self) -> Vec<u32> {
        let pids = self.inner.engines.iter();
        pids.filter_map(|e| match &e.transport {
            Transport::InProcess { .. } => None,
            Transport::Process(p) => Some(p.pid()),
        })
        .collect()
    }

    /// How often a dead engine-core process was replaced and requests
    /// replayed, over every rank (always zero on the engine core's threads
    /// in this process).
    pub fn restarts(&self) -> EngineCoreRestarts {
        let mut total = EngineCoreRestarts::default();
        for engine in &self.inner.engines {
            let r = engine.restarts();
            total.restarts += r.restarts;
            total.replayed_requests += r.replayed_requests;
        }
        total
    }

    /// The longest context (prompt + output) a request may have.
    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// The counters as of the latest step (totals over every engine-core
    /// process, when one was replaced, and over every data-parallel rank).
    pub fn stats(&self) -> EngineStats {
        let ranks: Vec<EngineStats> = self.stats_by_rank().into_iter().map(|(s, _)| s).collect();
        sum_engines(&ranks)
    }

    /// Each data-parallel rank's counters and engine-core restarts, by
    /// rank (one entry without data parallelism).
    pub fn stats_by_rank(&self) -> Vec<(EngineStats, EngineCoreRestarts)> {
        let engines = self.inner.engines.iter();
        engines.map(|e| (e.shared.stats(), e.restarts())).collect()
    }

    /// True while every busy loop runs (not dead, not shut down); also
    /// while a dead engine-core process is being replaced.
    pub fn is_alive(&self) -> bool {
        let mut engines = self.inner.engines.iter();
        engines.all(|e| e.shared.liveness() == Liveness::Alive)
    }

    /// Calls an engine method by name (a UTILITY request; see
    /// [`super::EngineCore::call_utility`]) on every engine core and waits
    /// for the results. The answer is rank 0's: every rank runs the same
    /// model and configuration, so each answers alike; the first error
    /// wins. Blocks: from async code, call it on a blocking thread.
    pub fn call_utility(&self, method: &str, args: Value) -> Result<Value, EngineCoreError> {
        self.check_alive()?;
        let mut answers = self
            .inner
            .engines
            .iter()
            .map(|e| e.call_utility(method, &args));
        let first = answers.next().unwrap_or(Ok(Value::Null))?;
        answers.try_fold(first, |first, answer| answer.map(|_| first))
    }

    /// Stops the engine cores and waits for them: `drain` lets the running
    /// and waiting requests finish first, otherwise they are aborted.
    /// Streams still open then end with [`EngineCoreError::Dead`].
    pub fn shutdown(&self, drain: bool) {
        std::thread::scope(|scope| {
            for engine in &self.inner.engines {
                scope.spawn(move || engine.shutdown(drain));
            }
        });
    }

    /// Resolves when an engine core stops: `Some(reason)` if it died of an
    /// error, `None` after a shutdown.
    pub async fn stopped(&self) -> Option<String> {
        let stops = self.inner.engines.iter().map(|e| Box::pin(e.stopped()));
        select_all(stops).await.0
    }

    fn check_alive(&self) -> Result<(), EngineCoreError> {
        let mut engines = self.inner.engines.iter();
        engines
            .find_map(|e| e.shared.liveness().stopped_error())
            .map_or(Ok(()), Err)
    }
}

impl Engine {
    /// Registers `req`'s stream and sends it; the client's and the
    /// internal id.
    fn add(
        &self,
        mut req: EngineCoreRequest,
        tx: mpsc::UnboundedSender<StreamItem>,
    ) -> Result<(String, String), EngineCoreError> {
        match &self.transport {
            Transport::InProcess { input, .. } => {
                let request_id = self.shared.register(&mut req, tx, None)?;
                let internal_id = req.request_id.clone();
                let msg = CoreInput::Add(Box::new(req));
                if input.send(msg).is_err() {
                    self.shared.unregister(&internal_id);
                    return Err(self.dead_error());
                }
                Ok((request_id, internal_id))
            }
            Transport::Process(p) => p.add(req, tx),
        }
    }

    fn abort(&self, internal_ids: Vec<String>) {
        if internal_ids.is_empty() {
            return;
        }
        match &self.transport {
            // A dead engine has nothing left to abort.
            Transport::InProcess { input, .. } => {
                let _ = input.send(CoreInput::Abort(internal_ids));
            }
            Transport::Process(p) => p.abort(internal_ids),
        }
    }

    /// What the router weighs: its requests in flight, split as its latest
    /// step reported (a request added since counts as waiting).
    fn load(&self) -> EngineLoad {
        let live = self.shared.num_live();
        let running = self.shared.num_running().min(live);
        EngineLoad {
            waiting: live - running,
            running,
        }
    }

    fn restarts(&self) -> EngineCoreRestarts {
        match &self.transport {
            Transport::InProcess { .. } => EngineCoreRestarts::default(),
            Transport::Process(p) => p.restarts(),
        }
    }

    fn call_utility(&self, method: &str, args: &Value) -> Result<Value, EngineCoreError> {
        let input = match &self.transport {
            Transport::InProcess { input, .. } => input,
            Transport::Process(p) => return p.call_utility(method, args),
        };
        let (reply, answer) = std_mpsc::sync_channel(1);
        let msg = CoreInput::Utility {
            method: method.to_string(),
            args: Ok(args.clone()),
            reply: UtilityReply::Local(reply),
        };
        input.send(msg).map_err(|_| self.dead_error())?;
        match answer.recv() {
            Ok(result) => result.map_err(EngineCoreError::Utility),
            Err(_) => Err(self.dead_error()),
        }
    }

    fn shutdown(&self, drain: bool) {
        match &self.transport {
            Transport::InProcess { input, threads } => {
                let _ = input.send(CoreInput::Shutdown { drain });
                let threads = std::mem::take(&mut *lock(threads));
                for t in threads {
                    let _ = t.join();
                }
            }
            Transport::Process(p) => p.shutdown(drain),
        }
    }

    async fn stopped(&self) -> Option<String> {
        let mut rx = self.shared.watch_liveness();
        let state = rx
            .wait_for(|l| *l != Liveness::Alive)
            .await
            .map(|l| l.clone());
        match state {
            Ok(Liveness::Dead(reason)) => Some(reason),
            _ => None,
        }
    }

    /// Why a message could not reach the engine core: it stopped (or is
    /// stopping, when the channel closed before the liveness changed).
    fn dead_error(&self) -> EngineCoreError {
        let stopped = self.shared.liveness().stopped_error();
        stopped.unwrap_or_else(|| EngineCoreError::Dead("the engine was shut down".into()))
    }
}

/// Locks a mutex; a poisoned one (a panicked holder) still holds valid
/// data here, since every critical section is a single update.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The outputs of one request, in order; the last one carries its
/// `finish_reason`. Dropping the stream earlier aborts the request.
pub struct OutputStream {
    request_id: String,
    internal_id: String,
    /// The data-parallel rank of the engine serving it.
    rank: usize,
    rx: mpsc::UnboundedReceiver<StreamItem>,
    client: EngineCoreClient,
    finished: bool,
}

impl OutputStream {
    /// The request's id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The data-parallel rank of the engine core serving it (0 without
    /// data parallelism).
    pub fn rank(&self) -> usize {
        self.rank
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
        let engine = &self.client.inner.engines[self.rank];
        if !self.finished && engine.shared.unregister(&self.internal_id) {
            engine.abort(vec![std::mem::take(&mut self.internal_id)]);
        }
    }
}
