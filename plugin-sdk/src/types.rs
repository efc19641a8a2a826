//! The `engine:plugins/types` interface, generated once: every kind's
//! bindings take its types from here (`with`), so a [`Metadata`] becomes the
//! WIT's `plugin-metadata` in one place whatever the kind.

use crate::Metadata;

/// Bindings of a world that only imports `types` (the interface has no
/// functions, so the component gains no import from it).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        inline: "package plugin-sdk:types; world types { import engine:plugins/types@0.4.0; }",
        path: "wit/v0.4.0",
        with: { "engine:plugins/types@0.4.0": generate },
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        inline: "package plugin-sdk:types; world types { import engine:plugins/types@0.2.0; }",
        path: "wit/v0.2.0",
        with: { "engine:plugins/types@0.2.0": generate },
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

#[doc(hidden)]
pub use bindings::engine::plugins::types::{PluginKind, PluginMetadata, PluginOption};

/// `m` as the `metadata` export returns it for a plugin of `kind`.
#[doc(hidden)]
pub fn wit_metadata(m: Metadata, kind: PluginKind) -> PluginMetadata {
    PluginMetadata {
        name: m.name,
        version: m.version,
        kind,
        options: m
            .options
            .into_iter()
            .map(|o| PluginOption {
                name: o.name,
                description: o.description,
                default_json: o.default_json,
            })
            .collect(),
    }
}
