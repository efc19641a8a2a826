//! The worker's method registry: how `collective_rpc` reaches a method by
//! name (vLLM's `getattr(worker, method)`), in the engine's process (`uni`)
//! and in worker processes (`mp`) alike.
//!
//! The built-in methods are the [`Worker`]'s lifecycle and step methods.
//! Worker extensions (plugins) add their own with [`WorkerMethods::register`]
//! under a namespaced name such as `my-ext:reset_stats`; a name that is
//! already taken is refused, as vLLM refuses an extension attribute that
//! conflicts with the worker class.
//!
//! Every registered method is reachable by whoever can call
//! `collective_rpc` (the opt-in `POST /collective_rpc` included), so none
//! may widen the sandbox the operator configured: the one method that
//! loads plugins, `load_logits_processors`, is bound to the operator's
//! `[plugins]` when the worker starts ([`WorkerMethods::register_plugin_loading`])
//! and refuses an argument that asks for other plugins, grants, limits or
//! cache.

use std::collections::HashMap;

use super::Worker;
use crate::config::PluginsConfig;
use crate::step::RpcValue;

/// A method's body: runs on the worker with the call's argument.
pub type Handler = Box<dyn Fn(&mut Worker, RpcValue) -> anyhow::Result<RpcValue> + Send + Sync>;

/// Methods callable through `collective_rpc`, by name.
pub struct WorkerMethods {
    handlers: HashMap<String, Handler>,
}

/// Why a method could not be registered.
#[derive(Debug, thiserror::Error)]
#[error("worker method `{0}` is already registered; give an extension's methods a namespaced name (e.g. `my-ext:{0}`)")]
pub struct DuplicateMethod(pub String);

impl WorkerMethods {
    /// No methods at all.
    pub fn empty() -> WorkerMethods {
        WorkerMethods {
            handlers: HashMap::new(),
        }
    }

    /// The built-in worker methods: `check_health` (a no-op), the lifecycle
    /// (`init_device`, `load_model`, `determine_available_memory`,
    /// `bytes_per_block`, `max_model_len`, `initialize_from_config`,
    /// `compile_or_warm_up_model`), the step (`execute_model`,
    /// `sample_tokens`), and between steps `sleep`, `wake_up`,
    /// `is_sleeping` and `update_weights` (`sleep.rs`). None of them loads
    /// a plugin: see [`WorkerMethods::register_plugin_loading`].
    pub fn builtin() -> WorkerMethods {
        let mut m = WorkerMethods::empty();
        let count = |n: usize| RpcValue::Count(n as u64);
        let builtins: Vec<(&str, Handler)> = vec![
            ("check_health", Box::new(|_, a| no_args("check_health", a))),
            (
                "init_device",
                Box::new(|w, a| {
                    no_args("init_device", a)?;
                    Ok(w.init_device().map(|()| RpcValue::Unit)?)
                }),
            ),
            (
                "load_model",
                Box::new(|w, a| {
                    no_args("load_model", a)?;
                    Ok(w.load_model().map(|()| RpcValue::Unit)?)
                }),
            ),
            (
                "determine_available_memory",
                Box::new(move |w, a| {
                    no_args("determine_available_memory", a)?;
                    Ok(count(w.determine_available_memory()?))
                }),
            ),
            (
                "bytes_per_block",
                Box::new(move |w, a| {
                    no_args("bytes_per_block", a)?;
                    Ok(count(w.bytes_per_block()?))
                }),
            ),
            (
                "max_model_len",
                Box::new(move |w, a| {
                    no_args("max_model_len", a)?;
                    Ok(count(w.max_model_len()?))
                }),
            ),
            (
                "initialize_from_config",
                Box::new(|w, a| {
                    let blocks = a
                        .into_count("initialize_from_config")
                        .map_err(anyhow::Error::msg)?;
                    let blocks = usize::try_from(blocks)?;
                    Ok(w.initialize_from_config(blocks).map(|()| RpcValue::Unit)?)
                }),
            ),
            (
                "compile_or_warm_up_model",
                Box::new(|w, a| {
                    no_args("compile_or_warm_up_model", a)?;
                    Ok(w.compile_or_warm_up_model().map(|()| RpcValue::Unit)?)
                }),
            ),
            (
                "execute_model",
                Box::new(|w, a| match a {
                    RpcValue::SchedulerOutput(so) => {
                        Ok(w.execute_model(&so).map(|()| RpcValue::Unit)?)
                    }
                    other => anyhow::bail!(
                        "execute_model expects a SchedulerOutput, got {}",
                        other.kind()
                    ),
                }),
            ),
            (
                "sample_tokens",
                Box::new(|w, a| {
                    no_args("sample_tokens", a)?;
                    Ok(RpcValue::ModelRunnerOutput(Box::new(w.sample_tokens()?)))
                }),
            ),
        ];
        for (name, handler) in builtins.into_iter().chain(super::sleep::methods()) {
            m.handlers.insert(name.to_string(), handler);
        }
        m
    }

