//! Host-side bindings of `wit/v0.1.0/plugins.wit`, one module per world, generated
//! by wasmtime at compile time (sync calls: component-model async costs
//! 10-20x more per call).

/// The `scheduling-policy-plugin` world.
pub mod policy {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1.0",
        world: "engine:plugins/scheduling-policy-plugin@0.1.0",
    });
    pub use exports::engine::plugins::scheduling_policy::{RunningBatch, WaitingQueue};
}

/// The `logits-processor-plugin` world.
pub mod processor {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1.0",
        world: "engine:plugins/logits-processor-plugin@0.1.0",
    });
    pub use exports::engine::plugins::logits_processor::{Batch, LogitEdits};
}
