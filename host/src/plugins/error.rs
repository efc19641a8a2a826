//! What can go wrong with a plugin; every message names the plugin (its
//! qualified name, or its file before the name is known) and says how to fix
//! it.

use std::path::PathBuf;

use thiserror::Error;

use super::PluginKind;

/// A plugin that could not be loaded, resolved or called.
#[derive(Debug, Error)]
pub enum PluginError {
    /// The file could not be read.
    #[error("plugin {path}: cannot read it: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a WebAssembly component wasmtime accepts.
    #[error("plugin {path}: not a loadable WebAssembly component ({message}); build it with `cargo build --release --target wasm32-wasip2`")]
    Compile {
        /// The file.
        path: PathBuf,
        /// wasmtime's message.
        message: String,
    },
    /// The component exports no `engine:plugins` interface.
    #[error("plugin {path}: exports no engine:plugins interface (it exports: {exports}); build it against plugin-sdk")]
    NotAPlugin {
        /// The file.
        path: PathBuf,
        /// What it exports instead.
        exports: String,
    },
    /// The component was built against a WIT version this host does not
    /// speak.
    #[error("plugin {path}: built against {built_against}, but this host supports {supported}; rebuild it with the plugin-sdk of this host (it builds against the newest version)")]
    IncompatibleVersion {
        /// The file.
        path: PathBuf,
        /// The package version the plugin's exports name.
        built_against: String,
        /// What this host accepts.
        supported: String,
    },
    /// The plugin's metadata is malformed.
    #[error("plugin {path}: invalid metadata: {message}")]
    BadMetadata {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Two files declare the same qualified name.
    #[error("plugin name {name:?} is declared by both {first} and {second}; make only one of them known")]
    Duplicate {
        /// The name.
        name: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
    /// No plugin or built-in has this name.
    #[error("unknown {kind} {name:?}; available: {available}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The kind the configuration key wants.
        kind: PluginKind,
        /// Every name of that kind (for a policy, built-ins first).
        available: String,
    },
    /// The named plugin is of another kind.
    #[error("{key} = {name:?}: {path} is a {found}, not a {wanted}")]
    WrongKind {
        /// The configuration key.
        key: &'static str,
        /// The name.
        name: String,
        /// The plugin's file.
        path: PathBuf,
        /// What the plugin is.
        found: PluginKind,
        /// What the key needs.
        wanted: PluginKind,
    },
    /// `init` refused the options.
    #[error("plugin {name}: rejected its options {options}: {message}")]
    Init {
        /// The plugin's qualified name.
        name: String,
        /// The options JSON.
        options: String,
        /// The plugin's reason.
        message: String,
    },
    /// A call trapped, overran its deadline, ran out of memory or returned
    /// output that failed validation.
    #[error("plugin {name}: {call} failed: {message}")]
    Fault {
        /// The plugin's qualified name.
        name: String,
        /// The hook.
        call: &'static str,
        /// What happened.
        message: String,
    },
    /// The plugin settings themselves are invalid.
    #[error("plugins config: {0}")]
    Config(String),
}
