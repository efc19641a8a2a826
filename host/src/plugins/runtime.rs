//! The wasmtime side: one `Engine` for every plugin, the sandbox every
//! instance runs in, and the per-call deadline.
//!
//! The sandbox: a plugin imports nothing from the host but `logging` (and a
//! worker extension `host-api`), the environment it sees is empty, its
//! stdout and stderr go to the host's log under its name, rate-limited
//! ([`super::log`]), and every other WASI import a guest's standard library
//! pulls in (filesystem, sockets, clocks, randomness, stdin) is linked to a
//! function that traps with the import's name, so "no filesystem, network,
//! environment or clock" holds by construction. The one exception is
//! `wasi:random/insecure-seed`, which answers a fixed seed: a guest's
//! standard library asks it to key its hash maps (serde_json's
//! `preserve_order` maps, for one), so trapping would break ordinary code,
//! and a constant reveals nothing and keeps a plugin deterministic. Likewise
//! the monotonic clock's `now` answers a frozen 0 (time never passes) rather
//! than trapping: libraries time themselves for statistics (llguidance,
//! which the structured-output plugin is built on, does), and a frozen
//! clock gives away nothing; waiting on it still traps. Memory is capped for the
//! plugin as a whole, every linear memory of the component together, and
//! tables and instances are bounded ([`super::limiter`]; a refused grow
//! traps, so running out is reported, not hidden in a guest `null`), and
//! every call runs under an epoch deadline: a ticker thread advances the
//! engine's epoch every millisecond while calls happen and parks once they
//! stop ([`super::ticker`]), so an idle engine stays idle.
//!
//! The one capability the configuration can grant is a directory
//! (`[[plugins.grants]]`), preopened with cap-std through wasmtime-wasi,
//! read-only unless `writable`. Its `wasi:filesystem` and `wasi:io`
//! interfaces are linked for every plugin, but `get-directories`, the only
//! way to a file descriptor, traps for a plugin without a grant, so an
//! ungranted plugin sees the same trap as before. A writable grant may not
//! contain the compiled-component cache ([`super::cache`]): the plugin
//! could plant native code there that the host would load.

use std::path::PathBuf;
use std::time::Duration;

use wasmtime::component::types::ComponentItem;
use wasmtime::component::{
    Component, HasData, InstancePre, Linker, Resource, ResourceTable, ResourceType,
};
use wasmtime::{Config, Engine, Store, Trap};
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::filesystem::{
    Descriptor, WasiFilesystem, WasiFilesystemCtxView, WasiFilesystemView,
};
use wasmtime_wasi::p2::bindings::{cli as wasi_cli, filesystem::preopens, sync as wasi};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::cache::CompiledCache;
use super::cache_guard;
use super::limiter::{LimitExceeded, PluginLimiter};
use super::log::{GuestOutput, PluginLog};
use super::ticker::{Ticker, TICK};

/// Sandbox limits for every instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Wall-clock budget of one per-step hook call...
    pub deadline: Duration,
    /// ...plus this for each request the call carries.
    pub deadline_per_request: Duration,
    /// Wall-clock budget of `init` and `metadata`.
    pub init_deadline: Duration,
    /// Linear memory one instance may grow to, in bytes: every memory of
    /// the component together.
    pub memory_bytes: usize,
}

/// A host directory granted to one plugin (`[[plugins.grants]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The plugin's qualified name.
    pub plugin: String,
    /// The directory on the host.
    pub dir: PathBuf,
    /// Where the plugin sees it, e.g. `/data`.
    pub guest: String,
    /// Whether the plugin may create, change and delete files in it.
    pub writable: bool,
}

/// What each `Store` carries: its limits and its WASI state (the granted
/// directories; empty for most plugins).
pub struct StoreState {
    limits: PluginLimiter,
    wasi: WasiCtx,
    table: ResourceTable,
    /// Whether any directory is granted; without one `get-directories` traps.
    granted: bool,
    /// The worker lent to a worker extension for the duration of one call
    /// (`super::extension`); `None` otherwise, when `host-api` traps.
    pub(super) host_api: Option<Box<dyn super::extension::HostApi>>,
    /// Where the guest's stdout, stderr and `log` calls go.
    output: GuestOutput,
}

