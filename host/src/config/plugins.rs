//! `[plugins]` and `[structured_outputs]`: the WebAssembly components made
//! known by qualified name, their sandbox, and the constrained-decoding
//! backend.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

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
    /// Added to `deadline_ms` for each request a per-step call carries (a
    /// row to edit or sample, a request to order), in microseconds: a
    /// call's work grows with its batch.
    pub deadline_per_request_us: u64,
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
            deadline_per_request_us: 1000,
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
