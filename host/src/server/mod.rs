//! `host serve`: the OpenAI-compatible HTTP API (vLLM's API server) in
//! front of the engine core.
//!
//! The server is the frontend: it tokenizes, applies the chat template,
//! fans `n` choices out into engine requests, and turns engine-core outputs
//! into text through `RequestState` (detokenizer + stop strings). The engine
//! core runs behind `EngineCoreClient`, on its own threads or in its own
//! process (`server.engine_core_process`).
//!
//! Modules: `protocol` (wire types), `params` (validation), `completions` and
//! `chat` (the two generation endpoints), `generate` (engine requests of one
//! HTTP request), `admission` (the cap on waiting engine requests), `sse`
//! (streaming), `metrics` (Prometheus), `auth` (`--api-key`), `guard`
//! (`Host`, `Content-Type`, CORS), `routes` (router and small endpoints),
//! `listener` (accept loop, connection cap, timeouts), `error`;
//! `tokenize` (`/tokenize`, `/detokenize`), `responses` (`/v1/responses`
//! and its in-memory store), `plugins` (`/v1/plugins`), `web` (the
//! playground page at `/`); `structured` (`response_format`,
//! `structured_outputs` and `text.format` into the constraint a
//! logits-processor plugin reads from `extra_args`).

mod admin;
mod admission;
mod auth;
mod beam;
mod chat;
mod completions;
mod error;
mod fields;
mod generate;
mod guard;
mod limits;
mod listener;
mod loading;
mod metrics;
mod params;
mod plugins;
mod prediction;
pub mod protocol;
mod request_id;
mod responses;
mod routes;
mod sse;
mod stat_logger;
mod structured;
mod tokenize;
mod tools;
mod web;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;

pub use error::ApiError;
pub use metrics::Metrics;
pub(crate) use stat_logger::TARGET as STATS_LOG_TARGET;

use crate::config::{EngineConfig, ServerConfig};
use crate::engine::EngineCoreClient;
use crate::tokenizer::Tokenizer;

/// How long a draining shutdown waits for running requests before it
/// aborts them.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the server keeps answering 503 after the engine died, so
/// clients see why, before the process exits non-zero.
const DEAD_GRACE: Duration = Duration::from_secs(1);

/// A check of a request's final `extra_args` before it is queued, so that
/// what a plugin cannot take (a JSON schema or grammar that does not
/// compile) is a 400 rather than a failure mid-generation. It runs on a
/// blocking thread: compiling a grammar may take milliseconds.
pub trait RequestCheck: Send + Sync {
    /// `Ok` when the plugins can serve `extra_args` (`None`: the request
    /// has none); otherwise why not, in a sentence that names the plugin
    /// and the problem, which the client gets as the 400's message.
    fn check(&self, extra_args: Option<&serde_json::Value>) -> Result<(), String>;
}

/// Builds the [`RequestCheck`] from the served model's tokenizer (the
/// server's own, so the process holds one copy of it); `None` when nothing
/// needs checking.
pub type MakeCheck =
    Box<dyn FnOnce(&Tokenizer) -> anyhow::Result<Option<Arc<dyn RequestCheck>>> + Send>;

/// What every handler shares.
pub struct AppState {
    /// The engine core.
    pub client: EngineCoreClient,
    /// The model's tokenizer (and chat template).
    pub tokenizer: Tokenizer,
    /// The server's own measurements.
    pub metrics: Metrics,
    /// The id clients send as `model`.
    pub model_name: String,
    /// Where the model was loaded from (`/v1/models`' `root`).
    pub model_root: String,
    /// The plugins the configuration names, as `/v1/plugins` lists them.
    pub plugins: serde_json::Value,
    /// Stored `/v1/responses` answers.
    pub responses: responses::Store,
    /// `[server]`.
    pub config: ServerConfig,
    /// Unix time the server started (`/v1/models`' `created`).
    pub created: u64,
    /// The plugins' check of a request's `extra_args`, if any.
    check: Option<Arc<dyn RequestCheck>>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    /// Engine requests waiting for their first output, against
    /// `server.max_waiting_requests`.
    admission: admission::Admission,
}

impl AppState {
    /// Shared state over a started engine.
    pub fn new(
        client: EngineCoreClient,
        tokenizer: Tokenizer,
        config: &EngineConfig,
        plugins: serde_json::Value,
        check: Option<Arc<dyn RequestCheck>>,
    ) -> AppState {
        let model_name = served_model_name(config);
        AppState {
            client,
            tokenizer,
            metrics: Metrics::new(
                &model_name,
                config.parallel.data_parallel_size,
                config.cache.cache_dtype,
            ),
            model_name,
            model_root: config.model.path.display().to_string(),
            plugins,
            responses: responses::Store::new(
                config.server.max_stored_responses,
                config.server.max_stored_response_bytes,
            ),
            config: config.server.clone(),
            created: unix_now(),
            check,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            admission: admission::Admission::new(config.server.max_waiting_requests),
        }
    }