impl StoreState {
    /// Bytes of linear memory the instance holds, all memories together.
    pub fn memory_used(&self) -> usize {
        self.limits.memory_used()
    }

    /// The guest's stdout and stderr, and the plugin's log.
    pub fn output(&self) -> &GuestOutput {
        &self.output
    }
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The store's resource table, for the `wasi:io` interfaces.
struct Io;

impl HasData for Io {
    type Data<'a> = &'a mut ResourceTable;
}

/// `wasi:filesystem/preopens` of one store: its granted directories, or a
/// trap when it has none.
struct GatedPreopens<'a> {
    granted: bool,
    fs: WasiFilesystemCtxView<'a>,
}

struct Preopens;

impl HasData for Preopens {
    type Data<'a> = GatedPreopens<'a>;
}

impl preopens::Host for GatedPreopens<'_> {
    fn get_directories(&mut self) -> wasmtime::Result<Vec<(Resource<Descriptor>, String)>> {
        if !self.granted {
            let import = "wasi:filesystem/preopens#get-directories".to_string();
            return Err(NotGranted(import).into());
        }
        preopens::Host::get_directories(&mut self.fs)
    }
}

/// Interfaces linked for real (the environment answers empty; files are
/// reachable only through a granted directory); every other import traps.
const LINKED_INTERFACES: &[&str] = &[
    "wasi:io/",
    "wasi:filesystem/",
    "wasi:cli/environment@",
    "wasi:cli/stdout@",
    "wasi:cli/stderr@",
    "wasi:random/insecure-seed@",
    "engine:plugins/host-api@",
    "engine:plugins/logging@",
];

/// What `wasi:random/insecure-seed` answers every plugin: any constant
/// will do (it keys hash maps, and determinism is the point).
const INSECURE_SEED: (u64, u64) = (0x5eed_0f9e_u64, 0x9e37_79b9_7f4a_7c15);

/// The monotonic clock's interface: its `now` and `resolution` answer
/// [`FROZEN_CLOCK_NS`], its other functions (waiting) trap.
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.";

/// What the frozen clock reads: time never passes inside a plugin, so a
/// guest that times itself (llguidance keeps statistics) runs, learns
/// nothing of the host, and stays deterministic.
const FROZEN_CLOCK_NS: u64 = 0;

/// The resources [`LINKED_INTERFACES`] define.
const LINKED_RESOURCES: &[&str] = &[
    "error",
    "pollable",
    "input-stream",
    "output-stream",
    "descriptor",
    "directory-entry-stream",
];

/// A host capability the sandbox does not grant this plugin.
#[derive(Debug)]
struct NotGranted(String);

impl std::fmt::Display for NotGranted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "used {}, a host capability the sandbox does not grant (grant a directory with [[plugins.grants]])",
            self.0
        )
    }
}

impl std::error::Error for NotGranted {}

/// The one wasmtime engine, its compiled-component cache and the sandbox
/// settings; shared by every plugin instance.
pub struct PluginRuntime {
    engine: Engine,
    /// `None`: compile every time (no cache configured, or its folder was
    /// refused).
    cache: Option<CompiledCache>,
    limits: Limits,
    grants: Vec<Grant>,
    ticker: Ticker,
    /// Each plugin's log (its rate limit is shared by its instances).
    logs: std::sync::Mutex<std::collections::BTreeMap<String, std::sync::Arc<PluginLog>>>,
}

impl std::fmt::Debug for PluginRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginRuntime")
            .field("cache_dir", &self.cache_dir())
            .field("limits", &self.limits)
            .field("grants", &self.grants)
            .finish()
    }
}

