//! Logits processors: the trait, its plain data types and
//! [`export_logits_processor!`](crate::export_logits_processor).

/// The WIT bindings of this kind's world: `engine:plugins@0.3.0`, or
/// `0.2.0` with the `wit-0-2` feature (both vendored in `plugin-sdk/wit/`).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        path: "wit/v0.3.0",
        world: "engine:plugins/logits-processor-plugin@0.3.0",
        with: { "engine:plugins/logging@0.3.0": crate::log::bindings::engine::plugins::logging },
        pub_export_macro: true,
        export_macro_name: "__export_logits_processor_world",
        default_bindings_module: "plugin_sdk::logits_processor::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "engine:plugins/logits-processor-plugin@0.2.0",
        pub_export_macro: true,
        export_macro_name: "__export_logits_processor_world",
        default_bindings_module: "plugin_sdk::logits_processor::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

pub use crate::{Metadata, OptionSpec};
use bindings::exports::engine::plugins::logits_processor as wit;

/// One step's rows as parallel columns, plus the requests that entered
/// (with their `extra_args` JSON) and left the batch since the last call.
pub type Batch = wit::Batch;

/// Sparse edits as parallel lists (see [`Edits::ban`] and [`Edits::bias`]).
pub type Edits = wit::LogitEdits;

/// Builders for [`Edits`].
pub trait EditsExt {
    /// No edits.
    fn none() -> Self;
    /// Row `row` (a position in `Batch::ids`) must not sample `token`.
    fn ban(&mut self, row: u32, token: u32);
    /// Adds `value` (finite) to row `row`'s logit of `token`.
    fn bias(&mut self, row: u32, token: u32, value: f32);
}

impl EditsExt for Edits {
    fn none() -> Self {
        Edits {
            ban_rows: Vec::new(),
            ban_tokens: Vec::new(),
            bias_rows: Vec::new(),
            bias_tokens: Vec::new(),
            bias_values: Vec::new(),
        }
    }

    fn ban(&mut self, row: u32, token: u32) {
        self.ban_rows.push(row);
        self.ban_tokens.push(token);
    }

    fn bias(&mut self, row: u32, token: u32, value: f32) {
        self.bias_rows.push(row);
        self.bias_tokens.push(token);
        self.bias_values.push(value);
    }
}

/// A logits processor. One value lives per plugin instance; the host calls
/// `process` once per step with every row about to be sampled.
pub trait LogitsProcessor: Sized + 'static {
    /// Name (`namespace:name`), version and options.
    fn metadata() -> Metadata;

    /// Builds the processor from the configuration's `options` JSON object
    /// (`{}` when none); an error refuses the configuration.
    fn new(options: &str) -> Result<Self, String>;

    /// Edits for this step's rows. `batch.added_ids` / `added_extra_args`
    /// announce new requests once; `batch.removed_ids` those that left.
    fn process(&mut self, batch: &Batch) -> Result<Edits, String>;
}

#[doc(hidden)]
pub fn wit_metadata(m: Metadata) -> wit::PluginMetadata {
    wit::PluginMetadata {
        name: m.name,
        version: m.version,
        kind: bindings::engine::plugins::types::PluginKind::LogitsProcessor,
        options: m
            .options
            .into_iter()
            .map(|o| bindings::engine::plugins::types::PluginOption {
                name: o.name,
                description: o.description,
                default_json: o.default_json,
            })
            .collect(),
    }
}

/// Exports a [`LogitsProcessor`] as the component's
/// `engine:plugins/logits-processor` interface. Use it once, at the crate
/// root of a `cdylib` built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_logits_processor {
    ($processor:ty) => {
        const _: () = {
            use $crate::logits_processor::bindings::exports::engine::plugins::logits_processor as __wit;
            struct __Export;
            impl __wit::Guest for __Export {
                fn metadata() -> __wit::PluginMetadata {
                    $crate::logits_processor::wit_metadata(
                        <$processor as $crate::logits_processor::LogitsProcessor>::metadata(),
                    )
                }
                fn init(options: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    let p = <$processor as $crate::logits_processor::LogitsProcessor>::new(&options)?;
                    $crate::state::set(p);
                    Ok(())
                }
                fn process(batch: __wit::Batch) -> ::std::result::Result<__wit::LogitEdits, ::std::string::String> {
                    $crate::state::with(|p: &mut $processor| {
                        $crate::logits_processor::LogitsProcessor::process(p, &batch)
                    })
                }
            }
            // Native builds (the plugin's unit tests) export nothing: the
            // component symbol names are not valid native linker names.
            #[cfg(target_arch = "wasm32")]
            $crate::logits_processor::bindings::__export_logits_processor_world!(
                __Export with_types_in $crate::logits_processor::bindings
            );
        };
    };
}
