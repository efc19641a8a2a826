//! `host bench`: prefill and decode speed on the configured model.

use clap::Args;

use crate::config::EngineConfig;

/// Flags of `host bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {}

/// Runs `host bench`.
pub fn run(_config: &EngineConfig, _args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("host bench is being wired up")
}