impl PluginRuntime {
    /// An engine with epoch interruption and a 1 MiB guest stack, the
    /// directories `grants` gives plugins, and the compiled-component cache
    /// in `cache_dir` (`None`: compile every time). A grant that is not a
    /// directory, has a relative guest path, or is writable and contains the
    /// cache is refused with a message naming it; a cache folder that cannot
    /// be trusted is not used, with a warning naming it.
    pub fn new(
        limits: Limits,
        cache_dir: Option<PathBuf>,
        grants: Vec<Grant>,
    ) -> Result<PluginRuntime, String> {
        check_grants(&grants, cache_dir.as_deref())?;
        let cache = cache_dir.and_then(|dir| match CompiledCache::open(&dir) {
            Ok(cache) => Some(cache),
            Err(e) => {
                tracing::warn!("not using the plugin cache: {e}; every plugin is compiled at load");
                None
            }
        });
        let mut config = Config::new();
        config.epoch_interruption(true).max_wasm_stack(1 << 20);
        let engine_error = |e: wasmtime::Error| format!("cannot start the WebAssembly engine: {e}");
        let engine = Engine::new(&config).map_err(engine_error)?;
        let epoch = engine.clone();
        let ticker = Ticker::start(move || epoch.increment_epoch())
            .map_err(|e| format!("cannot start the WebAssembly engine's ticker thread: {e}"))?;
        Ok(PluginRuntime {
            engine,
            cache,
            limits,
            grants,
            ticker,
            logs: Default::default(),
        })
    }

