//! Resolving `scheduler.policy`: a built-in, or a WebAssembly policy from
//! the plugin host put behind the [`SchedulingPolicy`] seam. The scheduler
//! calls the plugin host here and nowhere else; the plugin host knows
//! nothing of the scheduler (it takes the views as plain columns).

use super::policy::{builtin_policy, RunningView, SchedulingPolicy, WaitingView, BUILTIN_POLICIES};
use crate::config::PluginsConfig;
use crate::plugins::policy::{RunningColumns, WaitingColumns, WasmPolicy};
use crate::plugins::{host_from_config, PluginError, PluginHost, PluginKind};

impl SchedulingPolicy for WasmPolicy {
    fn name(&self) -> &str {
        WasmPolicy::name(self)
    }

    fn order_waiting(&mut self, view: &WaitingView<'_>, out: &mut Vec<u32>) {
        let columns = WaitingColumns {
            ids: view.ids,
            prompt_lens: view.prompt_lens,
            priorities: view.priorities,
            arrival_times: view.arrival_times,
        };
        WasmPolicy::order_waiting(self, columns, out);
    }

    fn pick_victim(&mut self, view: &RunningView<'_>) -> Option<u32> {
        let columns = RunningColumns {
            ids: view.ids,
            priorities: view.priorities,
            arrival_times: view.arrival_times,
            num_computed_tokens: view.num_computed_tokens,
        };
        WasmPolicy::pick_victim(self, columns)
    }

    fn failure(&self) -> Option<&str> {
        WasmPolicy::failure(self)
    }

    fn faults(&self) -> Option<u64> {
        Some(WasmPolicy::faults(self))
    }
}

/// The scheduling policy named `name` among the built-ins (`builtin:fcfs`,
/// `builtin:priority`, or vLLM's bare `fcfs` / `priority`) and `host`'s
/// plugins, instantiated and initialised with its options. An unknown name
/// is an error listing every policy, built-ins first.
pub fn policy_from_host(
    host: &PluginHost,
    name: &str,
) -> Result<Box<dyn SchedulingPolicy>, PluginError> {
    if let Ok(policy) = builtin_policy(name) {
        return Ok(policy);
    }
    match host.wasm_policy(name) {
        Ok(policy) => Ok(Box::new(policy)),
        Err(PluginError::Unknown { name, kind, .. }) => {
            let plugins = host
                .plugins()
                .filter(|p| p.kind == PluginKind::SchedulingPolicy)
                .map(|p| p.name.as_str());
            let available: Vec<&str> = BUILTIN_POLICIES.iter().copied().chain(plugins).collect();
            Err(PluginError::Unknown {
                name,
                kind,
                available: available.join(", "),
            })
        }
        Err(e) => Err(e),
    }
}

/// The scheduling policy `scheduler.policy = name` picks. `auto` is the
/// one scheduling-policy plugin among `plugins.paths` (what `--plugin`
/// adds), so `host --plugin sched.wasm` serves with it, and `builtin:fcfs`
/// when there is none; two are ambiguous. The WebAssembly engine starts only
/// when plugins are configured.
pub fn policy_from_config(
    name: &str,
    config: &PluginsConfig,
) -> anyhow::Result<Box<dyn SchedulingPolicy>> {
    if config.paths.is_empty() && config.dirs.is_empty() {
        let name = if name == "auto" { "builtin:fcfs" } else { name };
        return Ok(builtin_policy(name)?);
    }
    let host = host_from_config(config)?;
    if name != "auto" {
        return Ok(policy_from_host(&host, name)?);
    }
    let given: Vec<&str> = host
        .plugins()
        .filter(|p| p.kind == PluginKind::SchedulingPolicy && config.paths.contains(&p.path))
        .map(|p| p.name.as_str())
        .collect();
    Ok(match given.as_slice() {
        [] => policy_from_host(&host, "builtin:fcfs")?,
        [one] => policy_from_host(&host, one)?,
        many => anyhow::bail!(PluginError::Config(format!(
            "scheduler.policy = \"auto\", but plugins.paths holds {} scheduling policies ({}); set scheduler.policy to one of them",
            many.len(),
            many.join(", ")
        ))),
    })
}
