//! `{{name}}`: a worker extension for the `host` engine (vLLM's
//! `worker_extension_cls`, sandboxed).
//!
//! An extension exports named methods that the engine reaches on every
//! worker with `collective_rpc("{{name}}.<method>", args)`: from the
//! offline API (`Llm::collective_rpc`), the engine core's utility call, or
//! the server's opt-in `POST /collective_rpc`. During a call it may use the
//! worker through [`Host`]: model info, weights by name (read dequantized,
//! update), the KV cache's layout.
//!
//! This one exports `summary` (the model's shape and KV cache) and
//! `weight_mean` (`{"name": "output_norm.weight"}` → count and mean).
//!
//! Build: `host plugin build`. Load: `host --plugin <the .wasm> --set
//! 'worker.extension=["{{name}}"]' --set server.enable_rpc_endpoint=true
//! serve`, then `curl -d '{"method": "{{name}}.summary"}'
//! localhost:8000/collective_rpc`.

use plugin_sdk::worker_extension::{Host, Metadata, WorkerExtension};
use serde_json::{json, Value};

/// The extension.
pub struct Extension;

impl WorkerExtension for Extension {
    /// Name (`worker.extension = ["{{name}}"]`), version and options.
    fn metadata() -> Metadata {
        Metadata::new("{{name}}", env!("CARGO_PKG_VERSION"))
    }

    /// Called once per worker with the options JSON object (`{}` when none).
    fn new(_options: &str) -> Result<Self, String> {
        plugin_sdk::info!("started");
        Ok(Extension)
    }

    /// The methods `call` accepts, reached as `{{name}}.<method>`.
    fn methods(&self) -> Vec<String> {
        vec!["summary".into(), "weight_mean".into()]
    }

    /// Runs `method` with `args` (JSON text, `null` when none) and returns
    /// its answer as JSON text; an error is returned to the caller.
    fn call(&mut self, method: &str, args: &str, host: &mut dyn Host) -> Result<String, String> {
        let args: Value =
            serde_json::from_str(args).map_err(|e| format!("args are not JSON: {e}"))?;
        let answer = match method {
            "summary" => {
                let m = host.model_info();
                let kv = host.kv_cache_stats();
                json!({
                    "name": m.name,
                    "architecture": m.architecture,
                    "num_layers": m.num_layers,
                    "hidden_size": m.hidden_size,
                    "vocab_size": m.vocab_size,
                    "kv_cache_blocks": kv.num_blocks,
                    "block_size": kv.block_size,
                })
            }
            "weight_mean" => {
                let name = args["name"]
                    .as_str()
                    .ok_or("weight_mean takes {\"name\": \"<weight name>\"}")?;
                let w = host.read_weight(name)?;
                let mean = w.values.iter().map(|&v| f64::from(v)).sum::<f64>()
                    / w.values.len().max(1) as f64;
                json!({ "name": name, "dtype": w.dtype, "count": w.values.len(), "mean": mean })
            }
            other => {
                return Err(format!(
                    "unknown method {other:?}; this extension has summary, weight_mean"
                ))
            }
        };
        Ok(answer.to_string())
    }
}

// Exports `Extension` as the component's `engine:plugins/worker-extension`.
plugin_sdk::export_worker_extension!(Extension);

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_sdk::worker_extension::{KvCacheStats, ModelInfo, Weight};

    /// A stand-in worker for native tests.
    struct FakeHost;

    impl Host for FakeHost {
        fn model_info(&self) -> ModelInfo {
            ModelInfo {
                name: "tiny".into(),
                architecture: "llama".into(),
                num_layers: 2,
                hidden_size: 4,
                intermediate_size: 8,
                vocab_size: 10,
                num_heads: 1,
                num_kv_heads: 1,
                max_model_len: 16,
                dtype: "F32".into(),
            }
        }
        fn weight_names(&self) -> Vec<String> {
            vec!["w".into()]
        }
        fn read_weight(&self, name: &str) -> Result<Weight, String> {
            match name {
                "w" => Ok(Weight {
                    shape: vec![4],
                    dtype: "F32".into(),
                    values: vec![1.0, 2.0, 3.0, 6.0],
                }),
                _ => Err(format!("no weight {name:?}; there is w")),
            }
        }
        fn update_weight(&mut self, _name: &str, _values: &[f32]) -> Result<(), String> {
            Ok(())
        }
        fn kv_cache_stats(&self) -> KvCacheStats {
            KvCacheStats {
                num_blocks: 8,
                block_size: 16,
                bytes_per_block: 1024,
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 4,
            }
        }
    }

    #[test]
    fn methods_answer_json() {
        let mut e = Extension::new("{}").unwrap();
        let s: Value =
            serde_json::from_str(&e.call("summary", "null", &mut FakeHost).unwrap()).unwrap();
        assert_eq!(s["num_layers"], 2);
        let m: Value = serde_json::from_str(
            &e.call("weight_mean", r#"{"name": "w"}"#, &mut FakeHost)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (m["count"].as_u64(), m["mean"].as_f64()),
            (Some(4), Some(3.0))
        );
        assert!(e.call("nope", "null", &mut FakeHost).is_err());
        assert!(e
            .call("weight_mean", r#"{"name": "x"}"#, &mut FakeHost)
            .is_err());
    }
}
