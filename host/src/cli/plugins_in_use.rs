//! The plugins a served configuration knows and which of them it puts to
//! use, for the server's `GET /v1/plugins` (what `host plugin list`
//! prints, plus the roles). Built here, at the top of the graph, because
//! reading a component's declaration needs the plugin host, which the
//! server may not import; the server only serves the list.

use serde_json::{json, Value};

use crate::config::EngineConfig;
use crate::plugins::{host_from_config, PluginKind};
use crate::scheduler::BUILTIN_POLICIES;

/// One known plugin.
struct Entry {
    name: String,
    version: Option<String>,
    kind: PluginKind,
    builtin: bool,
}

/// The `/v1/plugins` list for `config`: the built-in policies, and the
/// components of `plugins.paths` and `plugins.dirs`, loaded to read what
/// they declare, each with the configuration key that puts it to use
/// (`used_as`, `null` for one only known).
pub fn describe(config: &EngineConfig) -> anyhow::Result<Value> {
    let mut entries: Vec<Entry> = BUILTIN_POLICIES
        .iter()
        .map(|name| Entry {
            name: name.to_string(),
            version: None,
            kind: PluginKind::SchedulingPolicy,
            builtin: true,
        })
        .collect();
    let p = &config.plugins;
    let mut given_policies = Vec::new();
    if !p.paths.is_empty() || !p.dirs.is_empty() {
        let host = host_from_config(p)
            .map_err(|e| anyhow::anyhow!("cannot read the configured plugins: {e}"))?;
        for info in host.plugins() {
            if info.kind == PluginKind::SchedulingPolicy && p.paths.contains(&info.path) {
                given_policies.push(info.name.clone());
            }
            entries.push(Entry {
                name: info.name.clone(),
                version: Some(info.version.clone()),
                kind: info.kind,
                builtin: false,
            });
        }
    }
    let policy = policy_name(&config.scheduler.policy, &given_policies);
    let data: Vec<Value> = entries
        .iter()
        .map(|e| {
            let used_as = match e.kind {
                PluginKind::SchedulingPolicy => (e.name == policy).then_some("scheduler.policy"),
                PluginKind::Sampler => (e.name == p.sampler).then_some("plugins.sampler"),
                PluginKind::LogitsProcessor => p
                    .logits_processors
                    .contains(&e.name)
                    .then_some("plugins.logits_processors"),
                PluginKind::WorkerExtension => config
                    .worker
                    .extension
                    .contains(&e.name)
                    .then_some("worker.extension"),
            };
            json!({
                "name": e.name,
                "version": e.version,
                "kind": e.kind.to_string(),
                "builtin": e.builtin,
                "used_as": used_as,
            })
        })
        .collect();
    Ok(json!({"object": "list", "data": data}))
}

/// The policy `scheduler.policy = name` resolves to, as the engine
/// resolves it (`scheduler::policy_from_config`): `auto` is the one policy
/// `--plugin` gave, else FCFS; vLLM's bare names are the built-ins.
fn policy_name(name: &str, given_policies: &[String]) -> String {
    match name {
        "auto" => match given_policies {
            [one] => one.clone(),
            _ => "builtin:fcfs".to_string(),
        },
        "fcfs" => "builtin:fcfs".to_string(),
        "priority" => "builtin:priority".to_string(),
        name => name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_plugins_the_builtin_policies_are_listed() {
        let mut config = EngineConfig::default();
        let v = describe(&config).unwrap();
        let names: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, BUILTIN_POLICIES);
        assert_eq!(v["data"][0]["used_as"], "scheduler.policy");
        assert_eq!(v["data"][0]["kind"], "scheduling policy");
        assert!(v["data"][1]["used_as"].is_null());
        config.scheduler.policy = "priority".into();
        let v = describe(&config).unwrap();
        assert!(v["data"][0]["used_as"].is_null());
        assert_eq!(v["data"][1]["used_as"], "scheduler.policy");
    }
}
