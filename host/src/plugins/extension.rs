//! Worker extensions (vLLM's `worker_extension_cls`): WebAssembly
//! components whose methods `collective_rpc` reaches as
//! `<plugin name>.<method>` (e.g. `engine:weight-tools.stats`), on every
//! worker, and which import a small host API (`host-api` in WIT 0.2): model
//! info, named weights read and updated, KV-cache layout.
//!
//! A host-api call needs the worker, but a wasmtime `Store` owns its data
//! for `'static`. So for the duration of one call the worker *lends* what
//! the API works on (its weights and model runner, moved, not copied) as a
//! [`HostApi`] in the store's data; the guest reaches it through the
//! imported functions, and the lent value is taken back out of the store
//! before the call returns, also when the guest traps (the store is only
//! dropped and recreated afterwards). Outside a call the store holds
//! nothing, and a host-api call traps.
//!
//! The worker registers each extension's methods as its own
//! (`worker/extensions.rs`); nothing here knows the worker.
//!
//! Extensions run under their own limits (`plugins.extension_deadline_ms`,
//! `plugins.extension_memory_limit_mib`): reading a weight copies it into
//! the guest, which takes longer and more memory than a per-step hook.

use std::any::Any;

use super::bindings::extension::{host_api, WorkerExtensionPlugin};
pub use super::bindings::extension::{KvCacheStats, ModelInfo, Weight};
use super::instance::Sandboxed;
use super::runtime::StoreState;
use super::PluginError;

/// What the caller lends an extension for one call: the narrow host API the
/// plugin host defines and the worker implements (its `LentModel`), so the
/// plugin host needs nothing of the worker.
pub trait HostApi: Any + Send {
    /// The loaded model's shape.
    fn model_info(&self) -> ModelInfo;
    /// Every weight's name.
    fn weight_names(&self) -> Vec<String>;
    /// The weight `name`, dequantized; an error names what exists.
    fn read_weight(&self, name: &str) -> Result<Weight, String>;
    /// Replaces the weight `name` (as many finite values as it has); the
    /// next forward pass uses them.
    fn update_weight(&mut self, name: &str, values: &[f32]) -> Result<(), String>;
    /// The KV cache's size and layout.
    fn kv_cache_stats(&self) -> KvCacheStats;
}

/// The lent worker, or the trap a host-api call outside a call deserves.
fn lent(state: &mut StoreState) -> wasmtime::Result<&mut dyn HostApi> {
    match state.host_api.as_deref_mut() {
        Some(api) => Ok(api),
        None => Err(wasmtime::Error::msg(
            "host-api was called outside a worker-extension call (only `call` may use it)",
        )),
    }
}

impl host_api::Host for StoreState {
    fn get_model_info(&mut self) -> wasmtime::Result<ModelInfo> {
        Ok(lent(self)?.model_info())
    }

    fn weight_names(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(lent(self)?.weight_names())
    }

    fn read_weight(&mut self, name: String) -> wasmtime::Result<Result<Weight, String>> {
        Ok(lent(self)?.read_weight(&name))
    }

    fn update_weight(
        &mut self,
        name: String,
        values: Vec<f32>,
    ) -> wasmtime::Result<Result<(), String>> {
        Ok(lent(self)?.update_weight(&name, &values))
    }

    fn get_kv_cache_stats(&mut self) -> wasmtime::Result<KvCacheStats> {
        Ok(lent(self)?.kv_cache_stats())
    }
}

/// A live worker-extension instance and the methods it exports.
pub struct WorkerExtension {
    plugin: Sandboxed<WorkerExtensionPlugin>,
    methods: Vec<String>,
}

impl WorkerExtension {
    /// Wraps a started instance and asks for its methods.
    pub(super) fn new(mut plugin: Sandboxed<WorkerExtensionPlugin>) -> Result<Self, PluginError> {
        let methods = plugin.call("methods", 0, |w, s| w.methods(s))?;
        if let Some(bad) = methods
            .iter()
            .find(|m| m.is_empty() || m.contains(char::is_whitespace))
        {
            return Err(PluginError::BadMetadata {
                path: plugin.name().into(),
                message: format!("methods() lists {bad:?}, which is not a method name"),
            });
        }
        Ok(WorkerExtension { plugin, methods })
    }

    /// The plugin's qualified name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// The methods it exports (without the `<name>.` prefix).
    pub fn methods(&self) -> &[String] {
        &self.methods
    }

    /// Calls `method` with `args` (JSON text) while `api` is lent to the
    /// plugin, and hands `api` back with the result: the method's JSON
    /// answer, or an error naming the plugin and the method.
    pub fn call<A: HostApi>(
        &mut self,
        method: &str,
        args: &str,
        api: A,
    ) -> (anyhow::Result<String>, A) {
        let mut slot: Option<Box<dyn HostApi>> = Some(Box::new(api));
        let answer = self.plugin.call("call", 0, |w, s| {
            s.data_mut().host_api = slot.take();
            let answer = w.call(s, method, args);
            slot = s.data_mut().host_api.take();
            answer
        });
        let api: Box<dyn Any> =
            slot.expect("the lent worker is taken back out of the store before every return");
        let api = *api
            .downcast::<A>()
            .expect("the store held the worker lent to it");
        let name = self.plugin.name().to_string();
        let result = match answer {
            Err(fault) => Err(anyhow::Error::new(fault)),
            Ok(Err(message)) => Err(anyhow::anyhow!("{name}.{method} failed: {message}")),
            Ok(Ok(json)) => match serde_json::from_str::<serde::de::IgnoredAny>(&json) {
                Ok(_) => Ok(json),
                Err(e) => {
                    let fault = self
                        .plugin
                        .fault("call", format!("{method} returned invalid JSON ({e})"));
                    Err(anyhow::Error::new(fault))
                }
            },
        };
        (result, api)
    }
}
