//! The engine configuration: one typed tree, read from TOML, overridden by
//! command-line flags.
//!
//! Loading is two-pass so errors stay precise: the file is first parsed on
//! its own (an unknown key or a wrong type is reported with its line and
//! column), then the overrides (`section.key=value`) are merged into the
//! parsed table and the result is validated as a whole.
//! Every key and its default is documented in `docs/config.md`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Which loader to use (vLLM's `load_format`; `model.load_format` in the
/// config, written in lower case).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// A `.gguf` file is GGUF; a directory with `config.json` is safetensors.
    #[default]
    Auto,
    /// A GGUF file.
    Gguf,
    /// A Hugging Face directory: `config.json` and `.safetensors` shards.
    Safetensors,
    /// Random weights shaped by a config; see [`crate::model::dummy_config`] for where
    /// the config comes from.
    Dummy,
}

/// The element type of the KV cache (`cache.cache_dtype`, vLLM's
/// `--kv-cache-dtype`).
///
/// `auto` stores K and V as the runner computes them: f32 on the CPU,
/// bfloat16 on a GPU. The half-width types halve the cache's memory and
/// the bytes a long-context decode reads, at the cost of rounding each K
/// and V value to 11 (`float16`) or 8 (`bfloat16`) significant bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CacheDtype {
    /// The runner's compute type.
    #[default]
    Auto,
    /// IEEE single precision (the CPU's `auto`).
    Float32,
    /// IEEE half precision (llama.cpp's default).
    Float16,
    /// bfloat16 (the GPU's `auto`).
    Bfloat16,
}

impl CacheDtype {
    /// The canonical name (what the config and `/metrics` show).
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::Auto => "auto",
            CacheDtype::Float32 => "float32",
            CacheDtype::Float16 => "float16",
            CacheDtype::Bfloat16 => "bfloat16",
        }
    }
}

impl std::str::FromStr for CacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<CacheDtype, String> {
        Ok(match s {
            "auto" => CacheDtype::Auto,
            "float32" | "fp32" | "float" => CacheDtype::Float32,
            "float16" | "fp16" | "half" => CacheDtype::Float16,
            "bfloat16" | "bf16" => CacheDtype::Bfloat16,
            _ if s.starts_with("fp8") => {
                return Err(format!(
                    "{s:?}: 8-bit KV caches are not implemented; use auto, float32, float16 or bfloat16"
                ))
            }
            _ => {
                return Err(format!(
                    "{s:?} is not a KV-cache type; use auto, float32, float16 or bfloat16"
                ))
            }
        })
    }
}

impl TryFrom<String> for CacheDtype {
    type Error = String;

    fn try_from(s: String) -> Result<CacheDtype, String> {
        s.parse()
    }
}

impl From<CacheDtype> for String {
    fn from(d: CacheDtype) -> String {
        d.name().to_string()
    }
}

/// Where `scripts/fetch-model.sh` puts the default model, under `root`.
pub fn default_model_path(root: &Path) -> PathBuf {
    root.join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// What to run.
    pub model: ModelConfig,
    /// The continuous-batching scheduler.
    pub scheduler: SchedulerConfig,
    /// The paged KV cache.
    pub cache: CacheConfig,
    /// How the work is spread over workers.
    pub parallel: ParallelConfig,
    /// The worker processes and their model runners.
    pub worker: WorkerConfig,
    /// WebAssembly plugins to make known.
    pub plugins: PluginsConfig,
    /// The OpenAI-compatible HTTP server.
    pub server: ServerConfig,
    /// Constrained decoding (JSON schema, regex, choice, grammar, tool calls).
    pub structured_outputs: StructuredOutputsConfig,
    /// Recovery: how often a dead worker group or engine-core process is
    /// restarted before the engine gives up.
    pub engine: RestartConfig,
    /// KV-cache events for prefix-aware routers (vLLM's `--kv-events-config`).
    pub kv_events: KvEventsConfig,
}

/// `[model]`: the checkpoint, its tokenizer and its limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A `.gguf` file or a Hugging Face directory (config.json + safetensors).
    /// Relative paths are resolved against the current directory.
    pub path: PathBuf,
    /// How to read `path`.
    pub load_format: LoadFormat,
    /// A `tokenizer.json` to use instead of the model's own tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// The longest sequence (prompt + output) to serve; 0 takes the model's
    /// trained context length, lowered to what the KV cache holds. A value
    /// the KV cache cannot hold is refused at start-up.
    pub max_model_len: usize,
    /// Seed of the dummy weights (`load_format = "dummy"`).
    pub seed: u64,
    /// Run every step eagerly: no CUDA graphs on a GPU worker (vLLM's
    /// `enforce_eager`); the CPU worker always runs eagerly.
    pub enforce_eager: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            path: default_model_path(Path::new(".")),
            load_format: LoadFormat::Auto,
            tokenizer: None,
            max_model_len: 0,
            seed: 0,
            enforce_eager: false,
        }
    }
}

