//! The `sampler-plugin` world, 0.2.x to 0.4.x.

use wasmtime::Store;

use super::{convert, versioned_world, InstancePre, StoreState};

/// 0.4.x: the newest, whose records every version uses.
pub mod v0_4 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.4.0",
        world: "engine:plugins/sampler-plugin@0.4.0",
        with: {
            "engine:plugins/types@0.4.0": crate::plugins::bindings::types_v0_4,
            "engine:plugins/logging@0.4.0": crate::plugins::bindings::logging_v0_4,
        },
    });
}
/// 0.3.x.
pub mod v0_3 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.3.0",
        world: "engine:plugins/sampler-plugin@0.3.0",
        with: {
            "engine:plugins/types@0.3.0": crate::plugins::bindings::types_v0_3,
            "engine:plugins/logging@0.3.0": crate::plugins::bindings::logging_v0_3,
        },
    });
}
/// 0.2.x.
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.2.0",
        world: "engine:plugins/sampler-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::plugins::bindings::types_v0_2 },
    });
}

pub use v0_4::exports::engine::plugins::sampler::Candidates;

versioned_world!(
    SamplerPlugin, SamplerPluginPre, engine_plugins_sampler, Hooks;
    V0_4 => v0_4, super::kind_v0_4, "0.4";
    V0_3 => v0_3, super::kind_v0_3, "0.3";
    V0_2 => v0_2, super::kind_v0_2, "0.2";
);

/// An older version's `candidates` from the newest's.
macro_rules! old_candidates {
    ($m:ident, $batch:expr) => {
        convert!($batch => $m::exports::engine::plugins::sampler::Candidates {
            added_ids, added_extra_args, removed_ids, ids, k, token_ids, logprobs, uniforms
        })
    };
}

impl Hooks<'_> {
    /// `choose`.
    pub fn call_choose(
        &self,
        store: &mut Store<StoreState>,
        batch: &Candidates,
    ) -> wasmtime::Result<Result<Vec<u32>, String>> {
        match self.0 {
            SamplerPlugin::V0_4(w) => w.engine_plugins_sampler().call_choose(store, batch),
            SamplerPlugin::V0_3(w) => w
                .engine_plugins_sampler()
                .call_choose(store, &old_candidates!(v0_3, batch)),
            SamplerPlugin::V0_2(w) => w
                .engine_plugins_sampler()
                .call_choose(store, &old_candidates!(v0_2, batch)),
        }
    }
}
