//! `host serve` (also what `host` does with no subcommand): the
//! OpenAI-compatible HTTP server. Its flags override `[server]` keys.

use clap::Args;

use crate::config::EngineConfig;

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
        out
    }
}

/// Serves until SIGTERM / Ctrl-C, or fails when the engine dies.
pub fn run(config: &EngineConfig) -> anyhow::Result<()> {
    let plugins = super::plugins_in_use::describe(config)?;
    crate::server::serve(config, plugins)
}
