//! The engine core's utility calls (vLLM's `EngineCore` methods a client
//! calls by name between steps): the prefix cache, `collective_rpc`, sleep
//! mode and weight updates.
//!
//! Sleep mode: `sleep` puts every worker to sleep (freeing the KV cache and
//! offloading or dropping the weights) once nothing runs; requests added
//! meanwhile wait, unscheduled, until `wake_up` has woken everything. The
//! KV cache wakes empty, so sleeping forgets the cached prefixes, and so
//! does a weight update (they were computed with the old weights).

use serde_json::Value;

use super::EngineCore;
use crate::step::RpcValue;

/// The methods [`EngineCore::call_utility`] knows.
pub const UTILITY_METHODS: &[&str] = &[
    "reset_prefix_cache",
    "collective_rpc",
    "sleep",
    "wake_up",
    "is_sleeping",
    "update_weights",
];

impl EngineCore {
    /// Forgets every cached prefix (a utility call, e.g. after new weights).
    pub fn reset_prefix_cache(&mut self) {
        self.scheduler.reset_prefix_cache();
    }

    /// Calls an engine method by name (a UTILITY request from a client);
    /// see [`UTILITY_METHODS`]. `collective_rpc` takes `{"method": …,
    /// "args": …}` (the args and each worker's reply cross as JSON);
    /// `sleep` a level (1 or 2, default 1) or `{"level": n}`; `wake_up` a
    /// list of tags (`weights`, `kv_cache`; default all) or `{"tags": […]}`;
    /// `update_weights` an object of tensor name → every value. Errors are
    /// messages for the caller; the engine carries on.
    pub fn call_utility(&mut self, method: &str, args: Value) -> Result<Value, String> {
        let result = self.dispatch_utility(method, args);
        // A reset, new weights or sleep forget the cached prefixes now, not
        // at the next step.
        self.flush_kv_events();
        result
    }

    fn dispatch_utility(&mut self, method: &str, args: Value) -> Result<Value, String> {
        match method {
            "reset_prefix_cache" => {
                self.reset_prefix_cache();
                Ok(Value::Bool(true))
            }
            "collective_rpc" => {
                let Some(rpc_method) = args.get("method").and_then(Value::as_str) else {
                    return Err("collective_rpc needs {\"method\": \"<name>\", \"args\": …}".into());
                };
                // A method without arguments gets none rather than a JSON null.
                let rpc_args = match args.get("args") {
                    None | Some(Value::Null) => RpcValue::Unit,
                    Some(a) => RpcValue::Json(a.to_string()),
                };
                let replies = self.call_workers(rpc_method, rpc_args)?;
                if let Some(r) = self.restart.as_mut() {
                    r.note_collective_rpc(rpc_method);
                }
                if rpc_method == "update_weights" {
                    // Prefixes cached with the old weights are stale.
                    self.reset_prefix_cache();
                }
                Ok(Value::Array(replies))
            }
            "sleep" => {
                let level = match args.get("level").unwrap_or(&args) {
                    Value::Null => 1,
                    v => v
                        .as_u64()
                        .ok_or_else(|| format!("sleep expects a level, 1 or 2; got {v}"))?,
                };
                self.sleep(level).map(|()| Value::Null)
            }
            "wake_up" => {
                let tags = match args.get("tags").unwrap_or(&args) {
                    Value::Null => None,
                    v => Some(
                        serde_json::from_value::<Vec<String>>(v.clone()).map_err(|_| {
                            format!("wake_up expects a list of tags, e.g. [\"weights\"]; got {v}")
                        })?,
                    ),
                };
                self.wake_up(tags.as_deref()).map(|()| Value::Null)
            }
            "is_sleeping" => Ok(Value::Bool(self.is_sleeping())),
            "update_weights" => {
                if !args.is_object() {
                    return Err(format!(
                        "update_weights expects an object of tensor name -> list of values; got {args}"
                    ));
                }
                // The same path as a client's collective_rpc of it, which
                // also forgets the prefixes cached with the old weights.
                let call = serde_json::json!({ "method": "update_weights", "args": args });
                self.call_utility("collective_rpc", call)
                    .map(|_| Value::Null)
            }
            other => Err(format!(
                "unknown utility method `{other}`; known: {}",
                UTILITY_METHODS.join(", ")
            )),
        }
    }

    /// Puts every worker to sleep at `level` (1: weights offloaded to host
    /// memory; 2: weights dropped; the KV cache is dropped at both). Needs
    /// an idle engine: no unfinished request and no step in flight.
    pub fn sleep(&mut self, level: u64) -> Result<(), String> {
        if self.sleeping {
            return Err("the engine already sleeps; call wake_up first".into());
        }
        let unfinished = self.scheduler.num_running() + self.scheduler.num_waiting();
        if unfinished > 0 {
            return Err(format!(
                "sleep needs an idle engine, but {unfinished} requests are unfinished; \
                 wait for them or abort them first"
            ));
        }
        // Requests finished (or aborted) since the last step still sit in
        // the workers' batches: one empty step tells the workers, and every
        // step in flight is collected.
        while self.scheduler.has_finished_requests() || !self.in_flight.is_empty() {
            self.submit().map_err(|e| e.to_string())?;
            self.submitted = false;
            self.collect().map_err(|e| e.to_string())?;
        }
        self.call_workers("sleep", RpcValue::Count(level))?;
        self.reset_prefix_cache();
        self.sleeping = true;
        Ok(())
    }

    /// Wakes what `tags` names on every worker (all when `None`); the
    /// engine steps again once nothing sleeps.
    pub fn wake_up(&mut self, tags: Option<&[String]>) -> Result<(), String> {
        let args = match tags {
            None => RpcValue::Unit,
            Some(tags) => RpcValue::Json(serde_json::to_string(tags).map_err(|e| e.to_string())?),
        };
        self.call_workers("wake_up", args)?;
        let replies = self.call_workers("is_sleeping", RpcValue::Unit)?;
        self.sleeping = replies.iter().any(|r| r.as_bool() != Some(false));
        Ok(())
    }

    /// Whether the engine sleeps (some worker has something asleep).
    pub fn is_sleeping(&self) -> bool {
        self.sleeping
    }

    /// Calls `method` on every worker; the replies as JSON, in rank order.
    fn call_workers(&mut self, method: &str, args: RpcValue) -> Result<Vec<Value>, String> {
        let timeout = self.executor.execute_model_timeout();
        let replies = self
            .executor
            .call(method, args, None, timeout)
            .map_err(|e| e.to_string())?;
        replies.into_iter().map(rpc_reply_to_json).collect()
    }
}

/// A worker's reply to a utility call, as JSON.
fn rpc_reply_to_json(reply: RpcValue) -> Result<Value, String> {
    match reply {
        RpcValue::Unit => Ok(Value::Null),
        RpcValue::Count(n) => Ok(n.into()),
        RpcValue::Json(text) => serde_json::from_str(&text)
            .map_err(|e| format!("a worker replied with invalid JSON: {e}")),
        other => Err(format!(
            "a worker replied with a {} value, which has no JSON form",
            other.kind()
        )),
    }
}
