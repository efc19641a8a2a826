//! `host generate`: one prompt in, streamed text out.

use clap::Args;

use crate::config::EngineConfig;

/// Flags of `host generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
}

/// Runs `host generate`.
pub fn run(_config: &EngineConfig, _args: &GenerateArgs) -> anyhow::Result<()> {
    anyhow::bail!("host generate is being wired up")
}
