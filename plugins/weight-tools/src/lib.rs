//! `engine:weight-tools`: a worker extension for inspecting and editing the
//! loaded model's weights through `collective_rpc`, on every worker:
//!
//! | method | args | answer |
//! | --- | --- | --- |
//! | `stats` | `{"name": "blk.0.attn_q.weight"}` | `{"name", "shape", "dtype", "count", "min", "max", "mean", "abs_mean"}` |
//! | `scale` | `{"name": "output_norm.weight", "factor": 0.5}` | the stats after scaling |
//! | `weight_names` | none | `["token_embd.weight", ...]` |
//! | `model_info` | none | the model's shape |
//! | `kv_cache_stats` | none | the KV cache's size and layout |
//!
//! `scale` writes through the host's `update-weight` (vLLM's
//! `update_weights` path): the next forward pass uses the new values.

use plugin_sdk::worker_extension::{Host, Metadata, Weight, WorkerExtension};
use serde_json::{json, Value};

/// The extension; it keeps no state between calls.
pub struct WeightTools;

/// The methods, in the order `methods()` lists them.
const METHODS: [&str; 5] = [
    "stats",
    "scale",
    "weight_names",
    "model_info",
    "kv_cache_stats",
];

/// A string field of the args object, or an error naming it.
fn name_arg(args: &Value, method: &str) -> Result<String, String> {
    args.get("name")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| format!("{method} takes {{\"name\": \"<weight name>\"}}"))
}

/// Count, min, max, mean and mean absolute value of a weight, summed in
/// f64 so a large tensor's mean is not rounded away.
fn stats(name: &str, w: &Weight) -> Value {
    let (mut min, mut max, mut sum, mut abs) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0.0);
    for &v in &w.values {
        let v = f64::from(v);
        min = min.min(v);
        max = max.max(v);
        sum += v;
        abs += v.abs();
    }
    let n = w.values.len();
    let mean = |total: f64| if n == 0 { 0.0 } else { total / n as f64 };
    json!({
        "name": name,
        "shape": w.shape,
        "dtype": w.dtype,
        "count": n,
        "min": if n == 0 { 0.0 } else { min },
        "max": if n == 0 { 0.0 } else { max },
        "mean": mean(sum),
        "abs_mean": mean(abs),
    })
}

impl WorkerExtension for WeightTools {
    fn metadata() -> Metadata {
        Metadata::new("engine:weight-tools", "0.1.0")
    }

    fn new(_options: &str) -> Result<Self, String> {
        Ok(WeightTools)
    }

    fn methods(&self) -> Vec<String> {
        METHODS.iter().map(|m| m.to_string()).collect()
    }

    fn call(&mut self, method: &str, args: &str, host: &mut dyn Host) -> Result<String, String> {
        let args: Value =
            serde_json::from_str(args).map_err(|e| format!("args are not JSON: {e}"))?;
        let answer = match method {
            "stats" => {
                let name = name_arg(&args, method)?;
                stats(&name, &host.read_weight(&name)?)
            }
            "scale" => {
                let name = name_arg(&args, method)?;
                let factor = args
                    .get("factor")
                    .and_then(Value::as_f64)
                    .filter(|f| f.is_finite())
                    .ok_or(
                        "scale takes {\"name\": \"<weight name>\", \"factor\": <finite number>}",
                    )?;
                let mut w = host.read_weight(&name)?;
                for v in &mut w.values {
                    *v = (f64::from(*v) * factor) as f32;
                }
                host.update_weight(&name, &w.values)?;
                stats(&name, &host.read_weight(&name)?)
            }
            "weight_names" => json!(host.weight_names()),
            "model_info" => {
                let m = host.model_info();
                json!({
                    "name": m.name, "architecture": m.architecture, "num_layers": m.num_layers,
                    "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
                    "vocab_size": m.vocab_size, "num_heads": m.num_heads,
                    "num_kv_heads": m.num_kv_heads, "max_model_len": m.max_model_len,
                    "dtype": m.dtype,
                })
            }
            "kv_cache_stats" => {
                let k = host.kv_cache_stats();
                json!({
                    "num_blocks": k.num_blocks, "block_size": k.block_size,
                    "bytes_per_block": k.bytes_per_block, "num_layers": k.num_layers,
                    "num_kv_heads": k.num_kv_heads, "head_dim": k.head_dim,
                })
            }
            other => {
                return Err(format!(
                    "no method {other:?}; this extension has {}",
                    METHODS.join(", ")
                ))
            }
        };
        Ok(answer.to_string())
    }
}

plugin_sdk::export_worker_extension!(WeightTools);

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_sdk::worker_extension::{KvCacheStats, ModelInfo};

    /// One weight `w` of shape [2, 2], in memory.
    struct Fake {
        values: Vec<f32>,
    }

    impl Host for Fake {
        fn model_info(&self) -> ModelInfo {
            unimplemented!("not used by these tests")
        }
        fn weight_names(&self) -> Vec<String> {
            vec!["w".into()]
        }
        fn read_weight(&self, name: &str) -> Result<Weight, String> {
            match name {
                "w" => Ok(Weight {
                    shape: vec![2, 2],
                    dtype: "F32".into(),
                    values: self.values.clone(),
                }),
                _ => Err(format!("no weight named {name:?}")),
            }
        }
        fn update_weight(&mut self, _name: &str, values: &[f32]) -> Result<(), String> {
            self.values = values.to_vec();
            Ok(())
        }
        fn kv_cache_stats(&self) -> KvCacheStats {
            unimplemented!("not used by these tests")
        }
    }

    fn call(host: &mut Fake, method: &str, args: &str) -> Result<Value, String> {
        WeightTools
            .call(method, args, host)
            .map(|s| serde_json::from_str(&s).unwrap())
    }

    #[test]
    fn stats_of_a_known_weight() {
        let mut host = Fake {
            values: vec![-2.0, 1.0, 3.0, 2.0],
        };
        let s = call(&mut host, "stats", r#"{"name": "w"}"#).unwrap();
        assert_eq!(s["count"], 4);
        assert_eq!(
            (s["min"].as_f64(), s["max"].as_f64()),
            (Some(-2.0), Some(3.0))
        );
        assert_eq!(
            (s["mean"].as_f64(), s["abs_mean"].as_f64()),
            (Some(1.0), Some(2.0))
        );
        assert_eq!(s["shape"], json!([2, 2]));
    }

    #[test]
    fn scale_writes_through_the_host() {
        let mut host = Fake {
            values: vec![-2.0, 1.0, 3.0, 2.0],
        };
        let s = call(&mut host, "scale", r#"{"name": "w", "factor": 0.5}"#).unwrap();
        assert_eq!(host.values, [-1.0, 0.5, 1.5, 1.0]);
        assert_eq!(s["max"].as_f64(), Some(1.5));
    }

    #[test]
    fn bad_calls_say_what_is_wrong() {
        let mut host = Fake {
            values: vec![0.0; 4],
        };
        let err = call(&mut host, "nope", "null").unwrap_err();
        assert!(err.contains("stats, scale"), "{err}");
        let err = call(&mut host, "stats", "null").unwrap_err();
        assert!(err.contains("{\"name\""), "{err}");
        let err = call(&mut host, "scale", r#"{"name": "w"}"#).unwrap_err();
        assert!(err.contains("factor"), "{err}");
        let err = call(&mut host, "stats", r#"{"name": "x"}"#).unwrap_err();
        assert!(err.contains("no weight named"), "{err}");
    }
}
