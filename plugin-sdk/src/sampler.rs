//! Samplers: the trait, its plain data types and
//! [`export_sampler!`](crate::export_sampler).
//!
//! Once per step the host hands a sampler every row it samples as that
//! request's `k` most likely tokens (after its penalties, logits processors
//! and temperature; greedy rows at temperature 1), most likely first, with
//! their log-probabilities over the whole vocabulary and one uniform in
//! [0, 1) drawn from the request's own seeded generator. The sampler answers
//! one candidate position per row.

/// The WIT bindings of this kind's world: `engine:plugins@0.4.0`, or
/// `0.2.0` with the `wit-0-2` feature (both vendored in `plugin-sdk/wit/`).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        path: "wit/v0.4.0",
        world: "engine:plugins/sampler-plugin@0.4.0",
        with: {
            "engine:plugins/logging@0.4.0": crate::log::bindings::engine::plugins::logging,
            "engine:plugins/types@0.4.0": crate::types::bindings::engine::plugins::types,
        },
        pub_export_macro: true,
        export_macro_name: "__export_sampler_world",
        default_bindings_module: "plugin_sdk::sampler::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "engine:plugins/sampler-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::types::bindings::engine::plugins::types },
        pub_export_macro: true,
        export_macro_name: "__export_sampler_world",
        default_bindings_module: "plugin_sdk::sampler::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

pub use crate::{Metadata, OptionSpec};
use bindings::exports::engine::plugins::sampler as wit;

/// One step's rows and their candidates as parallel columns (`token_ids`
/// and `logprobs` are `ids.len() * k`, row-major), plus the requests that
/// entered (with their `extra_args` JSON) and left the batch since the last
/// call.
pub type Candidates = wit::Candidates;

/// Row views over [`Candidates`].
pub trait CandidatesExt {
    /// Row `row`'s candidate token ids, most likely first.
    fn row_tokens(&self, row: usize) -> &[u32];
    /// Row `row`'s candidate logprobs, same order.
    fn row_logprobs(&self, row: usize) -> &[f32];
}

impl CandidatesExt for Candidates {
    fn row_tokens(&self, row: usize) -> &[u32] {
        let k = self.k as usize;
        &self.token_ids[row * k..(row + 1) * k]
    }

    fn row_logprobs(&self, row: usize) -> &[f32] {
        let k = self.k as usize;
        &self.logprobs[row * k..(row + 1) * k]
    }
}

/// A sampler. One value lives per plugin instance; the host calls `choose`
/// once per step with every row it samples.
pub trait Sampler: Sized + 'static {
    /// Name (`namespace:name`), version and options.
    fn metadata() -> Metadata;

    /// Builds the sampler from the configuration's `options` JSON object
    /// (`{}` when none); an error refuses the configuration.
    fn new(options: &str) -> Result<Self, String>;

    /// For each row, the position (below `k`) of the chosen candidate.
    /// `batch.added_ids` / `added_extra_args` announce new requests once;
    /// `batch.removed_ids` those that left.
    fn choose(&mut self, batch: &Candidates) -> Result<Vec<u32>, String>;
}

/// Exports a [`Sampler`] as the component's `engine:plugins/sampler`
/// interface. Use it once, at the crate root of a `cdylib` built for
/// `wasm32-wasip2`.
#[macro_export]
macro_rules! export_sampler {
    ($sampler:ty) => {
        const _: () = {
            use $crate::sampler::bindings::exports::engine::plugins::sampler as __wit;
            struct __Export;
            impl __wit::Guest for __Export {
                fn metadata() -> __wit::PluginMetadata {
                    $crate::types::wit_metadata(
                        <$sampler as $crate::sampler::Sampler>::metadata(),
                        $crate::types::PluginKind::Sampler,
                    )
                }
                fn init(
                    options: ::std::string::String,
                ) -> ::std::result::Result<(), ::std::string::String> {
                    let s = <$sampler as $crate::sampler::Sampler>::new(&options)?;
                    $crate::state::set(s);
                    Ok(())
                }
                fn choose(
                    batch: __wit::Candidates,
                ) -> ::std::result::Result<::std::vec::Vec<u32>, ::std::string::String> {
                    $crate::state::with(|s: &mut $sampler| {
                        $crate::sampler::Sampler::choose(s, &batch)
                    })
                }
            }
            // Native builds (the plugin's unit tests) export nothing: the
            // component symbol names are not valid native linker names.
            #[cfg(target_arch = "wasm32")]
            $crate::sampler::bindings::__export_sampler_world!(
                __Export with_types_in $crate::sampler::bindings
            );
        };
    };
}
