//! `host serve` (also what `host` does with no subcommand): the
//! OpenAI-compatible HTTP server. Its flags override `[server]` keys.

use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use super::shipped_plugins::{asks_for_structured_output, structured_outputs_unavailable};
use crate::config::EngineConfig;
use crate::plugins::{host_from_config, RequestChecker};
use crate::sampling::Vocabulary;
use crate::server::{MakeCheck, RequestCheck};
use crate::tokenizer::Tokenizer;

/// Flags of `host serve`.
#[derive(Debug, Default, Args)]
pub struct ServeArgs {
    /// Address to listen on [server.host].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free one [server.port].
    #[arg(long)]
    pub port: Option<u16>,
    /// Require `Authorization: Bearer <KEY>` on /v1 routes [server.api_key].
    #[arg(long, value_name = "KEY", env = "HOST_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Serve no API: run this machine's engine cores for another machine's
    /// API server (data parallelism; implied by data_parallel_start_rank >
    /// 0), or its workers of a multi-node group (implied by node_rank > 0).
    #[arg(long)]
    pub headless: bool,
    /// Log no periodic stats lines [server.disable_log_stats].
    #[arg(long)]
    pub disable_log_stats: bool,
    /// Send `X-Request-Id` on every response
    /// [server.enable_request_id_headers].
    #[arg(long)]
    pub enable_request_id_headers: bool,
}

impl ServeArgs {
    /// The flags as `key=value` config overrides.
    pub fn overrides(&self) -> Vec<String> {
        let quoted = |s: &str| toml::Value::String(s.to_string()).to_string();
        let mut out = Vec::new();
        if let Some(h) = &self.host {
            out.push(format!("server.host={}", quoted(h)));
        }
        if let Some(p) = self.port {
            out.push(format!("server.port={p}"));
        }
        if let Some(k) = &self.api_key {
            out.push(format!("server.api_key={}", quoted(k)));
        }
        if self.disable_log_stats {
            out.push("server.disable_log_stats=true".into());
        }
        if self.enable_request_id_headers {
            out.push("server.enable_request_id_headers=true".into());
        }
        out
    }
}

/// Serves until SIGTERM / Ctrl-C, or fails when the engine dies. A
/// headless machine runs its engine cores (data parallelism) or its workers
/// (a multi-node group) for the API server's machine instead.
pub fn run(config: &EngineConfig, args: &ServeArgs) -> anyhow::Result<()> {
    let p = &config.parallel;
    if p.data_parallel_size > 1 && (args.headless || p.data_parallel_start_rank > 0) {
        return crate::engine::ipc::run_headless_engines(config);
    }
    if args.headless || p.node_rank > 0 {
        return crate::engine::run_headless_node(config);
    }
    let plugins = super::plugins_in_use::describe(config)?;
    let check_config = config.clone();
    let make_check: MakeCheck = Box::new(move |tokenizer| {
        let check = ServeCheck {
            processors: request_checker(&check_config, tokenizer)?,
            structured_outputs_unavailable: structured_outputs_unavailable(&check_config),
        };
        Ok(Some(Arc::new(check)))
    });
    crate::server::serve(config, plugins, Some(make_check))
}

/// What the server asks of each request's `extra_args` before queueing it.
struct ServeCheck {
    /// The 0.4 logits processors' `check-request`.
    processors: Option<RequestChecker>,
    /// Why structured output cannot be served here, when it cannot: such a
    /// request is refused rather than answered unconstrained.
    structured_outputs_unavailable: Option<String>,
}

impl RequestCheck for ServeCheck {
    fn check(&self, extra_args: Option<&serde_json::Value>) -> Result<(), String> {
        let constrained = asks_for_structured_output(extra_args);
        if let (true, Some(why)) = (constrained, &self.structured_outputs_unavailable) {
            return Err(format!("structured output was asked for, but {why}"));
        }
        match &self.processors {
            Some(p) => p.check(extra_args),
            None => Ok(()),
        }
    }
}

/// The logits processors' check of each request's `extra_args` before it
/// is queued: instances of its own (the server's threads never wait on a
/// worker's), given the served model's vocabulary (from the server's
/// `tokenizer`) as the workers' are. `None` when no configured processor
/// checks requests (WIT 0.4).
fn request_checker(
    config: &EngineConfig,
    tokenizer: &Tokenizer,
) -> anyhow::Result<Option<RequestChecker>> {
    let names = &config.plugins.logits_processors;
    if names.is_empty() {
        return Ok(None);
    }
    let host = host_from_config(&config.plugins)
        .context("loading the logits processors for the request check")?;
    let vocabulary = Vocabulary::from_tokens(tokenizer.tokens(), tokenizer.eos_token_id());
    let backend = &config.structured_outputs.backend;
    RequestChecker::new(&host, names, backend, &vocabulary)
        .context("starting the logits processors for the request check")
}