    /// The folder compiled components are cached in, when the cache is used.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.cache.as_ref().map(CompiledCache::dir)
    }

    /// The granted directories.
    pub fn grants(&self) -> &[Grant] {
        &self.grants
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The sandbox limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Compiles `bytes`, or loads the compiled form from the cache.
    pub fn load_component(&self, bytes: &[u8]) -> wasmtime::Result<Component> {
        match &self.cache {
            Some(cache) => Ok(cache.load_or_compile(&self.engine, bytes)?.0),
            None => Component::new(&self.engine, bytes),
        }
    }

    /// Links `component` against the sandbox once, so each instantiation
    /// afterwards is cheap: an empty environment (Rust's panic hook reads
    /// `RUST_BACKTRACE`, so a trap there would hide the panic) and every
    /// other import a function that traps with its name.
    pub fn instance_pre(&self, component: &Component) -> wasmtime::Result<InstancePre<StoreState>> {
        let mut linker = Linker::new(&self.engine);
        let imports: Vec<String> = component
            .component_type()
            .imports(&self.engine)
            .map(|(name, _)| name.to_string())
            .collect();
        for name in imports
            .iter()
            .filter(|n| n.starts_with("wasi:cli/environment@0.2."))
        {
            let mut env = linker.instance(name)?;
            env.func_wrap("get-environment", |_, ()| {
                Ok((Vec::<(String, String)>::new(),))
            })?;
            env.func_wrap("get-arguments", |_, ()| Ok((Vec::<String>::new(),)))?;
            env.func_wrap("initial-cwd", |_, ()| Ok((None::<String>,)))?;
        }
        // Hash-map keys: a fixed seed (see the module docs).
        for name in imports
            .iter()
            .filter(|n| n.starts_with("wasi:random/insecure-seed@0.2."))
        {
            linker
                .instance(name)?
                .func_wrap("insecure-seed", |_, ()| Ok((INSECURE_SEED,)))?;
        }
        // Files: reachable only through a preopened directory.
        wasi::io::error::add_to_linker::<StoreState, Io>(&mut linker, |s| &mut s.table)?;
        wasi::io::poll::add_to_linker::<StoreState, Io>(&mut linker, |s| &mut s.table)?;
        wasi::io::streams::add_to_linker::<StoreState, Io>(&mut linker, |s| &mut s.table)?;
        wasi::filesystem::types::add_to_linker::<StoreState, WasiFilesystem>(
            &mut linker,
            StoreState::filesystem,
        )?;
        preopens::add_to_linker::<StoreState, Preopens>(&mut linker, |s| GatedPreopens {
            granted: s.granted,
            fs: s.filesystem(),
        })?;
        // stdout and stderr: into the host's log (`super::log`).
        wasi_cli::stdout::add_to_linker::<StoreState, WasiCli>(&mut linker, |s| s.cli())?;
        wasi_cli::stderr::add_to_linker::<StoreState, WasiCli>(&mut linker, |s| s.cli())?;
        super::log::add_to_linker(&mut linker)?;
        // The worker's API for worker extensions: it traps outside an
        // extension's call, when no worker is lent (`super::extension`).
        super::bindings::extension::add_host_api(&mut linker)?;
        // Everything else traps. Not `define_unknown_imports_as_traps`: it
        // would stub `wasi:io/streams@0.2.6` under that exact name, which
        // shadows the semver-compatible definition linked above.
        for (name, item) in component.component_type().imports(&self.engine) {
            let ComponentItem::ComponentInstance(instance) = item.ty else {
                continue;
            };
            if LINKED_INTERFACES.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            let mut stub = linker.instance(name)?;
            for (export, item) in instance.exports(&self.engine) {
                match item.ty {
                    // A frozen monotonic clock (see the module docs).
                    ComponentItem::ComponentFunc(_)
                        if name.starts_with(MONOTONIC_CLOCK)
                            && matches!(export, "now" | "resolution") =>
                    {
                        stub.func_wrap(export, |_, ()| Ok((FROZEN_CLOCK_NS,)))?;
                    }
                    ComponentItem::ComponentFunc(_) => {
                        let import = format!("{name}#{export}");
                        stub.func_new(export, move |_, _, _, _| {
                            Err(wasmtime::Error::msg(format!(
                                "unknown import: `{import}` has not been defined"
                            )))
                        })?;
                    }
                    // The linked interfaces' resources are only referred to here.
                    ComponentItem::Resource(_) if !LINKED_RESOURCES.contains(&export) => {
                        stub.resource(export, ResourceType::host::<()>(), |_, _| Ok(()))?;
                    }
                    _ => {}
                }
            }
        }
        linker.instantiate_pre(component)
    }

    /// A fresh store with nothing granted, the memory limit and a trapping
    /// epoch deadline (for reading a plugin's metadata before its name is
    /// known); what the guest logs is prefixed with `label` (its file).
    pub fn new_store(&self, label: &str) -> Store<StoreState> {
        let output = GuestOutput::new(self.plugin_log(label));
        let wasi = Self::wasi_builder(&output).build();
        self.store_with(wasi, false, output)
    }

    /// The log of the plugin `name`, created on first use.
    pub fn plugin_log(&self, name: &str) -> std::sync::Arc<PluginLog> {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        logs.entry(name.to_string())
            .or_insert_with(|| PluginLog::new(name))
            .clone()
    }

    /// A WASI context whose stdout and stderr are `output`'s.
    fn wasi_builder(output: &GuestOutput) -> WasiCtxBuilder {
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(output.stdout.clone())
            .stderr(output.stderr.clone());
        wasi
    }

    /// A fresh store for the plugin `plugin`, with its granted directories
    /// preopened; fails when a granted directory cannot be opened.
    pub fn new_store_for(&self, plugin: &str) -> wasmtime::Result<Store<StoreState>> {
        let output = GuestOutput::new(self.plugin_log(plugin));
        let mut wasi = Self::wasi_builder(&output);
        // Calls are synchronous on the caller's thread already.
        wasi.allow_blocking_current_thread(true);
        let mut granted = false;
        for g in self.grants.iter().filter(|g| g.plugin == plugin) {
            let perms = if g.writable {
                FsPerms::ReadWrite
            } else {
                FsPerms::ReadOnly
            };
            wasi.preopened_dir(&g.dir, &g.guest, perms).map_err(|e| {
                wasmtime::Error::msg(format!(
                    "cannot open the granted dir {}: {e}",
                    g.dir.display()
                ))
            })?;
            granted = true;
        }
        Ok(self.store_with(wasi.build(), granted, output))
    }

    fn store_with(&self, wasi: WasiCtx, granted: bool, output: GuestOutput) -> Store<StoreState> {
        let state = StoreState {
            limits: PluginLimiter::new(self.limits.memory_bytes),
            wasi,
            table: ResourceTable::new(),
            granted,
            host_api: None,
            output,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_trap();
        store
    }

    /// Runs `f` (one call into the guest) under `deadline`.
    pub fn call<R>(
        &self,
        store: &mut Store<StoreState>,
        deadline: Duration,
        f: impl FnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> wasmtime::Result<R> {
        let ticks = deadline.as_millis().div_ceil(TICK.as_millis()) as u64 + 1;
        store.set_epoch_deadline(ticks);
        self.ticker.during(|| f(store))
    }
}

/// Describes a failed call in words: a deadline overrun, a memory limit,
/// a sandbox violation or a trap (its root cause, without the wasm
/// backtrace).
pub fn describe_fault(err: &wasmtime::Error, limits: &Limits, deadline: Duration) -> String {
    if matches!(err.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
        return format!(
            "exceeded its deadline of {} ms and was interrupted",
            deadline.as_millis()
        );
    }
    if let Some(not_granted) = err.root_cause().downcast_ref::<NotGranted>() {
        return not_granted.to_string();
    }
    if let Some(limit) = err.chain().find_map(|e| e.downcast_ref::<LimitExceeded>()) {
        return match limit {
            LimitExceeded::Memory { .. } => format!(
                "exceeded its memory limit of {} MiB ({limit})",
                limits.memory_bytes >> 20
            ),
            _ => format!("exceeded a sandbox limit ({limit})"),
        };
    }
    let root = err.root_cause().to_string();
    if let Some(import) = root.strip_prefix("unknown import: ") {
        let import = import.trim_end_matches(" has not been defined");
        if import.contains("wasi:cli/stderr") || import.contains("wasi:io/streams") {
            // Rust's panic hook writes the message to stderr before aborting.
            return format!("trapped writing to stderr ({import}), which the sandbox does not grant; usually a panic");
        }
        if import.contains("wasi:cli/terminal-") {
            return format!("used {import} (asked whether stdout is a terminal), which the sandbox does not grant; stdout and stderr themselves are logged by the host");
        }
        return format!("used {import}, a host capability the sandbox does not grant");
    }
    if root.contains("growing memory") || root.contains("memory") && root.contains("limit") {
        return format!(
            "exceeded its memory limit of {} MiB ({root})",
            limits.memory_bytes >> 20
        );
    }
    match err.downcast_ref::<Trap>() {
        // Rust's `panic = "abort"` ends in `unreachable`, after the panic
        // hook wrote the message to stderr (logged, and appended to this
        // message by `super::instance`).
        Some(Trap::UnreachableCodeReached) => {
            format!("trapped: {}, usually a panic", Trap::UnreachableCodeReached)
        }
        Some(trap) => format!("trapped: {trap}"),
        None => format!("failed: {root}"),
    }
}

/// Refuses a grant that is not a directory, has a relative guest path, or
/// is writable and contains `cache_dir` (compared canonical, so a symlink
/// or `..` does not hide it).
fn check_grants(grants: &[Grant], cache_dir: Option<&std::path::Path>) -> Result<(), String> {
    let cache = cache_dir.map(cache_guard::resolve);
    for g in grants {
        let name = &g.plugin;
        if !g.dir.is_dir() {
            return Err(format!(
                "[[plugins.grants]] for {name:?}: dir {} is not a directory on this machine",
                g.dir.display()
            ));
        }
        if !g.guest.starts_with('/') {
            return Err(format!(
                "[[plugins.grants]] for {name:?}: guest = {:?} must be an absolute path such as \"/data\"",
                g.guest
            ));
        }
        let dir = cache_guard::resolve(&g.dir);
        if let Some(cache) = cache.as_ref().filter(|c| g.writable && c.starts_with(&dir)) {
            return Err(format!(
                "[[plugins.grants]] for {name:?}: dir {} is writable and contains the compiled-component cache {}, \
                 where the plugin could plant native code the host would load; move the cache out of it \
                 (plugins.cache_dir) or make the grant read-only (writable = false)",
                dir.display(),
                cache.display()
            ));
        }
    }
    Ok(())
}