/// `[scheduler]`: vLLM V1's scheduler knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most requests in one step.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps.
    pub enable_chunked_prefill: bool,
    /// A prefill longer than this is chunked to it; 0 disables the cap.
    pub long_prefill_token_threshold: usize,
    /// The scheduling policy by qualified name; `auto` takes the one
    /// scheduling-policy plugin given by `--plugin` / `plugins.paths`, else
    /// `builtin:fcfs`.
    pub policy: String,
    /// Schedule step N+1 while step N runs (vLLM's async scheduling): the
    /// engine's own work per step overlaps the forward pass. The outputs
    /// are the same either way.
    pub async_scheduling: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            policy: "auto".into(),
            async_scheduling: true,
        }
    }
}

/// `[cache]`: the paged KV cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory given to the KV cache, in bytes (vLLM's
    /// `kv_cache_memory_bytes`). Unset: on a CPU worker, what
    /// `scheduler.max_num_seqs` sequences of `model.max_model_len` tokens
    /// fill, at most [`DEFAULT_CPU_KV_CACHE_BYTES`]; on a GPU worker, what
    /// `gpu_memory_utilization` leaves.
    pub kv_cache_memory_bytes: Option<u64>,
    /// The fraction of the GPU's memory the engine may use (weights,
    /// activations and KV cache together) when `kv_cache_memory_bytes` is
    /// unset; ignored by the CPU worker.
    pub gpu_memory_utilization: f64,
    /// Reuse the KV blocks of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// The KV cache's element type (vLLM's `cache_dtype`).
    pub cache_dtype: CacheDtype,
}

/// The most a CPU worker's KV cache takes when `cache.kv_cache_memory_bytes`
/// is unset.
pub const DEFAULT_CPU_KV_CACHE_BYTES: u64 = 256 << 20;

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 16,
            kv_cache_memory_bytes: None,
            gpu_memory_utilization: 0.9,
            enable_prefix_caching: true,
            cache_dtype: CacheDtype::Auto,
        }
    }
}

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

    fn validate(&self) -> Result<(), ConfigError> {
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

/// `[worker]`: the worker and its model runner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Which worker: `auto` picks the GPU worker when this host was built
    /// with `--features cuda` and a CUDA GPU is visible, the CPU worker
    /// otherwise; `cpu` and `gpu` ask for one (`gpu` without a GPU is an
    /// error at start-up).
    pub cls: String,
    /// Compute threads per worker; 0 uses every core.
    pub num_threads: usize,
    /// Worker-extension plugins (vLLM's `worker_extension_cls`) by
    /// qualified name, one or a list: their methods are reachable as
    /// `collective_rpc("<name>.<method>")` on every worker.
    #[serde(deserialize_with = "one_or_many")]
    pub extension: Vec<String>,
}

/// A string or a list of strings, as a list.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    match OneOrMany::deserialize(d).map_err(|_| {
        serde::de::Error::custom(
            "expected a qualified name or a list of them, e.g. \"engine:weight-tools\"",
        )
    })? {
        OneOrMany::One(name) => Ok(vec![name]),
        OneOrMany::Many(names) => Ok(names),
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            cls: "auto".into(),
            num_threads: 0,
            extension: Vec::new(),
        }
    }
}

