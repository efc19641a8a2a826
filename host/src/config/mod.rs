//! The engine configuration: one typed tree, read from TOML, overridden by
//! command-line flags.
//!
//! Loading is two-pass so errors stay precise: the file is first parsed on
//! its own (an unknown key or a wrong type is reported with its line and
//! column), then the overrides (`section.key=value`) are merged into the
//! parsed table and the result is validated as a whole (`validate.rs`).
//! Every key and its default is documented in `docs/config.md`.
//!
//! The sections: `model.rs` (`[model]`, `[scheduler]`, `[cache]`,
//! `[worker]`), `parallel.rs` (`[parallel]`, `[engine]`, `[kv_events]`),
//! `plugins.rs` (`[plugins]`, `[structured_outputs]`), `server.rs`
//! (`[server]`), `speculative.rs` (`[speculative]`).

mod model;
mod parallel;
mod plugins;
mod server;
mod speculative;
#[cfg(test)]
mod tests;
mod validate;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use model::{
    CacheConfig, CacheDtype, LoadFormat, ModelConfig, SchedulerConfig, WorkerConfig,
    DEFAULT_CPU_KV_CACHE_BYTES,
};
pub use parallel::{KvEventsConfig, ParallelConfig, RestartConfig, DEFAULT_MASTER_PORT, MAX_NODES};
pub use plugins::{
    GrantConfig, PluginsConfig, StructuredOutputsConfig, DEFAULT_STRUCTURED_OUTPUTS_BACKEND,
};
pub use server::ServerConfig;
pub use speculative::{SpeculativeConfig, MAX_SPECULATIVE_TOKENS};
pub use validate::{EXECUTOR_BACKENDS, MAX_DATA_PARALLEL_SIZE, WORKER_CLASSES};

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
    /// Speculative decoding by n-gram lookup (vLLM's `--speculative-config`).
    pub speculative: SpeculativeConfig,
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