    /// 503 unless the engine is alive and the server not shutting down.
    pub fn check_serving(&self) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        if !self.client.is_alive() {
            return Err(ApiError::unavailable(
                "the engine is dead; see the server's log for why",
            ));
        }
        Ok(())
    }

    /// A request's `model` must be the served one (or absent).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::field(
                "model",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    self.model_name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// A fresh request id, unique within this server's life.
    pub fn next_request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}-{n}", self.created)
    }

    /// The answer's `id`: `<prefix>-<name>` when the client named the
    /// request (vLLM's `X-Request-Id` header, else the body's `request_id`;
    /// empty is no name), else a fresh one. Engine requests always get
    /// fresh ids ([`Self::next_request_id`]), so two answers a client
    /// gave one name cannot collide in the engine.
    pub fn answer_id(
        &self,
        prefix: &str,
        headers: &HeaderMap,
        body: Option<&str>,
    ) -> Result<String, ApiError> {
        let header = match headers.get(request_id::HEADER) {
            Some(v) => Some(v.to_str().map_err(|_| {
                ApiError::field(
                    "X-Request-Id",
                    "must be visible ASCII; send other names in the body's `request_id`",
                )
            })?),
            None => None,
        };
        if let Some(id) = header {
            limits::request_id("X-Request-Id", id)?;
        }
        if let Some(id) = body {
            limits::request_id("request_id", id)?;
        }
        let named = |id: &&str| !id.is_empty();
        Ok(match header.filter(named).or(body.filter(named)) {
            Some(name) => format!("{prefix}-{name}"),
            None => self.next_request_id(prefix),
        })
    }

    /// `max_tokens` of a request that sets none: the rest of the context.
    pub fn default_max_tokens(&self, prompt_len: usize) -> u32 {
        u32::try_from(
            self.client
                .max_model_len()
                .saturating_sub(prompt_len)
                .max(1),
        )
        .unwrap_or(u32::MAX)
    }
}

/// `server.served_model_name`, or the model file's name without extension.
pub fn served_model_name(config: &EngineConfig) -> String {
    if !config.server.served_model_name.is_empty() {
        return config.server.served_model_name.clone();
    }
    config
        .model
        .path
        .file_stem()
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned())
}

/// The request body as a JSON object, or the error reading or parsing it
/// met (413 past the size limit, 400 for anything but a JSON object).
fn request_object(body: Result<Bytes, BytesRejection>) -> Result<serde_json::Value, ApiError> {
    let body = body.map_err(|e| {
        ApiError::with_status(
            e.status(),
            format!("cannot read the request body: {}", e.body_text()),
        )
    })?;
    params::json_object(&body)
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Starts the engine, then serves until SIGTERM / Ctrl-C (exit 0) or until
/// the engine dies (an error, so the process exits non-zero).
///
/// `make_check`, when given, builds what vets every generation request's
/// final `extra_args` before it is queued ([`RequestCheck`]), once the
/// tokenizer is loaded.
pub fn serve(
    config: &EngineConfig,
    plugins: serde_json::Value,
    make_check: Option<MakeCheck>,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("http")
        .build()
        .context("starting the HTTP server's runtime")?;
    runtime.block_on(run(config, plugins, make_check))
}

async fn run(
    config: &EngineConfig,
    plugins: serde_json::Value,
    make_check: Option<MakeCheck>,
) -> anyhow::Result<()> {
    let addr = format!("{}:{}", config.server.host, config.server.port);
    // Bind first: a taken port should fail before a slow model load.
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (server.host / server.port)"))?;
    // Readiness: 503 on every request until the engine is up.
    let (ready, loaded) = tokio::sync::oneshot::channel();
    let loading = tokio::spawn(loading::answer_while_loading(listener, loaded));
    let engine_config = config.clone();
    let (client, tokenizer, check) = tokio::task::spawn_blocking(move || {
        let (client, tokenizer) = if engine_config.server.engine_core_process {
            EngineCoreClient::start_process(&engine_config)?
        } else {
            EngineCoreClient::start_in_process(&engine_config)?
        };
        let check = match make_check {
            Some(make) => make(&tokenizer)?,
            None => None,
        };
        anyhow::Ok((client, tokenizer, check))
    })
    .await
    .context("the engine start-up panicked")??;
    let _ = ready.send(());
    let listener = loading.await.context("the loading answerer panicked")?;
    let app = Arc::new(AppState::new(
        client.clone(),
        tokenizer,
        config,
        plugins,
        check,
    ));
    let local = listener.local_addr()?;
    // Tests and scripts wait for this line.
    println!(
        "host serve: model `{}` listening on http://{local}",
        app.model_name
    );
    tracing::info!(%local, "serving");

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let router = routes::router(app.clone(), local);
    let limits = listener::Limits::new(&config.server);
    let server = tokio::spawn(listener::serve(listener, router, limits, stop_rx));
    if !config.server.disable_log_stats {
        let interval = Duration::from_secs_f64(config.server.log_stats_interval_s);
        tokio::spawn(stat_logger::run(client.clone(), interval));
    }

    tokio::select! {
        stopped = client.stopped() => {
            let reason = stopped.unwrap_or_else(|| "it was shut down".into());
            // Requests meanwhile get 503 (`check_serving` sees the engine dead).
            tracing::error!(%reason, "the engine died");
            tokio::time::sleep(DEAD_GRACE).await;
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(DEAD_GRACE, server).await;
            anyhow::bail!("the engine died: {reason}")
        }
        () = shutdown_signal() => {
            let drain = config.server.drain_on_shutdown;
            tracing::info!(drain, "shutting down");
            app.shutting_down.store(true, Ordering::Relaxed);
            let _ = stop_tx.send(true);
            if !drain {
                client.shutdown(false);
            }
            if tokio::time::timeout(DRAIN_TIMEOUT, server).await.is_err() {
                tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; aborting them");
            }
            client.shutdown(false);
            Ok(())
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
