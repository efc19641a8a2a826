//! The wasmtime side: one `Engine` for every plugin, the sandbox every
//! instance runs in, and the per-call deadline.
//!
//! The sandbox: a plugin imports nothing from the host, the environment it
//! sees is empty, and every other WASI import a guest's standard library
//! pulls in (filesystem, sockets, clocks, randomness, stdio) is linked to a
//! function that traps with the import's name, so "no filesystem, network,
//! environment or clock" holds by construction. Memory is capped per instance by `StoreLimits` (a failed
//! grow traps, so running out is reported, not hidden in a guest `null`),
//! and every call runs under an epoch deadline: a ticker thread advances the
//! engine's epoch every millisecond while a call is in flight (and sleeps
//! otherwise, so an idle engine stays idle).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::Duration;

use wasmtime::component::{Component, InstancePre, Linker};
use wasmtime::{Config, Engine, Store, StoreLimits, StoreLimitsBuilder, Trap};

use super::cache;

/// Sandbox limits for every instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Wall-clock budget of one per-step hook call.
    pub deadline: Duration,
    /// Wall-clock budget of `init` and `metadata`.
    pub init_deadline: Duration,
    /// Linear memory one instance may grow to, in bytes.
    pub memory_bytes: usize,
}

/// What each `Store` carries: its limits.
pub struct StoreState {
    limits: StoreLimits,
}

/// Period of the epoch ticker; deadlines are whole ticks.
const TICK: Duration = Duration::from_millis(1);

/// Advances the engine's epoch every [`TICK`] while any call is in flight.
struct Ticker {
    in_flight: Arc<AtomicUsize>,
    thread: Thread,
}

impl Ticker {
    fn start(engine: Engine) -> std::io::Result<Ticker> {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let busy = in_flight.clone();
        let handle = std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || loop {
                if busy.load(Ordering::Acquire) == 0 {
                    std::thread::park();
                    continue;
                }
                std::thread::sleep(TICK);
                engine.increment_epoch();
            })?;
        Ok(Ticker {
            in_flight,
            thread: handle.thread().clone(),
        })
    }
}

/// The one wasmtime engine, its compiled-component cache and the sandbox
/// settings; shared by every plugin instance.
pub struct PluginRuntime {
    engine: Engine,
    cache_dir: Option<PathBuf>,
    limits: Limits,
    ticker: Ticker,
}

impl std::fmt::Debug for PluginRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginRuntime")
            .field("cache_dir", &self.cache_dir)
            .field("limits", &self.limits)
            .finish()
    }
}

impl PluginRuntime {
    /// An engine with epoch interruption, a 1 MiB guest stack, and the
    /// given cache directory (`None`: compile every time).
    pub fn new(limits: Limits, cache_dir: Option<PathBuf>) -> anyhow::Result<PluginRuntime> {
        let mut config = Config::new();
        config.epoch_interruption(true).max_wasm_stack(1 << 20);
        let engine = Engine::new(&config)?;
        let ticker = Ticker::start(engine.clone())?;
        Ok(PluginRuntime {
            engine,
            cache_dir,
            limits,
            ticker,
        })
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
        cache::load_or_compile(&self.engine, self.cache_dir.as_deref(), bytes)
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
        linker.define_unknown_imports_as_traps(component)?;
        linker.instantiate_pre(component)
    }

    /// A fresh store with the memory limit and a trapping epoch deadline.
    pub fn new_store(&self) -> Store<StoreState> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            // A component built by componentize-py (CPython, libc, the WASI
            // adapter and their shims) instantiates 38 core modules; memory
            // stays capped by `memory_size` however many there are.
            .instances(64)
            .tables(8)
            .table_elements(20_000)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(&self.engine, StoreState { limits });
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
        if self.ticker.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.ticker.thread.unpark();
        }
        let result = f(store);
        self.ticker.in_flight.fetch_sub(1, Ordering::AcqRel);
        result
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
    let root = err.root_cause().to_string();
    if let Some(import) = root.strip_prefix("unknown import: ") {
        let import = import.trim_end_matches(" has not been defined");
        if import.contains("wasi:cli/stderr") || import.contains("wasi:io/streams") {
            // Rust's panic hook writes the message to stderr before aborting.
            return format!("trapped writing to stderr ({import}), which the sandbox does not grant; usually a panic");
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
        Some(trap) => format!("trapped: {trap}"),
        None => format!("failed: {root}"),
    }
}
