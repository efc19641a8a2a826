//! One plugin instance with a long-lived `Store`, recreated after a fault.
//!
//! A trapped component instance cannot be entered again ("cannot enter
//! component instance"), so after any fault the store is dropped and a new
//! instance is made from the `InstancePre` (about 20 us) and re-initialised
//! with the same options. A plugin whose `init` fails on recreation stays
//! down: every later call fails at once, and the caller falls back.

use std::sync::Arc;

use wasmtime::component::InstancePre;
use wasmtime::Store;

use super::bindings;
use super::runtime::{describe_fault, PluginRuntime, StoreState};
use super::PluginError;

/// One generated world's bindings, seen the same way for every kind.
pub trait World: Sized + Send + 'static {
    /// The world's pre-linked instance type.
    type Pre: Send + Sync + 'static;
    /// Wraps a linked `InstancePre`, checking the component has the world's
    /// exports.
    fn pre(pre: InstancePre<StoreState>) -> wasmtime::Result<Self::Pre>;
    /// A new instance in `store`.
    fn instantiate(pre: &Self::Pre, store: &mut Store<StoreState>) -> wasmtime::Result<Self>;
    /// Calls `init(options)`.
    fn init(
        &self,
        store: &mut Store<StoreState>,
        options: &str,
    ) -> wasmtime::Result<Result<(), String>>;
}

/// Implements [`World`] for a world type of [`bindings`] that has `Pre`,
/// `instantiate` and `init` of its own (every version behind one type).
macro_rules! world {
    ($world:ty, $pre:ty) => {
        impl World for $world {
            type Pre = $pre;
            fn pre(pre: InstancePre<StoreState>) -> wasmtime::Result<Self::Pre> {
                <$pre>::new(pre)
            }
            fn instantiate(
                pre: &Self::Pre,
                store: &mut Store<StoreState>,
            ) -> wasmtime::Result<Self> {
                pre.instantiate(store)
            }
            fn init(
                &self,
                store: &mut Store<StoreState>,
                options: &str,
            ) -> wasmtime::Result<Result<(), String>> {
                <$world>::init(self, store, options)
            }
        }
    };
}

world!(
    bindings::policy::SchedulingPolicyPlugin,
    bindings::policy::SchedulingPolicyPluginPre
);
world!(
    bindings::processor::LogitsProcessorPlugin,
    bindings::processor::LogitsProcessorPluginPre
);
world!(
    bindings::extension::WorkerExtensionPlugin,
    bindings::extension::WorkerExtensionPluginPre
);
world!(
    bindings::sampler::SamplerPlugin,
    bindings::sampler::SamplerPluginPre
);

/// A live instance of one plugin.
pub struct Sandboxed<W: World> {
    name: String,
    options: String,
    runtime: Arc<PluginRuntime>,
    pre: Arc<W::Pre>,
    /// `None` while the plugin is down (its re-initialisation failed).
    live: Option<(Store<StoreState>, W)>,
    faults: u64,
    last_fault: Option<String>,
}

impl<W: World> Sandboxed<W> {
    /// Instantiates and initialises the plugin `name` with `options`.
    pub fn new(
        name: &str,
        options: &str,
        runtime: Arc<PluginRuntime>,
        pre: Arc<W::Pre>,
    ) -> Result<Self, PluginError> {
        let mut s = Sandboxed {
            name: name.to_string(),
            options: options.to_string(),
            runtime,
            pre,
            live: None,
            faults: 0,
            last_fault: None,
        };
        s.live = Some(s.start()?);
        Ok(s)
    }

    /// The plugin's qualified name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The linked component, which says what version it was built against.
    pub fn pre(&self) -> &W::Pre {
        &self.pre
    }

    /// Bytes of linear memory the live instance holds (0 while down).
    pub fn memory_used(&self) -> usize {
        self.live
            .as_ref()
            .map_or(0, |(store, _)| store.data().memory_used())
    }

    /// Faults (traps, overruns, invalid output) since start.
    pub fn faults(&self) -> u64 {
        self.faults
    }

    /// The latest fault's message (hook and what happened).
    pub fn last_fault(&self) -> Option<&str> {
        self.last_fault.as_deref()
    }

    fn start(&self) -> Result<(Store<StoreState>, W), PluginError> {
        let fault = |call, message| PluginError::Fault {
            name: self.name.clone(),
            call,
            message,
        };
        let rt = &self.runtime;
        let mut store = rt
            .new_store_for(&self.name)
            .map_err(|e| fault("instantiate", format!("{e:#}")))?;
        let deadline = rt.limits().init_deadline;
        let world = rt
            .call(&mut store, deadline, |s| W::instantiate(&self.pre, s))
            .map_err(|e| fault("instantiate", describe_fault(&e, rt.limits(), deadline)))?;
        let init = rt
            .call(&mut store, deadline, |s| world.init(s, &self.options))
            .map_err(|e| fault("init", describe_fault(&e, rt.limits(), deadline)))?;
        init.map_err(|message| PluginError::Init {
            name: self.name.clone(),
            options: self.options.clone(),
            message,
        })?;
        Ok((store, world))
    }

    /// Calls hook `call`, which carries `requests` requests (rows to edit
    /// or sample, requests to order), under the per-step deadline and its
    /// allowance for each of them. On a fault the instance is recreated
    /// (logged with the plugin's name) and the fault returned, so the
    /// caller can fall back for this step.
    pub fn call<R>(
        &mut self,
        call: &'static str,
        requests: usize,
        f: impl FnOnce(&W, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        let limits = self.runtime.limits();
        let requests = u32::try_from(requests).unwrap_or(u32::MAX);
        let deadline = limits
            .deadline
            .saturating_add(limits.deadline_per_request.saturating_mul(requests));
        self.call_within(call, deadline, f)
    }

    /// As [`Self::call`], under the `init` deadline: for the hooks called
    /// once per instance or per request, not per step (`set-vocabulary`
    /// builds a token trie, `check-request` compiles a grammar).
    pub fn call_once<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&W, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        let deadline = self.runtime.limits().init_deadline;
        self.call_within(call, deadline, f)
    }

    fn call_within<R>(
        &mut self,
        call: &'static str,
        deadline: std::time::Duration,
        f: impl FnOnce(&W, &mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        let Some((store, world)) = self.live.as_mut() else {
            return Err(PluginError::Fault {
                name: self.name.clone(),
                call,
                message: "the plugin is down since an earlier fault".into(),
            });
        };
        let runtime = self.runtime.clone();
        match runtime.call(store, deadline, |s| f(world, s)) {
            Ok(r) => Ok(r),
            Err(e) => {
                let mut message = describe_fault(&e, runtime.limits(), deadline);
                if let Some(panic) = store.data().output().take_panic() {
                    message = format!("{message} ({panic})");
                }
                Err(self.fault(call, message))
            }
        }
    }

    /// Records a fault: logs it, recreates the instance, returns the error.
    pub fn fault(&mut self, call: &'static str, message: String) -> PluginError {
        self.faults += 1;
        self.last_fault = Some(format!("{call}: {message}"));
        tracing::error!(plugin = %self.name, "{call} failed: {message}; recreating the instance");
        self.live = None;
        match self.start() {
            Ok(live) => self.live = Some(live),
            Err(e) => {
                tracing::error!(plugin = %self.name, "cannot recreate the instance ({e}); the plugin stays down")
            }
        }
        PluginError::Fault {
            name: self.name.clone(),
            call,
            message,
        }
    }
}
