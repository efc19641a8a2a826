//! `[server]`: the OpenAI-compatible HTTP API.

use serde::{Deserialize, Serialize};

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
    /// Send an `X-Request-Id` header on every response: the request's own,
    /// or a fresh id when it had none (vLLM's
    /// `--enable-request-id-headers`).
    pub enable_request_id_headers: bool,
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
    /// Seconds between the stats lines in the log (throughput, requests,
    /// KV-cache usage, drafts kept; vLLM's `VLLM_LOG_STATS_INTERVAL`).
    pub log_stats_interval_s: f64,
    /// Log no stats lines (vLLM's `--disable-log-stats`).
    pub disable_log_stats: bool,
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
            enable_request_id_headers: false,
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
            log_stats_interval_s: 10.0,
            disable_log_stats: false,
        }
    }
}
