//! A scheduling-policy plugin. The scheduler puts it behind its
//! `SchedulingPolicy` seam (`scheduler/policy_plugin.rs`); the plugin host
//! knows nothing of the scheduler and takes the queue and the batch as
//! plain columns. They are copied into reused column buffers (no allocation
//! in steady state) and cross as parallel lists; the answer is checked here
//! so the log names the plugin and what was wrong. On a fault this step
//! uses FCFS (the built-in fallback) and the instance is recreated; under
//! `plugins.on_error = "fail"` the fault is also kept as the policy's
//! [`failure`](WasmPolicy::failure), and the engine core stops with it
//! rather than run on with a policy the operator chose not to tolerate.

use super::bindings::policy::{RunningBatch, SchedulingPolicyPlugin, WaitingQueue};
use super::instance::Sandboxed;
use super::{OnError, PluginError};

/// A WebAssembly scheduling policy.
pub struct WasmPolicy {
    plugin: Sandboxed<SchedulingPolicyPlugin>,
    on_error: OnError,
    /// The first fault, kept under [`OnError::Fail`].
    failure: Option<String>,
    waiting: WaitingQueue,
    running: RunningBatch,
    seen: Vec<bool>,
}

impl WasmPolicy {
    /// Wraps a started instance; `on_error` says whether a fault only falls
    /// back for the step or also fails the engine.
    pub(super) fn new(plugin: Sandboxed<SchedulingPolicyPlugin>, on_error: OnError) -> WasmPolicy {
        WasmPolicy {
            plugin,
            on_error,
            failure: None,
            waiting: WaitingQueue {
                ids: Vec::new(),
                prompt_lens: Vec::new(),
                priorities: Vec::new(),
                arrival_times: Vec::new(),
            },
            running: RunningBatch {
                ids: Vec::new(),
                priorities: Vec::new(),
                arrival_times: Vec::new(),
                num_computed_tokens: Vec::new(),
            },
            seen: Vec::new(),
        }
    }

    /// Faults since start (each one a step that fell back to FCFS).
    pub fn faults(&self) -> u64 {
        self.plugin.faults()
    }

    /// The latest fault's message, naming the hook and what happened.
    pub fn last_fault(&self) -> Option<&str> {
        self.plugin.last_fault()
    }

    /// Notes a fault (already logged and the instance recreated by
    /// `Sandboxed`); under [`OnError::Fail`] the first one is kept.
    fn faulted(&mut self, e: PluginError) {
        if self.on_error == OnError::Fail && self.failure.is_none() {
            self.failure = Some(format!(
                "{e} (plugins.on_error = \"fail\" stops the engine on a scheduling-policy fault)"
            ));
        }
    }
}

fn refill<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
    dst.clear();
    dst.extend_from_slice(src);
}

/// The waiting queue as columns (position `i` in each is one request, in
/// arrival order).
#[derive(Debug, Clone, Copy)]
pub struct WaitingColumns<'a> {
    /// Request handles.
    pub ids: &'a [u32],
    /// Prompt lengths in tokens.
    pub prompt_lens: &'a [u32],
    /// Priorities (lower value = served first).
    pub priorities: &'a [i32],
    /// Arrival times in the engine's seconds.
    pub arrival_times: &'a [f64],
}

/// The running batch as columns, earliest admitted first.
#[derive(Debug, Clone, Copy)]
pub struct RunningColumns<'a> {
    /// Request handles.
    pub ids: &'a [u32],
    /// Priorities (lower value = more important).
    pub priorities: &'a [i32],
    /// Arrival times in the engine's seconds.
    pub arrival_times: &'a [f64],
    /// Tokens already computed (what preempting would throw away).
    pub num_computed_tokens: &'a [u32],
}

impl WasmPolicy {
    /// The plugin's qualified name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// Writes into `out` the positions of `view` to admit, in the plugin's
    /// order; a fault or an invalid answer writes FCFS order instead.
    pub fn order_waiting(&mut self, view: WaitingColumns<'_>, out: &mut Vec<u32>) {
        let q = &mut self.waiting;
        refill(&mut q.ids, view.ids);
        refill(&mut q.prompt_lens, view.prompt_lens);
        refill(&mut q.priorities, view.priorities);
        refill(&mut q.arrival_times, view.arrival_times);
        let q = &self.waiting;
        let answer = self.plugin.call("order-waiting", q.ids.len(), |w, s| {
            w.engine_plugins_scheduling_policy()
                .call_order_waiting(s, q)
        });
        let order = match answer {
            Ok(order) => order,
            Err(e) => {
                self.faulted(e);
                out.extend(0..view.ids.len() as u32);
                return;
            }
        };
        let n = view.ids.len();
        self.seen.clear();
        self.seen.resize(n, false);
        let bad = order
            .iter()
            .find(|&&p| (p as usize) >= n || std::mem::replace(&mut self.seen[p as usize], true));
        if let Some(&p) = bad {
            let why = if (p as usize) >= n {
                "is out of range"
            } else {
                "appears twice"
            };
            let e = self.plugin.fault("order-waiting", format!("returned an invalid order: position {p} {why} (queue of {n}); using FCFS for this step"));
            self.faulted(e);
            out.extend(0..n as u32);
            return;
        }
        out.extend_from_slice(&order);
    }

    /// The position in `view` of the request to preempt, or `None` for the
    /// FCFS choice (also after a fault or an out-of-range answer).
    pub fn pick_victim(&mut self, view: RunningColumns<'_>) -> Option<u32> {
        let r = &mut self.running;
        refill(&mut r.ids, view.ids);
        refill(&mut r.priorities, view.priorities);
        refill(&mut r.arrival_times, view.arrival_times);
        refill(&mut r.num_computed_tokens, view.num_computed_tokens);
        let r = &self.running;
        match self.plugin.call("pick-victim", r.ids.len(), |w, s| {
            w.engine_plugins_scheduling_policy().call_pick_victim(s, r)
        }) {
            Ok(Some(p)) if (p as usize) < view.ids.len() => Some(p),
            Ok(Some(p)) => {
                let n = view.ids.len();
                let e = self.plugin.fault("pick-victim", format!("returned position {p}, out of range (batch of {n}); preempting the latest admitted"));
                self.faulted(e);
                None
            }
            Ok(None) => None,
            Err(e) => {
                self.faulted(e);
                None
            }
        }
    }

    /// The fault the engine must stop on (`plugins.on_error = "fail"`).
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}