    /// Adds `name`; refuses a name that is already registered.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        handler: impl Fn(&mut Worker, RpcValue) -> anyhow::Result<RpcValue> + Send + Sync + 'static,
    ) -> Result<(), DuplicateMethod> {
        let name = name.into();
        if self.handlers.contains_key(&name) {
            return Err(DuplicateMethod(name));
        }
        self.handlers.insert(name, Box::new(handler));
        Ok(())
    }

    /// Adds `load_logits_processors`, which loads the logits processors and
    /// the sampler that `operator` (the engine configuration's `[plugins]`,
    /// as the operator wrote it) names. Called with no argument it loads
    /// exactly those; an argument must equal `operator`, so a
    /// `collective_rpc` caller cannot add plugin files, directory grants,
    /// limits or a cache folder the operator did not configure.
    /// `backend` is `structured_outputs.backend`, which claims only
    /// requests asking for structured output.
    pub fn register_plugin_loading(
        &mut self,
        operator: &PluginsConfig,
        backend: &str,
    ) -> Result<(), DuplicateMethod> {
        let (operator, backend) = (operator.clone(), backend.to_string());
        self.register("load_logits_processors", move |w, a| {
            if let RpcValue::Json(asked) = &a {
                refuse_other_plugins(asked, &operator)?;
            } else if a != RpcValue::Unit {
                anyhow::bail!(
                    "load_logits_processors takes no argument (or the configured [plugins] as Json), got {}",
                    a.kind()
                );
            }
            let plugins = serde_json::to_string(&operator)?;
            Ok(w
                .load_logits_processors(&plugins, &backend)
                .map(|()| RpcValue::Unit)?)
        })?;
        // The model's vocabulary for 0.3 logits processors, sent by the
        // engine (which holds the tokenizer) before `load_logits_processors`;
        // set once, so a caller cannot change it afterwards.
        self.register("set_vocabulary", |w, a| match a {
            RpcValue::Json(json) => Ok(w.set_vocabulary(&json).map(|()| RpcValue::Unit)?),
            other => anyhow::bail!(
                "set_vocabulary takes the vocabulary as Json, got {}",
                other.kind()
            ),
        })
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Runs `method` on `worker`. A method's error comes back as its
    /// message (with its causes); an unknown name is an error listing the
    /// known ones.
    pub fn call(
        &self,
        worker: &mut Worker,
        method: &str,
        args: RpcValue,
    ) -> Result<RpcValue, String> {
        let handler = self.handlers.get(method).ok_or_else(|| {
            format!(
                "unknown worker method `{method}`; known methods: {}",
                self.names().join(", ")
            )
        })?;
        handler(worker, args).map_err(|e| format!("{e:#}"))
    }
}

/// Refuses `asked` (a `[plugins]` section as JSON) unless it is the
/// operator's, naming the keys that differ.
fn refuse_other_plugins(asked: &str, operator: &PluginsConfig) -> anyhow::Result<()> {
    let asked: PluginsConfig = serde_json::from_str(asked)
        .map_err(|e| anyhow::anyhow!("load_logits_processors: invalid [plugins] JSON: {e}"))?;
    let (asked, operator) = (
        serde_json::to_value(asked)?,
        serde_json::to_value(operator)?,
    );
    let differ: Vec<&str> = match (&asked, &operator) {
        (serde_json::Value::Object(a), serde_json::Value::Object(o)) => o
            .iter()
            .filter(|(k, v)| a.get(k.as_str()) != Some(v))
            .map(|(k, _)| k.as_str())
            .collect(),
        _ => vec!["[plugins]"],
    };
    if differ.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "load_logits_processors: refused, the [plugins] given differs from the engine's configuration in {}; \
         plugin files, directory grants, limits and the compiled-component cache come only from the operator's \
         configuration, never from a collective_rpc argument (call it with no argument to load what the \
         configuration names)",
        differ.join(", ")
    )
}

