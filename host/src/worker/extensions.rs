//! Worker extensions (vLLM's `worker_extension_cls`), registered by the
//! worker: every extension `worker.extension` names is loaded from the
//! plugin host and each of its methods becomes the worker method
//! `<name>.<method>`, which lends the worker's model to the plugin for the
//! call ([`LentModel`](super::LentModel) behind the plugin host's
//! [`HostApi`](crate::plugins::extension::HostApi) trait). The plugin host
//! knows nothing of the worker: this file is the only bridge.

use std::sync::{Arc, Mutex};

use super::{Worker, WorkerMethods};
use crate::config::EngineConfig;
use crate::plugins::extension::WorkerExtension;
use crate::step::RpcValue;

impl WorkerMethods {
    /// Binds the plugin-loading method to the operator's `[plugins]`
    /// ([`WorkerMethods::register_plugin_loading`]), then loads every worker
    /// extension `worker.extension` names and registers its methods as
    /// `<name>.<method>`. Each worker (the `uni` executor's, every `mp`
    /// worker process) does this for itself, from the configuration it was
    /// started with.
    pub fn register_extensions(&mut self, config: &EngineConfig) -> anyhow::Result<()> {
        self.register_plugin_loading(&config.plugins, &config.structured_outputs.backend)?;
        let names = &config.worker.extension;
        if names.is_empty() {
            return Ok(());
        }
        let host = crate::plugins::extension_host_from_config(&config.plugins)?;
        for name in names {
            let ext = host.worker_extension(name)?;
            let exported = ext.methods().to_vec();
            let shared = Arc::new(Mutex::new(ext));
            for method in exported {
                let ext = shared.clone();
                let m = method.clone();
                self.register(format!("{name}.{method}"), move |worker, args| {
                    let mut ext = ext.lock().map_err(|_| {
                        anyhow::anyhow!("a worker extension panicked on another thread")
                    })?;
                    call_on_worker(&mut ext, &m, worker, args)
                })?;
            }
        }
        Ok(())
    }
}

/// One `collective_rpc` of an extension method on `worker`.
fn call_on_worker(
    ext: &mut WorkerExtension,
    method: &str,
    worker: &mut Worker,
    args: RpcValue,
) -> anyhow::Result<RpcValue> {
    let args = match args {
        RpcValue::Unit => "null".to_string(),
        RpcValue::Json(json) => json,
        other => anyhow::bail!(
            "{}.{method} takes JSON arguments, got {}",
            ext.name(),
            other.kind()
        ),
    };
    let lent = worker.lend_model()?;
    let (result, lent) = ext.call(method, &args, lent);
    worker.restore_model(lent);
    Ok(RpcValue::Json(result?))
}
