//! The worker's method registry: how `collective_rpc` reaches a method by
//! name (vLLM's `getattr(worker, method)`), in the engine's process (`uni`)
//! and in worker processes (`mp`) alike.
//!
//! The built-in methods are the [`Worker`]'s lifecycle and step methods.
//! Worker extensions (plugins) add their own with [`WorkerMethods::register`]
//! under a namespaced name such as `my-ext:reset_stats`; a name that is
//! already taken is refused, as vLLM refuses an extension attribute that
//! conflicts with the worker class.

use std::collections::HashMap;

use super::rpc::RpcValue;
use super::Worker;

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
    /// `is_sleeping` and `update_weights` (`sleep.rs`).
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
                "load_logits_processors",
                Box::new(|w, a| match a {
                    RpcValue::Json(plugins) => Ok(w.load_logits_processors(&plugins).map(|()| RpcValue::Unit)?),
                    other => anyhow::bail!("load_logits_processors expects Json ([plugins]), got {}", other.kind()),
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
        Worker::new(WorkerConfig::for_unit_tests())
        .unwrap()
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
}