/// `[plugins]`: WebAssembly components to make known by qualified name,
/// the logits processors to apply, and the sandbox's limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginsConfig {
    /// Component files (`--plugin FILE` appends here).
    pub paths: Vec<PathBuf>,
    /// Folders whose `*.wasm` components are all made known.
    pub dirs: Vec<PathBuf>,
    /// Logits-processor plugins applied before sampling, by qualified name,
    /// in order.
    pub logits_processors: Vec<String>,
    /// The sampler plugin by qualified name (empty: the host's sampler); it
    /// chooses each sampled row's token among `sampler_top_k` candidates.
    pub sampler: String,
    /// Candidates per row the host hands the sampler plugin (at least 1).
    pub sampler_top_k: usize,
    /// Options passed to a plugin's `init`, by qualified name, e.g.
    /// `[plugins.options."engine:shortest-prompt-first"] max_wait_s = 5`.
    pub options: std::collections::BTreeMap<String, toml::Table>,
    /// Wall-clock budget of one per-step plugin call, in milliseconds.
    pub deadline_ms: u64,
    /// Wall-clock budget of a plugin's `init`, in milliseconds.
    pub init_deadline_ms: u64,
    /// Linear memory one plugin instance may use, in MiB.
    pub memory_limit_mib: u64,
    /// Wall-clock budget of one worker-extension call, in milliseconds
    /// (reading a weight copies it into the plugin: slower than a hook).
    pub extension_deadline_ms: u64,
    /// Linear memory one worker-extension instance may use, in MiB (the
    /// largest weight it reads must fit, as f32).
    pub extension_memory_limit_mib: u64,
    /// `fallback` (log, go on without the plugin for that step) or `fail`
    /// (a faulting logits processor or sampler fails the requests of the step).
    pub on_error: String,
    /// Keep compiled components on disk so a restart does not recompile.
    pub cache: bool,
    /// Where; unset: `$XDG_CACHE_HOME/host/plugins` or `~/.cache/host/plugins`.
    pub cache_dir: Option<PathBuf>,
    /// Host directories granted to plugins (`[[plugins.grants]]`); a plugin
    /// sees no filesystem without one.
    pub grants: Vec<GrantConfig>,
}

/// `[[plugins.grants]]`: one host directory a plugin may read (and write,
/// when `writable`), preopened at `guest`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantConfig {
    /// The plugin's qualified name, e.g. `"acme:banned-words"`.
    pub plugin: String,
    /// The directory on the host.
    pub dir: PathBuf,
    /// The absolute path the plugin opens it by, e.g. `"/data"`.
    pub guest: String,
    /// Let the plugin create, change and delete files there (default: read-only).
    #[serde(default)]
    pub writable: bool,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        PluginsConfig {
            paths: Vec::new(),
            dirs: Vec::new(),
            logits_processors: Vec::new(),
            sampler: String::new(),
            sampler_top_k: 20,
            options: Default::default(),
            deadline_ms: 20,
            init_deadline_ms: 1000,
            memory_limit_mib: 64,
            extension_deadline_ms: 5000,
            extension_memory_limit_mib: 512,
            on_error: "fallback".into(),
            cache: true,
            cache_dir: None,
            grants: Vec::new(),
        }
    }
}

/// `[structured_outputs]`: which logits-processor plugin constrains the
/// requests that ask for structured output (vLLM's
/// `--structured-outputs-config`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StructuredOutputsConfig {
    /// The plugin's qualified name; it is added to the logits processors
    /// when it is known. Empty: structured output is off.
    pub backend: String,
}

/// The backend served unless configured otherwise: the llguidance plugin
/// shipped in `plugins/structured-output`.
pub const DEFAULT_STRUCTURED_OUTPUTS_BACKEND: &str = "engine:structured-output";

impl Default for StructuredOutputsConfig {
    fn default() -> Self {
        StructuredOutputsConfig {
            backend: DEFAULT_STRUCTURED_OUTPUTS_BACKEND.into(),
        }
    }
}

