//! Making plugins known and resolving them by qualified name.
//!
//! Every file named by `--plugin` / `plugins.paths`, and every `*.wasm` in
//! `plugins.dirs`, is compiled (or loaded from the cache), checked against
//! the WIT versions this host speaks, linked once (`InstancePre`), and asked
//! for its metadata. Configuration keys then pick plugins by the name they
//! declare (`scheduler.policy = "engine:shortest-prompt-first"`); built-ins
//! have names too (`builtin:fcfs`), and an unknown name lists what exists.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmtime::component::types::ComponentItem;
use wasmtime::component::Component;

use super::bindings::{self, extension, policy, processor};
use super::extension::WorkerExtension;
use super::instance::{Sandboxed, World};
use super::policy::WasmPolicy;
use super::processor::LogitsProcessors;
use super::runtime::{describe_fault, PluginRuntime};
use super::sampler::SamplerPlugin;
use super::{OnError, PluginError, PluginKind};

/// The WIT package this host implements, and the versions it accepts.
pub const WIT_PACKAGE: &str = "engine:plugins";
/// The accepted versions of [`WIT_PACKAGE`] (any patch of these minors;
/// `wit/v<minor>` holds each).
pub const SUPPORTED_WIT: &str = "engine:plugins@0.1.x, @0.2.x, @0.3.x and @0.4.x";

/// One option a plugin accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionInfo {
    /// Its key in the options object.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Its default, as JSON.
    pub default_json: String,
}

/// What a known plugin declares, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// The component file.
    pub path: PathBuf,
    /// Qualified name `namespace:name`.
    pub name: String,
    /// The plugin's own version.
    pub version: String,
    /// Its kind.
    pub kind: PluginKind,
    /// The WIT package version it was built against, e.g. `engine:plugins@0.1.0`.
    pub wit_version: String,
    /// Every interface the component exports.
    pub exports: Vec<String>,
    /// The options it accepts.
    pub options: Vec<OptionInfo>,
}

/// A known plugin, linked and ready to instantiate.
enum Linked {
    Policy(Arc<<policy::SchedulingPolicyPlugin as World>::Pre>),
    Processor(Arc<<processor::LogitsProcessorPlugin as World>::Pre>),
    Extension(Arc<<extension::WorkerExtensionPlugin as World>::Pre>),
    Sampler(Arc<<bindings::sampler::SamplerPlugin as World>::Pre>),
}

/// The known plugins and the runtime they run in.
pub struct PluginHost {
    runtime: Arc<PluginRuntime>,
    known: Vec<(PluginInfo, Linked)>,
    /// Options JSON by plugin name (`{}` when absent).
    options: std::collections::BTreeMap<String, String>,
    on_error: OnError,
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("plugins", &self.plugins().collect::<Vec<_>>())
            .finish()
    }
}

/// `engine:plugins/<interface>@<version>` split, or `None` for other names.
fn split_export(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix(WIT_PACKAGE)?.strip_prefix('/')?;
    rest.split_once('@')
}

/// True for `0.1.x` to `0.4.x`.
fn version_supported(version: &str) -> bool {
    let mut parts = version.split('.');
    parts.next() == Some("0") && matches!(parts.next(), Some("1" | "2" | "3" | "4"))
}

/// A qualified name: `namespace:name`, each part non-empty lowercase
/// letters, digits and `-`.
pub fn is_qualified_name(name: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    };
    matches!(name.split_once(':'), Some((ns, n)) if part(ns) && part(n))
}