/// Refuses an argument for a method that takes none.
fn no_args(method: &str, args: RpcValue) -> anyhow::Result<RpcValue> {
    match args {
        RpcValue::Unit => Ok(RpcValue::Unit),
        other => anyhow::bail!("{method} takes no argument, got {}", other.kind()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::WorkerConfig;

    fn worker() -> Worker {
        Worker::new(WorkerConfig::for_unit_tests()).unwrap()
    }

    #[test]
    fn an_unknown_method_lists_the_known_ones() {
        let m = WorkerMethods::builtin();
        let err = m
            .call(&mut worker(), "execute_modle", RpcValue::Unit)
            .unwrap_err();
        assert!(err.contains("execute_modle"), "{err}");
        for known in [
            "check_health",
            "execute_model",
            "sample_tokens",
            "initialize_from_config",
        ] {
            assert!(err.contains(known), "{known} missing from: {err}");
        }
    }

    #[test]
    fn a_method_error_comes_back_as_its_message() {
        let m = WorkerMethods::builtin();
        let err = m
            .call(&mut worker(), "load_model", RpcValue::Unit)
            .unwrap_err();
        assert!(err.contains("load_model needs init_device"), "{err}");
        let err = m
            .call(&mut worker(), "execute_model", RpcValue::Count(1))
            .unwrap_err();
        assert!(
            err.contains("expects a SchedulerOutput, got Count"),
            "{err}"
        );
        assert_eq!(
            m.call(&mut worker(), "check_health", RpcValue::Unit),
            Ok(RpcValue::Unit)
        );
    }

    #[test]
    fn registered_methods_are_called_and_names_do_not_collide() {
        let mut m = WorkerMethods::builtin();
        m.register("ext:double", |_, a| {
            Ok(RpcValue::Count(
                2 * a.into_count("ext:double").map_err(anyhow::Error::msg)?,
            ))
        })
        .unwrap();
        assert_eq!(
            m.call(&mut worker(), "ext:double", RpcValue::Count(21)),
            Ok(RpcValue::Count(42))
        );
        let err = m
            .register("execute_model", |_, _| Ok(RpcValue::Unit))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`execute_model` is already registered"),
            "{err}"
        );
    }

    /// No built-in method loads plugins, and the one bound to the
    /// operator's `[plugins]` refuses grants, cache folders and plugin
    /// files it was not configured with.
    #[test]
    fn rpc_cannot_grant_what_the_operator_did_not() {
        let builtin = WorkerMethods::builtin();
        assert!(!builtin.names().contains(&"load_logits_processors"));
        let operator = PluginsConfig {
            cache: false,
            ..PluginsConfig::default()
        };
        let mut m = WorkerMethods::builtin();
        m.register_plugin_loading(&operator, "").unwrap();
        let call = |m: &WorkerMethods, args: serde_json::Value| {
            m.call(
                &mut worker(),
                "load_logits_processors",
                RpcValue::Json(args.to_string()),
            )
        };
        let hostile = serde_json::json!({
            "cache": false,
            "paths": ["/tmp/evil.wasm"],
            "grants": [{"plugin": "acme:evil", "dir": "/", "guest": "/root", "writable": true}],
        });
        // The keys the refusal names, in any order.
        let differing = |err: &str| {
            let list = err.split(" configuration in ").nth(1).unwrap_or_default();
            let mut keys: Vec<String> = list
                .split(';')
                .next()
                .unwrap_or_default()
                .split(", ")
                .map(String::from)
                .collect();
            keys.sort();
            keys
        };
        let err = call(&m, hostile).unwrap_err();
        assert!(
            err.contains("refused") && err.contains("only from the operator's"),
            "{err}"
        );
        assert_eq!(differing(&err), ["grants", "paths"], "{err}");
        let err = call(
            &m,
            serde_json::json!({"cache": true, "cache_dir": "/tmp/x"}),
        )
        .unwrap_err();
        assert_eq!(differing(&err), ["cache", "cache_dir"], "{err}");
        // The operator's own section, or none, loads what it names.
        let own = serde_json::to_value(&operator).unwrap();
        assert_eq!(call(&m, own), Ok(RpcValue::Unit));
        assert_eq!(
            m.call(&mut worker(), "load_logits_processors", RpcValue::Unit),
            Ok(RpcValue::Unit)
        );
    }
}
