//! The `worker-extension-plugin` world, 0.2.x to 0.4.x, which imports
//! `host-api`: the 0.2 interface is implemented in
//! `crate::plugins::extension` (over the worker's [`HostApi`] lent for a
//! call), the 0.3 and 0.4 ones here, by delegating to it (its records are
//! moved across, not copied: a weight can be tens of MB).
//!
//! [`HostApi`]: crate::plugins::extension::HostApi

use wasmtime::Store;

use super::{move_fields, versioned_world, InstancePre, StoreState};

/// 0.4.x.
pub mod v0_4 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.4.0",
        world: "engine:plugins/worker-extension-plugin@0.4.0",
        with: {
            "engine:plugins/types@0.4.0": crate::plugins::bindings::types_v0_4,
            "engine:plugins/logging@0.4.0": crate::plugins::bindings::logging_v0_4,
        },
        imports: { default: trappable },
    });
}
/// 0.3.x.
pub mod v0_3 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.3.0",
        world: "engine:plugins/worker-extension-plugin@0.3.0",
        with: {
            "engine:plugins/types@0.3.0": crate::plugins::bindings::types_v0_3,
            "engine:plugins/logging@0.3.0": crate::plugins::bindings::logging_v0_3,
        },
        // A host-api call made outside a `call` traps rather than
        // answering for a worker that is not there.
        imports: { default: trappable },
    });
}
/// 0.2.x.
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.2.0",
        world: "engine:plugins/worker-extension-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::plugins::bindings::types_v0_2 },
        imports: { default: trappable },
    });
}
pub use v0_2::engine::plugins::host_api::{self, KvCacheStats, ModelInfo, Weight};

versioned_world!(
    WorkerExtensionPlugin, WorkerExtensionPluginPre, engine_plugins_worker_extension, Hooks;
    V0_4 => v0_4, super::kind_v0_4, "0.4";
    V0_3 => v0_3, super::kind_v0_3, "0.3";
    V0_2 => v0_2, super::kind_v0_2, "0.2";
);

impl WorkerExtensionPlugin {
    /// Calls `methods()`.
    pub fn methods(&self, store: &mut Store<StoreState>) -> wasmtime::Result<Vec<String>> {
        self.engine_plugins_worker_extension().call_methods(store)
    }

    /// Calls `call(method, args)`.
    pub fn call(
        &self,
        store: &mut Store<StoreState>,
        method: &str,
        args: &str,
    ) -> wasmtime::Result<Result<String, String>> {
        self.engine_plugins_worker_extension()
            .call_call(store, method, args)
    }
}

impl Hooks<'_> {
    /// `methods`.
    pub fn call_methods(&self, store: &mut Store<StoreState>) -> wasmtime::Result<Vec<String>> {
        match self.0 {
            WorkerExtensionPlugin::V0_4(w) => {
                w.engine_plugins_worker_extension().call_methods(store)
            }
            WorkerExtensionPlugin::V0_3(w) => {
                w.engine_plugins_worker_extension().call_methods(store)
            }
            WorkerExtensionPlugin::V0_2(w) => {
                w.engine_plugins_worker_extension().call_methods(store)
            }
        }
    }

    /// `call`.
    pub fn call_call(
        &self,
        store: &mut Store<StoreState>,
        method: &str,
        args: &str,
    ) -> wasmtime::Result<Result<String, String>> {
        match self.0 {
            WorkerExtensionPlugin::V0_4(w) => w
                .engine_plugins_worker_extension()
                .call_call(store, method, args),
            WorkerExtensionPlugin::V0_3(w) => w
                .engine_plugins_worker_extension()
                .call_call(store, method, args),
            WorkerExtensionPlugin::V0_2(w) => w
                .engine_plugins_worker_extension()
                .call_call(store, method, args),
        }
    }
}

/// Implements a newer version's `host-api` (module `$m`) by delegating to
/// the 0.2 one; the records are the same, by other types.
macro_rules! delegate_host_api {
    ($m:ident) => {
        impl $m::engine::plugins::host_api::Host for StoreState {
            fn get_model_info(&mut self) -> wasmtime::Result<$m::engine::plugins::host_api::ModelInfo> {
                use $m::engine::plugins::host_api as new;
                let m = host_api::Host::get_model_info(self)?;
                Ok(move_fields!(m => new::ModelInfo {
                    name, architecture, num_layers, hidden_size, intermediate_size, vocab_size,
                    num_heads, num_kv_heads, max_model_len, dtype
                }))
            }

            fn weight_names(&mut self) -> wasmtime::Result<Vec<String>> {
                host_api::Host::weight_names(self)
            }

            fn read_weight(
                &mut self,
                name: String,
            ) -> wasmtime::Result<Result<$m::engine::plugins::host_api::Weight, String>> {
                use $m::engine::plugins::host_api as new;
                let w = host_api::Host::read_weight(self, name)?;
                Ok(w.map(|w| move_fields!(w => new::Weight { shape, dtype, values })))
            }

            fn update_weight(
                &mut self,
                name: String,
                values: Vec<f32>,
            ) -> wasmtime::Result<Result<(), String>> {
                host_api::Host::update_weight(self, name, values)
            }

            fn get_kv_cache_stats(
                &mut self,
            ) -> wasmtime::Result<$m::engine::plugins::host_api::KvCacheStats> {
                use $m::engine::plugins::host_api as new;
                let s = host_api::Host::get_kv_cache_stats(self)?;
                Ok(move_fields!(s => new::KvCacheStats {
                    num_blocks, block_size, bytes_per_block, num_layers, num_kv_heads, head_dim
                }))
            }
        }
    };
}
delegate_host_api!(v0_3);
delegate_host_api!(v0_4);

/// Links `host-api` (every version of it the host serves) into `linker`.
pub fn add_host_api(linker: &mut wasmtime::component::Linker<StoreState>) -> wasmtime::Result<()> {
    use wasmtime::component::HasSelf;
    host_api::add_to_linker::<StoreState, HasSelf<StoreState>>(linker, |s| s)?;
    v0_3::engine::plugins::host_api::add_to_linker::<StoreState, HasSelf<StoreState>>(
        linker,
        |s| s,
    )?;
    v0_4::engine::plugins::host_api::add_to_linker::<StoreState, HasSelf<StoreState>>(linker, |s| s)
}