impl PluginHost {
    /// Loads `paths` and every `*.wasm` in `dirs` (sorted by name).
    pub fn load(
        runtime: Arc<PluginRuntime>,
        paths: &[PathBuf],
        dirs: &[PathBuf],
        options: std::collections::BTreeMap<String, String>,
        on_error: OnError,
    ) -> Result<PluginHost, PluginError> {
        let mut files = paths.to_vec();
        for dir in dirs {
            let entries = std::fs::read_dir(dir).map_err(|source| PluginError::Io {
                path: dir.clone(),
                source,
            })?;
            let mut found: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
                .collect();
            found.sort();
            files.extend(found);
        }
        let mut host = PluginHost {
            runtime,
            known: Vec::new(),
            options,
            on_error,
        };
        for path in files {
            let (info, linked) = host.link(&path)?;
            if let Some((first, _)) = host.known.iter().find(|(k, _)| k.name == info.name) {
                if first.path == info.path {
                    continue;
                }
                return Err(PluginError::Duplicate {
                    name: info.name,
                    first: first.path.clone(),
                    second: path,
                });
            }
            host.known.push((info, linked));
        }
        for name in host.options.keys() {
            if !host.known.iter().any(|(k, _)| &k.name == name) {
                return Err(PluginError::Config(format!(
                    "options are given for {name:?}, but no known plugin has that name; known: {}",
                    host.names(None)
                )));
            }
        }
        Ok(host)
    }

    /// Reads one component's metadata without keeping it (`host plugin inspect`).
    pub fn inspect(runtime: Arc<PluginRuntime>, path: &Path) -> Result<PluginInfo, PluginError> {
        let host = PluginHost {
            runtime,
            known: Vec::new(),
            options: Default::default(),
            on_error: OnError::Fallback,
        };
        Ok(host.link(path)?.0)
    }