/// `[server]`: the OpenAI-compatible HTTP API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on.
    pub host: String,
    /// Port to listen on.
    pub port: u16,
    /// Require `Authorization: Bearer <api_key>` when set.
    pub api_key: Option<String>,
    /// The model id clients send and `/v1/models` lists; empty takes the
    /// model file's name without its extension.
    pub served_model_name: String,
    /// Largest request body accepted, in bytes (larger: HTTP 413).
    pub max_body_bytes: usize,
    /// Serve `POST /collective_rpc`, which calls worker(-extension) methods
    /// by name. Off by default: it reaches into the workers.
    pub enable_rpc_endpoint: bool,
    /// On SIGTERM / Ctrl-C: `true` lets running requests finish (new ones
    /// get 503), `false` aborts them at once.
    pub drain_on_shutdown: bool,
    /// Run the engine core in its own process (the default, vLLM's layout:
    /// a crash there cannot take the HTTP server down with it); `false`
    /// runs it on threads of the server's process.
    pub engine_core_process: bool,
    /// Most choices one request may ask for (`n`; OpenAI allows 128).
    pub max_n: u32,
    /// Most prompts in one `/v1/completions` batch.
    pub max_prompts: usize,
    /// Most bytes of prompt text in one request (every prompt or message
    /// counted), checked before anything is tokenized.
    pub max_prompt_bytes: usize,
    /// Most messages in one chat request.
    pub max_messages: usize,
    /// Most `stop` strings in one request.
    pub max_stop_strings: usize,
    /// Longest `stop` string, in bytes.
    pub max_stop_string_bytes: usize,
    /// Most `stop_token_ids` in one request.
    pub max_stop_token_ids: usize,
    /// Most `logit_bias` entries in one request (OpenAI allows 300).
    pub max_logit_bias: usize,
    /// Most bytes of `extra_args` / `vllm_xargs`, as compact JSON.
    pub max_extra_args_bytes: usize,
    /// Most engine requests waiting to be scheduled (each choice of each
    /// prompt counts); past it new requests get 429 with `Retry-After`.
    pub max_waiting_requests: usize,
    /// Most open HTTP connections; past it new ones get 503 and are closed.
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers before its
    /// connection is dropped.
    pub header_read_timeout_s: f64,
    /// Seconds a client has to send a JSON request's whole body once its
    /// headers arrived (408 past it).
    pub body_read_timeout_s: f64,
    /// Seconds an open connection may sit with no request in flight before
    /// it is closed.
    pub idle_connection_timeout_s: f64,
    /// `Host` names accepted besides loopback names and the listening
    /// address, when the server listens on a loopback address (DNS
    /// rebinding protection); `["*"]` accepts any.
    pub allowed_hosts: Vec<String>,
    /// Origins answered with CORS headers (`["*"]` for any); empty (the
    /// default) sends none, so browsers keep other sites out.
    pub cors_allowed_origins: Vec<String>,
    /// Most `/v1/responses` answers kept in memory for `GET`,
    /// `previous_response_id` and cancel; the oldest is evicted past it
    /// (0 stores none).
    pub max_stored_responses: usize,
    /// Most bytes of text (conversations and answers) the stored responses
    /// hold together; the oldest are evicted past it.
    pub max_stored_response_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            served_model_name: String::new(),
            max_body_bytes: 4 << 20,
            enable_rpc_endpoint: false,
            drain_on_shutdown: true,
            engine_core_process: true,
            max_n: 128,
            max_prompts: 128,
            max_prompt_bytes: 1 << 20,
            max_messages: 1024,
            max_stop_strings: 16,
            max_stop_string_bytes: 1024,
            max_stop_token_ids: 1024,
            max_logit_bias: 300,
            max_extra_args_bytes: 64 << 10,
            max_waiting_requests: 1024,
            max_connections: 512,
            header_read_timeout_s: 10.0,
            body_read_timeout_s: 30.0,
            idle_connection_timeout_s: 60.0,
            allowed_hosts: Vec::new(),
            cors_allowed_origins: Vec::new(),
            max_stored_responses: 1000,
            max_stored_response_bytes: 64 << 20,
        }
    }
}

/// A configuration that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the schema; the message
    /// carries the key, line and column.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key and the line).
        message: String,
    },
    /// An override given on the command line is malformed or does not fit.
    #[error("invalid override `{item}`: {message}")]
    Override {
        /// The `key=value` as given.
        item: String,
        /// What is wrong with it.
        message: String,
    },
    /// A value is out of range or names something that does not exist.
    #[error("invalid config: `{key}` {message}")]
    Invalid {
        /// The dotted key.
        key: &'static str,
        /// What is wrong and what would be right.
        message: String,
    },
}

/// The most engine cores one API server starts (`parallel.data_parallel_size`):
/// each is a process that loads the model, and past a few per machine they
/// only share the same cores.
pub const MAX_DATA_PARALLEL_SIZE: usize = 64;

/// The executor backends known to this build.
pub const EXECUTOR_BACKENDS: &[&str] = &["uni", "mp"];

/// Why `worker.cls = "gpu"` cannot run in this build (one without the
/// `cuda` feature), or `None` when it can. Whether a GPU is visible is the
/// worker's question (`worker::proc::worker_device`), asked at start-up:
/// the configuration probes no device.
fn gpu_worker_refusal() -> Option<String> {
    (!cfg!(feature = "cuda")).then(|| {
        "is `gpu` but this host was built without CUDA; rebuild with \
         `cargo build --features cuda`, or use `auto` / `cpu`"
            .to_string()
    })
}

/// The built-in worker classes (`worker.cls`).
pub const WORKER_CLASSES: &[&str] = &["auto", "cpu", "gpu"];

