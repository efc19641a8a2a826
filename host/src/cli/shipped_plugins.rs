//! The plugins shipped with the binary, and the structured-output backend.
//!
//! A `plugins/` folder beside the `host` executable (where
//! `scripts/quickstart.sh` and `scripts/test.sh` install the plugins built
//! from `plugins/`) is made known as if `plugins.dirs` named it, and
//! `structured_outputs.backend`, when a known logits processor has that
//! name, joins `plugins.logits_processors`. Both are resolved once, when
//! the configuration is loaded, so the engine, its workers and the API
//! server's request check all see the same list.

use std::path::PathBuf;

use crate::config::{EngineConfig, DEFAULT_STRUCTURED_OUTPUTS_BACKEND};
use crate::plugins::{host_from_config, PluginKind};
use crate::sampling::STRUCTURED_OUTPUTS_KEY;

/// Whether a request's `extra_args` carry a structured-output constraint
/// (under the key the API server puts it, which the plugin reads).
pub fn asks_for_structured_output(extra_args: Option<&serde_json::Value>) -> bool {
    crate::sampling::params::extra_args_carry(extra_args, STRUCTURED_OUTPUTS_KEY)
}

/// Where the shipped plugins are installed: `plugins/` beside the
/// executable, when it exists.
fn shipped_dir() -> Option<PathBuf> {
    let dir = std::env::current_exe().ok()?.parent()?.join("plugins");
    dir.is_dir().then_some(dir)
}

/// Adds the shipped plugins' folder to `plugins.dirs` and the
/// structured-output backend to the logits processors (see the module
/// docs). A backend other than the default that no known plugin provides
/// is an error; the default one missing only turns structured output off,
/// with a warning that says how to install it.
pub fn resolve(config: &mut EngineConfig) -> anyhow::Result<()> {
    if let Some(dir) = shipped_dir() {
        if !config.plugins.dirs.contains(&dir) {
            config.plugins.dirs.push(dir);
        }
    }
    let backend = config.structured_outputs.backend.clone();
    if backend.is_empty() || config.plugins.logits_processors.contains(&backend) {
        return Ok(());
    }
    let p = &config.plugins;
    let mut processors = Vec::new();
    if !p.paths.is_empty() || !p.dirs.is_empty() {
        let host = host_from_config(p)
            .map_err(|e| anyhow::anyhow!("cannot read the configured plugins: {e}"))?;
        processors.extend(
            host.plugins()
                .filter(|i| i.kind == PluginKind::LogitsProcessor)
                .map(|i| i.name.clone()),
        );
    }
    if processors.contains(&backend) {
        config.plugins.logits_processors.push(backend);
    } else if backend == DEFAULT_STRUCTURED_OUTPUTS_BACKEND {
        tracing::warn!("structured output is off: {}", unavailable(&backend));
    } else {
        anyhow::bail!(
            "structured_outputs.backend = {backend:?}: no known logits-processor plugin has that name (known: {}); \
             give its component with --plugin FILE, or set it to \"\" to turn structured output off",
            if processors.is_empty() { "none".to_string() } else { processors.join(", ") }
        );
    }
    Ok(())
}

/// Why a request asking for structured output cannot be served under
/// `config`, when it cannot: its backend is not among the logits
/// processors (not installed, or turned off).
pub fn structured_outputs_unavailable(config: &EngineConfig) -> Option<String> {
    let backend = &config.structured_outputs.backend;
    if backend.is_empty() {
        return Some(
            "structured output is turned off (structured_outputs.backend is empty)".to_string(),
        );
    }
    (!config.plugins.logits_processors.contains(backend)).then(|| unavailable(backend))
}

/// The missing-backend message, with how to install the shipped one.
fn unavailable(backend: &str) -> String {
    let install = match std::env::current_exe() {
        Ok(exe) => format!("{}", exe.parent().unwrap_or(&exe).join("plugins").display()),
        Err(_) => "the folder of the host executable, under plugins/".to_string(),
    };
    if backend == DEFAULT_STRUCTURED_OUTPUTS_BACKEND {
        format!(
            "the plugin {backend} is not installed; build it with \
             `cd plugins && cargo build --release --target wasm32-wasip2 -p structured-output` \
             and copy plugins/target/wasm32-wasip2/release/structured_output.wasm into {install} \
             (or give it with --plugin FILE)"
        )
    } else {
        format!("the plugin {backend} (structured_outputs.backend) is not loaded")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_backend_is_named() {
        let mut config = EngineConfig::default();
        config.structured_outputs.backend = "acme:json".into();
        let e = resolve(&mut config).unwrap_err().to_string();
        assert!(e.contains("acme:json") && e.contains("--plugin"), "{e}");
    }

    #[test]
    fn the_default_backend_missing_turns_structured_output_off() {
        let mut config = EngineConfig::default();
        resolve(&mut config).unwrap();
        let why = structured_outputs_unavailable(&config).unwrap();
        assert!(
            why.contains("cargo build --release --target wasm32-wasip2"),
            "{why}"
        );
        config.structured_outputs.backend.clear();
        let why = structured_outputs_unavailable(&config).unwrap();
        assert!(why.contains("turned off"), "{why}");
        config.structured_outputs.backend = DEFAULT_STRUCTURED_OUTPUTS_BACKEND.into();
        config
            .plugins
            .logits_processors
            .push(DEFAULT_STRUCTURED_OUTPUTS_BACKEND.into());
        assert!(structured_outputs_unavailable(&config).is_none());
    }
}
