//! Worker extensions: the trait, the host API it is given, and
//! [`export_worker_extension!`](crate::export_worker_extension).
//!
//! The engine reaches an extension's methods with
//! `collective_rpc("<name>.<method>", args)` on every worker; each call
//! gets the worker's [`Host`] for its duration: model info, named weights
//! (read dequantized, update), and the KV cache's layout.

/// The WIT bindings of this kind's world: `engine:plugins@0.4.0`, or
/// `0.2.0` with the `wit-0-2` feature (both vendored in `plugin-sdk/wit/`).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        path: "wit/v0.4.0",
        world: "engine:plugins/worker-extension-plugin@0.4.0",
        with: {
            "engine:plugins/logging@0.4.0": crate::log::bindings::engine::plugins::logging,
            "engine:plugins/types@0.4.0": crate::types::bindings::engine::plugins::types,
        },
        pub_export_macro: true,
        export_macro_name: "__export_worker_extension_world",
        default_bindings_module: "plugin_sdk::worker_extension::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "engine:plugins/worker-extension-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::types::bindings::engine::plugins::types },
        pub_export_macro: true,
        export_macro_name: "__export_worker_extension_world",
        default_bindings_module: "plugin_sdk::worker_extension::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

pub use crate::{Metadata, OptionSpec};
use bindings::engine::plugins::host_api as wit_host;

/// The loaded model's shape: layers, sizes, heads, context, weight types.
pub type ModelInfo = wit_host::ModelInfo;

/// One weight: its shape (outermost first), stored type and every value
/// as f32, row-major.
pub type Weight = wit_host::Weight;

/// The KV cache's size and layout.
pub type KvCacheStats = wit_host::KvCacheStats;

/// What the worker offers an extension during a call. [`WorkerHost`] is
/// the real one; a plugin's native unit tests pass their own.
pub trait Host {
    /// The loaded model's shape.
    fn model_info(&self) -> ModelInfo;
    /// Every weight's name (GGUF names, e.g. `blk.0.attn_q.weight`).
    fn weight_names(&self) -> Vec<String>;
    /// The weight `name`, dequantized; an error names what exists.
    fn read_weight(&self, name: &str) -> Result<Weight, String>;
    /// Replaces the weight `name` with `values` (as many as it has, all
    /// finite; re-quantized to its type); the next forward pass uses them.
    fn update_weight(&mut self, name: &str, values: &[f32]) -> Result<(), String>;
    /// The KV cache's size and layout.
    fn kv_cache_stats(&self) -> KvCacheStats;
}

/// The worker the extension runs in, through the imported `host-api`
/// (only inside a component; natively its functions are unreachable).
pub struct WorkerHost;

impl Host for WorkerHost {
    fn model_info(&self) -> ModelInfo {
        wit_host::get_model_info()
    }
    fn weight_names(&self) -> Vec<String> {
        wit_host::weight_names()
    }
    fn read_weight(&self, name: &str) -> Result<Weight, String> {
        wit_host::read_weight(name)
    }
    fn update_weight(&mut self, name: &str, values: &[f32]) -> Result<(), String> {
        wit_host::update_weight(name, values)
    }
    fn kv_cache_stats(&self) -> KvCacheStats {
        wit_host::get_kv_cache_stats()
    }
}

/// A worker extension. One value lives per plugin instance (one per
/// worker); the host calls it from one thread.
pub trait WorkerExtension: Sized + 'static {
    /// Name (`namespace:name`), version and options.
    fn metadata() -> Metadata;

    /// Builds the extension from the configuration's `options` JSON object
    /// (`{}` when none); an error refuses the configuration.
    fn new(options: &str) -> Result<Self, String>;

    /// The methods [`WorkerExtension::call`] accepts; the engine reaches
    /// each as `<name>.<method>`.
    fn methods(&self) -> Vec<String>;

    /// Runs `method` with `args` (JSON text: what `collective_rpc` was
    /// given, `null` when nothing) and returns its answer as JSON text.
    fn call(&mut self, method: &str, args: &str, host: &mut dyn Host) -> Result<String, String>;
}

/// Exports a [`WorkerExtension`] as the component's
/// `engine:plugins/worker-extension` interface. Use it once, at the crate
/// root of a `cdylib` built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_worker_extension {
    ($ext:ty) => {
        const _: () = {
            use $crate::worker_extension::bindings::exports::engine::plugins::worker_extension as __wit;
            struct __Export;
            impl __wit::Guest for __Export {
                fn metadata() -> __wit::PluginMetadata {
                    $crate::types::wit_metadata(
                        <$ext as $crate::worker_extension::WorkerExtension>::metadata(),
                        $crate::types::PluginKind::WorkerExtension,
                    )
                }
                fn init(options: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    let ext = <$ext as $crate::worker_extension::WorkerExtension>::new(&options)?;
                    $crate::state::set(ext);
                    Ok(())
                }
                fn methods() -> ::std::vec::Vec<::std::string::String> {
                    $crate::state::with(|e: &mut $ext| $crate::worker_extension::WorkerExtension::methods(e))
                }
                fn call(
                    method: ::std::string::String,
                    args: ::std::string::String,
                ) -> ::std::result::Result<::std::string::String, ::std::string::String> {
                    $crate::state::with(|e: &mut $ext| {
                        $crate::worker_extension::WorkerExtension::call(
                            e,
                            &method,
                            &args,
                            &mut $crate::worker_extension::WorkerHost,
                        )
                    })
                }
            }
            #[cfg(target_arch = "wasm32")]
            $crate::worker_extension::bindings::__export_worker_extension_world!(__Export with_types_in $crate::worker_extension::bindings);
        };
    };
}