impl EngineConfig {
    /// Reads `file` (if any), applies `overrides` (`section.key=value`, the
    /// value in TOML syntax or a bare string) in order, and validates.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<EngineConfig, ConfigError> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                // First pass: the file alone, so errors carry its line numbers.
                toml::from_str::<EngineConfig>(&text).map_err(|e| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string().trim_end().to_string(),
                })?;
                text.parse::<toml::Table>()
                    .expect("parsed as a config just above")
            }
            None => toml::Table::new(),
        };
        let file_only = table.clone();
        for item in overrides {
            apply_override(&mut table, item)?;
        }
        let config = match toml::Value::Table(table).try_into::<EngineConfig>() {
            Ok(config) => config,
            Err(e) => return Err(blame_override(file_only, overrides, e)),
        };
        config.validate()?;
        Ok(config)
    }

    /// The `[parallel]` node keys: a multi-node group shards one model over
    /// `mp` workers, at least one rank per node, behind one engine core.
    fn validate_nodes(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        let p = &self.parallel;
        if !(1..=MAX_NODES).contains(&p.nnodes) {
            return invalid(
                "parallel.nnodes",
                format!("must be between 1 and {MAX_NODES}, got {}", p.nnodes),
            );
        }
        if p.node_rank >= p.nnodes {
            return invalid(
                "parallel.node_rank",
                format!(
                    "is {}, but node ranks run from 0 to nnodes - 1 ({})",
                    p.node_rank,
                    p.nnodes - 1
                ),
            );
        }
        // A headless node (rank > 0) runs what node 0's configuration says;
        // only node 0's must describe a group that can span the nodes.
        if p.nnodes == 1 || p.node_rank > 0 {
            return Ok(());
        }
        let nnodes = p.nnodes;
        if p.distributed_executor_backend != "mp" {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes}, which runs workers on other machines: set \
                     parallel.distributed_executor_backend = \"mp\""
                ),
            );
        }
        if p.tensor_parallel_size < nnodes {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes}, but tensor_parallel_size is {}: every node needs at least \
                     one rank, so use at most {} nodes or more ranks",
                    p.tensor_parallel_size, p.tensor_parallel_size
                ),
            );
        }
        if p.data_parallel_size > 1 {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes} with data_parallel_size {}: nnodes spreads one engine's \
                     workers over machines; to spread the engine cores instead, set \
                     data_parallel_size_local (docs/scale-out.md)",
                    p.data_parallel_size
                ),
            );
        }
        if p.master_addr.trim().is_empty() {
            return invalid(
                "parallel.master_addr",
                "is empty: give node 0's address, reachable from every node".into(),
            );
        }
        if p.master_port == 0 {
            return invalid(
                "parallel.master_port",
                "is 0: the other nodes must know the port, so name one".into(),
            );
        }
        Ok(())
    }

    /// The `[parallel]` keys that spread data-parallel engine cores over
    /// machines: each machine runs a contiguous run of ranks, the API
    /// server's machine the first.
    fn validate_data_parallel_nodes(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        let p = &self.parallel;
        let dp = p.data_parallel_size;
        let ranks = p.local_data_parallel_ranks();
        let local = ranks.len();
        if local == 0 || ranks.end > dp {
            return invalid(
                "parallel.data_parallel_size_local",
                format!(
                    "is {local} from start rank {}, but data_parallel_size is {dp}: a machine \
                     runs 1 or more ranks, all below data_parallel_size",
                    p.data_parallel_start_rank
                ),
            );
        }
        if local < dp {
            if p.master_addr.trim().is_empty() {
                return invalid(
                    "parallel.master_addr",
                    "is empty: give the API server's address, reachable from every machine".into(),
                );
            }
            if p.master_port == 0 {
                return invalid(
                    "parallel.master_port",
                    "is 0: the other machines must know the port, so name one".into(),
                );
            }
        }
        Ok(())
    }

    /// Checks ranges and names that serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if self.scheduler.max_num_seqs == 0 {
            return invalid("scheduler.max_num_seqs", "must be at least 1".into());
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            return invalid(
                "scheduler.max_num_batched_tokens",
                "must be at least 1".into(),
            );
        }
        if !(1..=1024).contains(&self.cache.block_size) {
            return invalid(
                "cache.block_size",
                format!("must be in 1..=1024, got {}", self.cache.block_size),
            );
        }
        if self.cache.kv_cache_memory_bytes == Some(0) {
            return invalid(
                "cache.kv_cache_memory_bytes",
                "must be more than 0 (or unset for the default)".into(),
            );
        }
        let utilization = self.cache.gpu_memory_utilization;
        if !(utilization > 0.0 && utilization <= 1.0) {
            return invalid(
                "cache.gpu_memory_utilization",
                format!("must be in (0, 1], got {utilization}"),
            );
        }
        self.kv_events.validate()?;
        if self.parallel.tensor_parallel_size == 0 {
            return invalid("parallel.tensor_parallel_size", "must be at least 1".into());
        }
        let dp = self.parallel.data_parallel_size;
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&dp) {
            return invalid(
                "parallel.data_parallel_size",
                format!("must be between 1 and {MAX_DATA_PARALLEL_SIZE}, got {dp}"),
            );
        }
        if self.parallel.data_parallel_rank >= dp {
            return invalid(
                "parallel.data_parallel_rank",
                format!(
                    "is {}, but ranks run from 0 to data_parallel_size - 1 ({})",
                    self.parallel.data_parallel_rank,
                    dp - 1
                ),
            );
        }
        if dp > 1 && !self.server.engine_core_process {
            return invalid(
                "parallel.data_parallel_size",
                format!(
                    "is {dp}, which runs each engine core in its own process: \
                     set server.engine_core_process = true"
                ),
            );
        }
        self.validate_nodes()?;
        self.validate_data_parallel_nodes()?;
        let seconds = [
            (
                "parallel.worker_start_timeout_s",
                self.parallel.worker_start_timeout_s,
            ),
            (
                "parallel.worker_shutdown_timeout_s",
                self.parallel.worker_shutdown_timeout_s,
            ),
            (
                "parallel.execute_model_timeout_s",
                self.parallel.execute_model_timeout_s,
            ),
            ("engine.restart_window_s", self.engine.restart_window_s),
        ];
        if let Some((key, v)) = seconds
            .into_iter()
            .find(|(_, v)| !(v.is_finite() && *v > 0.0 && *v < 1e9))
        {
            return invalid(
                key,
                format!("must be a positive number of seconds, got {v}"),
            );
        }
        let backend = &self.parallel.distributed_executor_backend;
        if !EXECUTOR_BACKENDS.contains(&backend.as_str()) {
            return invalid(
                "parallel.distributed_executor_backend",
                format!(
                    "is `{backend}`; known backends: {}",
                    EXECUTOR_BACKENDS.join(", ")
                ),
            );
        }
        // Whether the size divides the model's heads is checked where the
        // model is loaded (`model::shard`), since it needs the model's config.
        if self.parallel.tensor_parallel_size > 1 && backend != "mp" {
            return invalid(
                "parallel.tensor_parallel_size",
                format!(
                    "is {}, which needs one worker process per rank: set \
                     parallel.distributed_executor_backend = \"mp\" (it is `{backend}`)",
                    self.parallel.tensor_parallel_size
                ),
            );
        }
        let server_sizes = [
            ("server.max_body_bytes", self.server.max_body_bytes),
            ("server.max_n", self.server.max_n as usize),
            ("server.max_prompts", self.server.max_prompts),
            ("server.max_prompt_bytes", self.server.max_prompt_bytes),
            ("server.max_messages", self.server.max_messages),
            (
                "server.max_waiting_requests",
                self.server.max_waiting_requests,
            ),
            ("server.max_connections", self.server.max_connections),
        ];
        if let Some((key, _)) = server_sizes.into_iter().find(|(_, v)| *v == 0) {
            return invalid(key, "must be more than 0".into());
        }
        let server_seconds = [
            (
                "server.header_read_timeout_s",
                self.server.header_read_timeout_s,
            ),
            (
                "server.body_read_timeout_s",
                self.server.body_read_timeout_s,
            ),
            (
                "server.idle_connection_timeout_s",
                self.server.idle_connection_timeout_s,
            ),
        ];
        if let Some((key, v)) = server_seconds
            .into_iter()
            .find(|(_, v)| !(v.is_finite() && *v > 0.0 && *v < 1e9))
        {
            return invalid(
                key,
                format!("must be a positive number of seconds, got {v}"),
            );
        }
        if !WORKER_CLASSES.contains(&self.worker.cls.as_str()) {
            return invalid(
                "worker.cls",
                format!(
                    "is `{}`; known worker classes: {}",
                    self.worker.cls,
                    WORKER_CLASSES.join(", ")
                ),
            );
        }
        if self.worker.cls == "gpu" {
            if let Some(why) = gpu_worker_refusal() {
                return invalid("worker.cls", why);
            }
            if self.parallel.tensor_parallel_size > 1 {
                return invalid(
                    "parallel.tensor_parallel_size",
                    "must be 1 with the GPU worker (tensor parallelism runs on CPU workers only); \
                     set worker.cls = \"cpu\" or tensor_parallel_size = 1"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// The effective configuration as TOML (`host config show`).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config tree always serialises")
    }
}

/// The error for overrides that together make `file_only` an invalid
/// config: the first override after which it no longer is, so the message
/// names one `--set` (or flag) rather than all of them.
fn blame_override(
    mut file_only: toml::Table,
    overrides: &[String],
    all: toml::de::Error,
) -> ConfigError {
    for item in overrides {
        if apply_override(&mut file_only, item).is_err() {
            break;
        }
        if let Err(e) = toml::Value::Table(file_only.clone()).try_into::<EngineConfig>() {
            return ConfigError::Override {
                item: item.clone(),
                message: e.message().to_string(),
            };
        }
    }
    ConfigError::Override {
        item: overrides.join(" "),
        message: all.message().to_string(),
    }
}

/// Sets `section.key = value` in `table`; the value is parsed as TOML and,
/// failing that, taken as a string, so `model.path=foo.gguf` works unquoted.
fn apply_override(table: &mut toml::Table, item: &str) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        item: item.to_string(),
        message: message.to_string(),
    };
    let (key, raw) = item
        .split_once('=')
        .ok_or_else(|| err("expected `section.key=value`"))?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(err("expected `section.key=value`"));
    }
    let raw = raw.trim();
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let (last, parents) = path.split_last().expect("split yields one part at least");
    let mut node = table;
    for part in parents {
        node = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| err(&format!("`{part}` is a value, not a section")))?;
    }
    node.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    #[test]
    fn the_gpu_worker_class_needs_a_cuda_build() {
        let loaded = EngineConfig::load(None, &["worker.cls=\"gpu\"".into()]);
        if cfg!(feature = "cuda") {
            // Whether a GPU is visible is checked when the worker starts.
            loaded.unwrap();
            return;
        }
        let msg = loaded.unwrap_err().to_string();
        assert!(msg.contains("worker.cls"), "{msg}");
        assert!(msg.contains("--features cuda"), "{msg}");
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let config = EngineConfig::load(None, &[]).unwrap();
        assert_eq!(config, EngineConfig::default());
        let again: EngineConfig = toml::from_str(&config.to_toml()).unwrap();
        assert_eq!(again, config);
    }

    #[test]
    fn unknown_key_names_the_key_and_line() {
        let file = write("[scheduler]\nmax_num_seqs = 8\nmax_num_seqz = 9\n");
        let msg = EngineConfig::load(Some(file.path()), &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("max_num_seqz"), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains(&file.path().display().to_string()), "{msg}");
    }

    #[test]
    fn wrong_type_names_the_key_and_line() {
        let file = write("[cache]\n\nblock_size = \"sixteen\"\n");
        let msg = EngineConfig::load(Some(file.path()), &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("block_size") && msg.contains("line 3"),
            "{msg}"
        );
    }

    #[test]
    fn overrides_win_over_the_file() {
        let file = write("[scheduler]\nmax_num_seqs = 8\n[model]\npath = \"a.gguf\"\n");
        let config = EngineConfig::load(
            Some(file.path()),
            &[
                "scheduler.max_num_seqs=32".into(),
                "model.path=b.gguf".into(),
            ],
        )
        .unwrap();
        assert_eq!(config.scheduler.max_num_seqs, 32);
        assert_eq!(config.model.path, PathBuf::from("b.gguf"));
    }

    #[test]
    fn bad_overrides_are_named() {
        for item in [
            "noequals",
            "=3",
            "scheduler..x=1",
            "scheduler.max_num_seqs=many",
        ] {
            let msg = EngineConfig::load(None, &[item.to_string()])
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(item) || msg.contains("max_num_seqs"),
                "{item}: {msg}"
            );
        }
        let msg = EngineConfig::load(None, &["scheduler.nope=1".into()])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("nope"), "{msg}");
    }

    /// Among several overrides (`--set`s and the flags that become them),
    /// the error names the one at fault, not the whole list.
    #[test]
    fn the_bad_override_among_several_is_the_one_named() {
        let items = [
            "scheduler.max_num_seqs=4",
            "sampling.max_tokens=4",
            "model.path=m.gguf",
        ]
        .map(String::from);
        let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
        assert!(
            msg.starts_with("invalid override `sampling.max_tokens=4`: unknown field `sampling`"),
            "{msg}"
        );
        let items = ["model.path=m.gguf", "cache.block_size=\"big\""].map(String::from);
        let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
        assert!(
            msg.starts_with("invalid override `cache.block_size=\"big\"`"),
            "{msg}"
        );
    }

    /// vLLM's and llama.cpp's spellings of the KV-cache types are taken;
    /// fp8 (vLLM's) and anything else are refused, naming the types that
    /// work.
    #[test]
    fn kv_cache_dtypes_parse_and_unknown_ones_are_refused() {
        let dtype = |v: &str| {
            EngineConfig::load(None, &[format!("cache.cache_dtype=\"{v}\"")])
                .map(|c| c.cache.cache_dtype)
                .map_err(|e| e.to_string())
        };
        assert_eq!(EngineConfig::default().cache.cache_dtype, CacheDtype::Auto);
        for (v, want) in [
            ("auto", CacheDtype::Auto),
            ("float32", CacheDtype::Float32),
            ("fp16", CacheDtype::Float16),
            ("half", CacheDtype::Float16),
            ("float16", CacheDtype::Float16),
            ("bf16", CacheDtype::Bfloat16),
            ("bfloat16", CacheDtype::Bfloat16),
        ] {
            assert_eq!(dtype(v), Ok(want), "{v}");
            assert_eq!(dtype(want.name()), Ok(want), "{v}: its canonical name");
        }
        for (v, says) in [("fp8_e4m3", "8-bit"), ("int4", "not a KV-cache type")] {
            let msg = dtype(v).unwrap_err();
            assert!(
                msg.contains("cache_dtype") && msg.contains(says) && msg.contains("float16"),
                "{v}: {msg}"
            );
        }
        let shown = EngineConfig::load(None, &["cache.cache_dtype=\"fp16\"".into()])
            .unwrap()
            .to_toml();
        assert!(shown.contains("cache_dtype = \"float16\""), "{shown}");
    }

    #[test]
    fn unknown_backend_lists_the_known_ones() {
        let msg = EngineConfig::load(None, &["parallel.distributed_executor_backend=ray".into()])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("ray") && msg.contains("uni") && msg.contains("mp"),
            "{msg}"
        );
    }

    #[test]
    fn out_of_range_values_are_refused() {
        for item in [
            "scheduler.max_num_seqs=0",
            "cache.block_size=0",
            "worker.cls=\"gpu9\"",
            "parallel.execute_model_timeout_s=0",
            "parallel.worker_shutdown_timeout_s=-1",
            "parallel.worker_start_timeout_s=nan",
            "parallel.data_parallel_size=0",
            "parallel.data_parallel_size=65",
            "parallel.data_parallel_rank=1",
        ] {
            assert!(
                EngineConfig::load(None, &[item.to_string()]).is_err(),
                "{item}"
            );
        }
    }

    #[test]
    fn data_parallelism_needs_engine_core_processes() {
        let items = [
            "parallel.data_parallel_size=2",
            "server.engine_core_process=false",
        ]
        .map(String::from);
        let msg = EngineConfig::load(None, &items).unwrap_err().to_string();
        assert!(
            msg.contains("parallel.data_parallel_size")
                && msg.contains("engine_core_process = true"),
            "{msg}"
        );
        let two = EngineConfig::load(None, &items[..1]).unwrap();
        assert_eq!(two.parallel.data_parallel_size, 2);
    }

    #[test]
    fn each_machine_runs_a_run_of_data_parallel_ranks_below_the_size() {
        let load = |items: &[&str]| {
            let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
            EngineConfig::load(None, &items)
        };
        let ranks = |items: &[&str]| load(items).unwrap().parallel.local_data_parallel_ranks();
        assert_eq!(ranks(&["parallel.data_parallel_size=4"]), 0..4);
        let server = [
            "parallel.data_parallel_size=4",
            "parallel.data_parallel_size_local=1",
        ];
        assert_eq!(ranks(&server), 0..1);
        let headless = [
            "parallel.data_parallel_size=4",
            "parallel.data_parallel_start_rank=1",
        ];
        assert_eq!(ranks(&headless), 1..4, "unset: the rest");
        for (items, key) in [
            (
                &[
                    "parallel.data_parallel_size=4",
                    "parallel.data_parallel_size_local=0",
                ][..],
                "data_parallel_size_local",
            ),
            (
                &[
                    "parallel.data_parallel_size=4",
                    "parallel.data_parallel_start_rank=3",
                    "parallel.data_parallel_size_local=2",
                ],
                "data_parallel_size_local",
            ),
            (
                &[
                    "parallel.data_parallel_size=2",
                    "parallel.data_parallel_size_local=1",
                    "parallel.master_port=0",
                ],
                "parallel.master_port",
            ),
        ] {
            let msg = load(items).unwrap_err().to_string();
            assert!(msg.contains(key), "{items:?}: {msg}");
        }
    }
}
