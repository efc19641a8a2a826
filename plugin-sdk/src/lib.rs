//! The plugin SDK for the `host` engine: write a scheduling policy, a logits
//! processor, a sampler or a worker extension as plain Rust, export it with one macro, build it with
//! `cargo build --release --target wasm32-wasip2`, and load the `.wasm` with
//! `host --plugin FILE.wasm`.
//!
//! The SDK hides the WIT bindings (`wit/v0.4.0/plugins.wit`, package
//! `engine:plugins@0.4.0`, vendored in this crate's `wit/` so it builds
//! from anywhere; the `wit-0-2` feature builds against `0.2.0` instead):
//! a plugin implements a trait
//! ([`policy::SchedulingPolicy`], [`logits_processor::LogitsProcessor`],
//! [`sampler::Sampler`] or [`worker_extension::WorkerExtension`])
//! whose methods take and return ordinary Rust values, so its logic is
//! unit-testable natively with `cargo test`. Enable the cargo feature of the
//! one kind the plugin is (`policy`, `logits-processor`, `sampler` or
//! `worker-extension`). [`log`] (and the [`info!`] family of macros)
//! writes to the host's log; so do `println!` and `eprintln!`.
//!
//! ```ignore
//! use plugin_sdk::policy::{Metadata, SchedulingPolicy, WaitingQueue};
//! struct Lifo;
//! impl SchedulingPolicy for Lifo {
//!     fn metadata() -> Metadata { Metadata::new("acme:lifo", "1.0.0") }
//!     fn new(_options: &str) -> Result<Self, String> { Ok(Lifo) }
//!     fn order_waiting(&mut self, q: &WaitingQueue) -> Vec<u32> {
//!         (0..q.ids.len() as u32).rev().collect()
//!     }
//! }
//! plugin_sdk::export_policy!(Lifo);
//! ```

#![warn(missing_docs)]

extern crate self as plugin_sdk;

pub mod log;
#[cfg(feature = "logits-processor")]
pub mod logits_processor;
#[cfg(feature = "policy")]
pub mod policy;
#[cfg(feature = "sampler")]
pub mod sampler;
#[doc(hidden)]
pub mod state;
#[doc(hidden)]
pub mod types;
#[cfg(feature = "worker-extension")]
pub mod worker_extension;

/// The WIT package version this SDK builds plugins against.
#[cfg(not(feature = "wit-0-2"))]
pub const WIT_VERSION: &str = "0.4.0";
/// The WIT package version this SDK builds plugins against.
#[cfg(feature = "wit-0-2")]
pub const WIT_VERSION: &str = "0.2.0";

/// One option a plugin accepts in its `options` JSON object (shown by
/// `host plugin inspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionSpec {
    /// The key in the options object.
    pub name: String,
    /// What it does, with its unit and range.
    pub description: String,
    /// The value used when it is absent, as JSON.
    pub default_json: String,
}

/// What a plugin says about itself; the kind is implied by the trait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// The qualified name `namespace:name` the configuration refers to.
    pub name: String,
    /// The plugin's own version (semver).
    pub version: String,
    /// The options the plugin accepts.
    pub options: Vec<OptionSpec>,
}

impl Metadata {
    /// Metadata with no options.
    pub fn new(name: &str, version: &str) -> Metadata {
        Metadata {
            name: name.to_string(),
            version: version.to_string(),
            options: Vec::new(),
        }
    }

    /// Adds an option (builder style).
    pub fn option(mut self, name: &str, description: &str, default_json: &str) -> Metadata {
        self.options.push(OptionSpec {
            name: name.to_string(),
            description: description.to_string(),
            default_json: default_json.to_string(),
        });
        self
    }
}

#[doc(hidden)]
pub use wit_bindgen::rt as __wit_bindgen_rt;
