//! `[parallel]`, `[engine]` and `[kv_events]`: how the work spreads over
//! workers, engine cores and machines, how what died is restarted, and what
//! prefix-aware routers are told.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// `[parallel]`: how many workers and how they are driven.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Workers the attention heads and the MLP are sharded over.
    pub tensor_parallel_size: usize,
    /// Engine cores behind one API server (`host serve`), each with its
    /// own workers, KV cache and share of the cores; the server sends each
    /// request to the one with the best prefix-cache match and least load.
    pub data_parallel_size: usize,
    /// This engine core's place among them: set by the API server for each
    /// engine-core process it starts (it offsets the KV-event ports and
    /// picks the cores); leave it at 0.
    pub data_parallel_rank: usize,
    /// Engine cores this machine runs (vLLM's `--data-parallel-size-local`);
    /// unset: all of them. On the API server's machine the ranks from here
    /// to `data_parallel_size` run on other machines under `host serve
    /// --headless`, which connect to `master_addr:master_port`.
    pub data_parallel_size_local: Option<usize>,
    /// The first rank a headless data-parallel machine runs (vLLM's
    /// `--data-parallel-start-rank`); 0 on the API server's machine.
    pub data_parallel_start_rank: usize,
    /// The executor backend: `uni` (worker in the engine process) or `mp`
    /// (one worker process per rank).
    pub distributed_executor_backend: String,
    /// `mp`: the `host` binary to start worker processes from; unset uses
    /// this program (or a `host` beside it).
    pub worker_executable: Option<PathBuf>,
    /// `mp`: seconds a worker may take to load its model and report READY.
    pub worker_start_timeout_s: f64,
    /// `mp`: seconds workers get to exit after their death pipe closes,
    /// before SIGTERM (then 4 s more before SIGKILL).
    pub worker_shutdown_timeout_s: f64,
    /// `mp`: seconds one step's calls may take before they fail (vLLM's
    /// `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`).
    pub execute_model_timeout_s: f64,
    /// `mp`: machines the workers are spread over (vLLM's `--nnodes`). Node
    /// 0 runs the engine and the first ranks; the others run `host serve
    /// --headless` and take their share of the ranks over TCP. When left at
    /// 1, the environment of torchrun, Slurm or LeaderWorkerSet fills in
    /// the four node keys (see docs/scale-out.md).
    pub nnodes: usize,
    /// This machine's place among the nodes (`--node-rank`); above 0 the
    /// machine serves no API and only runs workers.
    pub node_rank: usize,
    /// Node 0's address, which every node can reach (`--master-addr`). The
    /// engine's queues and all-reduce listen there too, on free ports.
    pub master_addr: String,
    /// The port node 0 waits for the other nodes on (`--master-port`).
    pub master_port: u16,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            tensor_parallel_size: 1,
            data_parallel_size: 1,
            data_parallel_rank: 0,
            data_parallel_size_local: None,
            data_parallel_start_rank: 0,
            distributed_executor_backend: "uni".into(),
            worker_executable: None,
            worker_start_timeout_s: 600.0,
            worker_shutdown_timeout_s: 5.0,
            execute_model_timeout_s: 300.0,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
        }
    }
}

impl ParallelConfig {
    /// The data-parallel ranks this machine runs: `data_parallel_size_local`
    /// of them from `data_parallel_start_rank` (all, when unset).
    pub fn local_data_parallel_ranks(&self) -> std::ops::Range<usize> {
        let start = self.data_parallel_start_rank;
        let dp = self.data_parallel_size.max(1);
        let local = self
            .data_parallel_size_local
            .unwrap_or(dp.saturating_sub(start));
        start..start + local
    }
}

/// Where node 0 waits for the other nodes unless `parallel.master_port`
/// says otherwise (vLLM's default for `--master-port`).
pub const DEFAULT_MASTER_PORT: u16 = 29501;

/// The most machines one engine's workers span (`parallel.nnodes`).
pub const MAX_NODES: usize = 64;

/// `[engine]`: restarting what died. A dead worker group (the engine core
/// restarts it) or a dead engine-core process (the API server restarts it)
/// is replaced and its requests replayed by recompute, at most
/// `max_restarts` times within any `restart_window_s`; past that the engine
/// is dead, since something that keeps dying is not transient.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RestartConfig {
    /// Restarts allowed within the window (`0`: never restart, vLLM's
    /// behaviour).
    pub max_restarts: u32,
    /// The sliding window, in seconds, the restarts are counted over.
    pub restart_window_s: f64,
}

impl Default for RestartConfig {
    fn default() -> Self {
        // Three in five minutes: a worker killed by the OOM killer or an
        // operator's mistake comes back, while one that dies on every start
        // (a bad model file, a broken machine) spends the budget within
        // seconds and the process exits for its supervisor to see, as a
        // Kubernetes CrashLoopBackOff would.
        RestartConfig {
            max_restarts: 3,
            restart_window_s: 300.0,
        }
    }
}

/// `[kv_events]`: vLLM's `KVEventsConfig`. With events on, the engine core
/// publishes every block the prefix cache stores or evicts on a ZeroMQ PUB
/// socket in vLLM's wire format, so a router (llm-d's precise prefix-cache
/// scorer, Dynamo's KV router) can send a request where its prefix is cached.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish KV-cache events.
    pub enable_kv_cache_events: bool,
    /// `zmq` (the only transport) or `null` (events off).
    pub publisher: String,
    /// Where the PUB socket binds (`tcp://*:5557` listens on every address).
    pub endpoint: String,
    /// Where a ROUTER socket answers replay requests (unset: no replay).
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches waiting to be sent before new ones are dropped (and counted).
    pub max_queue_size: usize,
    /// The topic frame of every message.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        // vLLM's defaults.
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: "zmq".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Whether events are published.
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if !["zmq", "null"].contains(&self.publisher.as_str()) {
            return invalid(
                "kv_events.publisher",
                format!("must be `zmq` or `null`, got `{}`", self.publisher),
            );
        }
        let endpoints = std::iter::once(("kv_events.endpoint", &self.endpoint)).chain(
            self.replay_endpoint
                .iter()
                .map(|e| ("kv_events.replay_endpoint", e)),
        );
        for (key, endpoint) in endpoints {
            if !endpoint.starts_with("tcp://") && !endpoint.starts_with("ipc://") {
                return invalid(
                    key,
                    format!(
                        "`{endpoint}` is not a ZeroMQ endpoint; use tcp://HOST:PORT or ipc://PATH"
                    ),
                );
            }
        }
        if self.buffer_steps == 0 || self.max_queue_size == 0 {
            return invalid(
                "kv_events.buffer_steps",
                "buffer_steps and max_queue_size must be at least 1".into(),
            );
        }
        Ok(())
    }
}