    /// The known plugins.
    pub fn plugins(&self) -> impl Iterator<Item = &PluginInfo> {
        self.known.iter().map(|(info, _)| info)
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<PluginRuntime> {
        &self.runtime
    }

    fn link(&self, path: &Path) -> Result<(PluginInfo, Linked), PluginError> {
        let bytes = std::fs::read(path).map_err(|source| PluginError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let compile = |e: wasmtime::Error| PluginError::Compile {
            path: path.to_path_buf(),
            message: format!("{e:#}"),
        };
        let component = self.runtime.load_component(&bytes).map_err(compile)?;
        let (exports, kind, wit_version) = self.check_exports(path, &component)?;
        let pre = self.runtime.instance_pre(&component).map_err(compile)?;
        let bad = |message: String| PluginError::BadMetadata {
            path: path.to_path_buf(),
            message,
        };
        let rt = &self.runtime;
        let deadline = rt.limits().init_deadline;
        let label = path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        let mut store = rt.new_store(&label);
        let fault = |e: wasmtime::Error| {
            bad(format!(
                "metadata() failed: {}",
                describe_fault(&e, rt.limits(), deadline)
            ))
        };
        // Instantiates the kind's world (every WIT version behind one type)
        // and asks for its metadata.
        macro_rules! metadata_of {
            ($world:ty) => {{
                let pre = <$world as World>::pre(pre).map_err(compile)?;
                let m = rt
                    .call(&mut store, deadline, |s| {
                        <$world as World>::instantiate(&pre, s)?.metadata(s)
                    })
                    .map_err(fault)?;
                (m, pre)
            }};
        }
        let (meta, linked) = match kind {
            PluginKind::SchedulingPolicy => {
                let (m, pre) = metadata_of!(policy::SchedulingPolicyPlugin);
                (m, Linked::Policy(Arc::new(pre)))
            }
            PluginKind::LogitsProcessor => {
                let (m, pre) = metadata_of!(processor::LogitsProcessorPlugin);
                (m, Linked::Processor(Arc::new(pre)))
            }
            PluginKind::WorkerExtension => {
                let (m, pre) = metadata_of!(extension::WorkerExtensionPlugin);
                (m, Linked::Extension(Arc::new(pre)))
            }
            PluginKind::Sampler => {
                let (m, pre) = metadata_of!(bindings::sampler::SamplerPlugin);
                (m, Linked::Sampler(Arc::new(pre)))
            }
        };
        let bindings::Metadata {
            name,
            version,
            kind: declared,
            options,
        } = meta;
        let options = options
            .into_iter()
            .map(|(name, description, default_json)| OptionInfo {
                name,
                description,
                default_json,
            })
            .collect();
        if !is_qualified_name(&name) {
            return Err(bad(format!(
                "name {name:?} is not `namespace:name` (lowercase letters, digits, `-`)"
            )));
        }
        if declared != kind {
            return Err(bad(format!(
                "declares itself a {declared} but exports the {kind} interface"
            )));
        }
        let info = PluginInfo {
            path: path.to_path_buf(),
            name,
            version,
            kind,
            wit_version,
            exports,
            options,
        };
        Ok((info, linked))
    }

    /// The exported interface names, the kind they make the plugin, and the
    /// WIT version; refuses other packages and versions with what the
    /// plugin was built against.
    fn check_exports(
        &self,
        path: &Path,
        component: &Component,
    ) -> Result<(Vec<String>, PluginKind, String), PluginError> {
        let ty = component.component_type();
        // Interfaces only (`namespace:package/interface@version`): toolchains
        // add plain-named instances of their own (componentize-py's
        // `exports`), which are no part of the plugin's contract.
        let exports: Vec<String> = ty
            .exports(self.runtime.engine())
            .filter(|(name, item)| {
                matches!(item.ty, ComponentItem::ComponentInstance(_)) && name.contains(':')
            })
            .map(|(name, _)| name.to_string())
            .collect();
        let ours: Vec<(&str, &str)> = exports.iter().filter_map(|e| split_export(e)).collect();
        let Some((interface, version)) = ours.first().map(|&(i, v)| (i.to_string(), v.to_string()))
        else {
            return Err(PluginError::NotAPlugin {
                path: path.to_path_buf(),
                exports: exports.join(", "),
            });
        };
        drop(ours);
        if !version_supported(&version) {
            return Err(PluginError::IncompatibleVersion {
                path: path.to_path_buf(),
                built_against: format!("{WIT_PACKAGE}@{version}"),
                supported: SUPPORTED_WIT.to_string(),
            });
        }
        let kind = match interface.as_str() {
            "scheduling-policy" => PluginKind::SchedulingPolicy,
            "logits-processor" => PluginKind::LogitsProcessor,
            "worker-extension" => PluginKind::WorkerExtension,
            "sampler" => PluginKind::Sampler,
            other => {
                return Err(PluginError::NotAPlugin {
                    path: path.to_path_buf(),
                    exports: format!("{} (unknown interface {other:?})", exports.join(", ")),
                })
            }
        };
        Ok((exports, kind, format!("{WIT_PACKAGE}@{version}")))
    }

    /// Known plugins' names, of `kind` when given (the scheduler adds its
    /// built-in policies to the list).
    pub fn names(&self, kind: Option<PluginKind>) -> String {
        let all: Vec<&str> = self
            .plugins()
            .filter(|p| kind.is_none_or(|k| p.kind == k))
            .map(|p| p.name.as_str())
            .collect();
        if all.is_empty() {
            "none (make plugins known with --plugin FILE.wasm or plugins.dirs)".into()
        } else {
            all.join(", ")
        }
    }

    fn find(
        &self,
        key: &'static str,
        name: &str,
        wanted: PluginKind,
    ) -> Result<&(PluginInfo, Linked), PluginError> {
        let found = self.known.iter().find(|(info, _)| info.name == name);
        let Some(entry) = found else {
            return Err(PluginError::Unknown {
                name: name.to_string(),
                kind: wanted,
                available: self.names(Some(wanted)),
            });
        };
        if entry.0.kind != wanted {
            let info = &entry.0;
            return Err(PluginError::WrongKind {
                key,
                name: name.to_string(),
                path: info.path.clone(),
                found: info.kind,
                wanted,
            });
        }
        Ok(entry)
    }

    fn options_of(&self, name: &str) -> &str {
        self.options.get(name).map_or("{}", String::as_str)
    }

    /// The known plugin `name` of kind `wanted`, instantiated and
    /// initialised with its options; `pre` picks that kind's linked
    /// component (it matches whenever `find` accepted the kind).
    fn instantiate<W: World>(
        &self,
        key: &'static str,
        name: &str,
        wanted: PluginKind,
        pre: impl Fn(&Linked) -> Option<&Arc<W::Pre>>,
    ) -> Result<Sandboxed<W>, PluginError> {
        let (info, linked) = self.find(key, name, wanted)?;
        let pre = pre(linked).expect("find checked the kind").clone();
        Sandboxed::new(&info.name, self.options_of(name), self.runtime.clone(), pre)
    }

    /// The scheduling-policy plugin named `name`, instantiated and
    /// initialised with its options (the scheduler puts it behind its
    /// `SchedulingPolicy` seam: `scheduler::policy_from_host`).
    pub fn wasm_policy(&self, name: &str) -> Result<WasmPolicy, PluginError> {
        let plugin = self.instantiate(
            "scheduler.policy",
            name,
            PluginKind::SchedulingPolicy,
            |l| match l {
                Linked::Policy(pre) => Some(pre),
                _ => None,
            },
        )?;
        Ok(WasmPolicy::new(plugin, self.on_error))
    }

    /// The worker extension named `name` (`worker.extension`),
    /// instantiated and initialised with its options.
    pub fn worker_extension(&self, name: &str) -> Result<WorkerExtension, PluginError> {
        let plugin = self.instantiate(
            "worker.extension",
            name,
            PluginKind::WorkerExtension,
            |l| match l {
                Linked::Extension(pre) => Some(pre),
                _ => None,
            },
        )?;
        WorkerExtension::new(plugin)
    }

    /// The logits processors named in `names`, in order; `None` when the
    /// list is empty.
    pub fn logits_processors(
        &self,
        names: &[String],
    ) -> Result<Option<LogitsProcessors>, PluginError> {
        if names.is_empty() {
            return Ok(None);
        }
        let mut plugins = Vec::new();
        for name in names {
            plugins.push(self.instantiate(
                "plugins.logits_processors",
                name,
                PluginKind::LogitsProcessor,
                |l| match l {
                    Linked::Processor(pre) => Some(pre),
                    _ => None,
                },
            )?);
        }
        Ok(Some(LogitsProcessors::new(plugins, self.on_error)))
    }

    /// The sampler named `name` (`plugins.sampler`), choosing among `top_k`
    /// host-computed candidates per row; `None` when `name` is empty.
    pub fn sampler(&self, name: &str, top_k: usize) -> Result<Option<SamplerPlugin>, PluginError> {
        if name.is_empty() {
            return Ok(None);
        }
        if top_k == 0 {
            return Err(PluginError::Config(
                "plugins.sampler_top_k = 0; the sampler needs at least 1 candidate per row".into(),
            ));
        }
        let plugin =
            self.instantiate("plugins.sampler", name, PluginKind::Sampler, |l| match l {
                Linked::Sampler(pre) => Some(pre),
                _ => None,
            })?;
        Ok(Some(SamplerPlugin::new(plugin, top_k, self.on_error)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_and_versions() {
        assert_eq!(
            split_export("engine:plugins/scheduling-policy@0.1.0"),
            Some(("scheduling-policy", "0.1.0"))
        );
        assert_eq!(split_export("wasi:cli/run@0.2.0"), None);
        assert!(version_supported("0.1.0") && version_supported("0.1.7"));
        assert!(version_supported("0.2.0") && version_supported("0.2.3"));
        assert!(version_supported("0.3.0") && version_supported("0.3.1"));
        assert!(version_supported("0.4.0"));
        assert!(
            !version_supported("0.5.0")
                && !version_supported("0.9.0")
                && !version_supported("1.1.0")
                && !version_supported("0.10.0")
        );
    }

    #[test]
    fn qualified_names() {
        assert!(is_qualified_name("engine:shortest-prompt-first"));
        for bad in ["fcfs", ":x", "x:", "Acme:x", "a:b:c", "a b:c"] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
    }
}
