//! Scheduling policies: the trait, its plain data types and
//! [`export_policy!`](crate::export_policy).

/// The WIT bindings of this kind's world: `engine:plugins@0.4.0`, or
/// `0.2.0` with the `wit-0-2` feature (both vendored in `plugin-sdk/wit/`).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        path: "wit/v0.4.0",
        world: "engine:plugins/scheduling-policy-plugin@0.4.0",
        with: {
            "engine:plugins/logging@0.4.0": crate::log::bindings::engine::plugins::logging,
            "engine:plugins/types@0.4.0": crate::types::bindings::engine::plugins::types,
        },
        pub_export_macro: true,
        export_macro_name: "__export_policy_world",
        default_bindings_module: "plugin_sdk::policy::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "engine:plugins/scheduling-policy-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::types::bindings::engine::plugins::types },
        pub_export_macro: true,
        export_macro_name: "__export_policy_world",
        default_bindings_module: "plugin_sdk::policy::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

pub use crate::{Metadata, OptionSpec};
use bindings::exports::engine::plugins::scheduling_policy as wit;

/// The waiting queue as parallel columns, in arrival order (preempted
/// requests first): position `i` of every list is the same request.
pub type WaitingQueue = wit::WaitingQueue;

/// The running batch as parallel columns, earliest admitted first.
pub type RunningBatch = wit::RunningBatch;

/// A scheduling policy. One value lives per plugin instance; the host calls
/// its hooks once per engine step from one thread.
pub trait SchedulingPolicy: Sized + 'static {
    /// Name (`namespace:name`), version and options.
    fn metadata() -> Metadata;

    /// Builds the policy from the configuration's `options` JSON object
    /// (`{}` when none); an error refuses the configuration.
    fn new(options: &str) -> Result<Self, String>;

    /// Positions in `queue` to try to admit, in order; positions left out
    /// wait this step. Each must be below `queue.ids.len()` and appear once.
    fn order_waiting(&mut self, queue: &WaitingQueue) -> Vec<u32>;

    /// The position in `running` (never empty) of the request to preempt
    /// when KV blocks run out; `None` (the default) lets the host preempt
    /// the most recently admitted request.
    fn pick_victim(&mut self, running: &RunningBatch) -> Option<u32> {
        let _ = running;
        None
    }
}

/// Exports a [`SchedulingPolicy`] as the component's
/// `engine:plugins/scheduling-policy` interface. Use it once, at the crate
/// root of a `cdylib` built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        const _: () = {
            use $crate::policy::bindings::exports::engine::plugins::scheduling_policy as __wit;
            struct __Export;
            impl __wit::Guest for __Export {
                fn metadata() -> __wit::PluginMetadata {
                    $crate::types::wit_metadata(
                        <$policy as $crate::policy::SchedulingPolicy>::metadata(),
                        $crate::types::PluginKind::SchedulingPolicy,
                    )
                }
                fn init(options: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    let policy = <$policy as $crate::policy::SchedulingPolicy>::new(&options)?;
                    $crate::state::set(policy);
                    Ok(())
                }
                fn order_waiting(queue: __wit::WaitingQueue) -> ::std::vec::Vec<u32> {
                    $crate::state::with(|p: &mut $policy| {
                        $crate::policy::SchedulingPolicy::order_waiting(p, &queue)
                    })
                }
                fn pick_victim(running: __wit::RunningBatch) -> ::std::option::Option<u32> {
                    $crate::state::with(|p: &mut $policy| {
                        $crate::policy::SchedulingPolicy::pick_victim(p, &running)
                    })
                }
            }
            // Native builds (the plugin's unit tests) export nothing: the
            // component symbol names are not valid native linker names.
            #[cfg(target_arch = "wasm32")]
            $crate::policy::bindings::__export_policy_world!(__Export with_types_in $crate::policy::bindings);
        };
    };
}
