//! WebAssembly plugins (the wasm host): scheduling policies, logits
//! processors and worker extensions written against the WIT package
//! `engine:plugins` (`wit/v0.1.0` to `v0.4.0`; the host accepts all), run
//! on wasmtime's component model in a sandbox, and resolved by the qualified
//! name they declare.
//!
//! - [`runtime`]: one `Engine`, the sandbox (no imports granted, a memory
//!   limit for the plugin as a whole ([`limiter`]), per-call epoch
//!   deadline) and the compiled-component cache ([`cache`], which loads
//!   only what this host wrote, checked by [`cache_guard`]).
//! - [`registry`]: loading `--plugin` files and `plugins.dirs`, WIT version
//!   and kind checks, resolution by name ([`PluginHost`]).
//! - [`instance`]: a long-lived `Store` per instance, recreated after a
//!   fault.
//! - [`policy`] / [`processor`]: the policy the scheduler puts behind its
//!   seam, and the logits processors the worker's sampler calls (with the
//!   model's [`Vocabulary`]).
//! - [`checker`]: the API server's [`RequestChecker`], which asks the
//!   logits processors whether they accept a request before it is queued.
//! - [`sampler`]: the sampler plugin, choosing each sampled row's token
//!   among the host's top-k candidates.
//! - [`extension`]: worker extensions and the host API they import, which
//!   the worker implements and registers as `collective_rpc` methods.
//! - `bindings`: every supported WIT version's bindings behind one type per
//!   kind.
//! - [`log`]: the guest's stdout, stderr and `log` import (0.3) into the
//!   host's tracing output, prefixed with the plugin's name and rate-limited.
//!
//! Plugins are called from the scheduler and the worker, and the plugin
//! host imports neither: each kind takes plain values (the policy's
//! columns, the worker extension's [`extension::HostApi`]) and its caller
//! adapts them; `docs/plugins.md` tells a plugin author how to write one.

mod bindings;
mod cache;
mod cache_guard;
pub mod checker;
mod error;
pub mod extension;
pub mod instance;
pub mod limiter;
mod live;
pub mod log;
pub mod policy;
pub mod processor;
pub mod registry;
pub mod runtime;
pub mod sampler;
mod ticker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::PluginsConfig;

/// What `LogitsProcessors::set_vocabulary` takes; defined in `sampling`, which
/// the engine that builds it may import.
pub use crate::sampling::Vocabulary;
pub use checker::RequestChecker;
pub use error::PluginError;
pub use processor::{LogitsProcessors, Row};
pub use registry::{OptionInfo, PluginHost, PluginInfo, SUPPORTED_WIT};
pub use runtime::{Limits, PluginRuntime};
pub use sampler::SamplerPlugin;

/// What a plugin is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    /// Orders admission and picks preemption victims (`scheduler.policy`).
    SchedulingPolicy,
    /// Edits logits before sampling (`plugins.logits_processors`).
    LogitsProcessor,
    /// Methods `collective_rpc` reaches as `<name>.<method>`
    /// (`worker.extension`); WIT 0.2 and later.
    WorkerExtension,
    /// Picks each row's token among the host's top-k candidates; WIT 0.2
    /// and later.
    Sampler,
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PluginKind::SchedulingPolicy => "scheduling policy",
            PluginKind::LogitsProcessor => "logits processor",
            PluginKind::WorkerExtension => "worker extension",
            PluginKind::Sampler => "sampler",
        })
    }
}

/// What a faulting per-step plugin call does to the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Log it and go on without the plugin for this step (a policy uses
    /// FCFS, a processor's edits are skipped).
    Fallback,
    /// Fail the step with the plugin's error (logits processors; a policy
    /// always falls back, as the scheduler must still schedule).
    Fail,
}

impl std::str::FromStr for OnError {
    type Err = PluginError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fallback" => Ok(OnError::Fallback),
            "fail" => Ok(OnError::Fail),
            _ => Err(PluginError::Config(format!(
                "on_error = {s:?}; use \"fallback\" or \"fail\""
            ))),
        }
    }
}

/// The compiled-component cache folder: `plugins.cache_dir`, else
/// `$XDG_CACHE_HOME/host/plugins`, else `$HOME/.cache/host/plugins`.
pub fn cache_dir(config: &PluginsConfig) -> Option<PathBuf> {
    if !config.cache {
        return None;
    }
    if let Some(dir) = &config.cache_dir {
        return Some(dir.clone());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("host/plugins"))
}

/// The runtime the `[plugins]` settings describe.
pub fn runtime_from_config(config: &PluginsConfig) -> Result<Arc<PluginRuntime>, PluginError> {
    if config.deadline_ms == 0 || config.memory_limit_mib == 0 {
        return Err(PluginError::Config(
            "deadline_ms and memory_limit_mib must be at least 1".into(),
        ));
    }
    let limits = Limits {
        deadline: Duration::from_millis(config.deadline_ms),
        deadline_per_request: Duration::from_micros(config.deadline_per_request_us),
        init_deadline: Duration::from_millis(config.init_deadline_ms.max(config.deadline_ms)),
        memory_bytes: usize::try_from(config.memory_limit_mib << 20).map_err(|_| {
            PluginError::Config("memory_limit_mib does not fit this machine".into())
        })?,
    };
    let grants = config
        .grants
        .iter()
        .map(|g| runtime::Grant {
            plugin: g.plugin.clone(),
            dir: g.dir.clone(),
            guest: g.guest.clone(),
            writable: g.writable,
        })
        .collect();
    PluginRuntime::new(limits, cache_dir(config), grants)
        .map(Arc::new)
        .map_err(PluginError::Config)
}

/// The plugins the `[plugins]` settings make known, under the worker
/// extensions' limits (`extension_deadline_ms`, `extension_memory_limit_mib`).
pub fn extension_host_from_config(config: &PluginsConfig) -> Result<PluginHost, PluginError> {
    let mut limits = config.clone();
    limits.deadline_ms = config.extension_deadline_ms;
    limits.init_deadline_ms = config.init_deadline_ms.max(config.extension_deadline_ms);
    limits.memory_limit_mib = config.extension_memory_limit_mib;
    host_from_config(&limits)
}

/// Loads every plugin the `[plugins]` settings make known.
pub fn host_from_config(config: &PluginsConfig) -> Result<PluginHost, PluginError> {
    let on_error: OnError = config.on_error.parse()?;
    let mut options = std::collections::BTreeMap::new();
    for (name, table) in &config.options {
        let json = serde_json::to_string(table).map_err(|e| {
            PluginError::Config(format!(
                "options for {name:?} cannot be expressed as JSON: {e}"
            ))
        })?;
        options.insert(name.clone(), json);
    }
    let host = PluginHost::load(
        runtime_from_config(config)?,
        &config.paths,
        &config.dirs,
        options,
        on_error,
    )?;
    for grant in &config.grants {
        if !host.plugins().any(|p| p.name == grant.plugin) {
            return Err(PluginError::Config(format!(
                "[[plugins.grants]] names plugin {:?}, but no known plugin has that name; known: {}",
                grant.plugin,
                host.names(None)
            )));
        }
    }
    Ok(host)
}
