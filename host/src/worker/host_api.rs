//! The worker's side of a worker extension's host API: for one extension
//! call the worker lends its weights and model runner ([`LentModel`],
//! moved out and back, never copied) and they answer the plugin's
//! `host-api` calls (`crate::plugins::extension`).

use std::sync::Arc;

use super::{Worker, WorkerError};
use crate::model::{dequant, quant, ModelWeights, Storage, Tensor};
use crate::model_runner::DeviceRunner;
use crate::plugins::extension::{HostApi, KvCacheStats, ModelInfo, Weight};

/// A worker's weights and runner, lent to a worker extension for one call.
pub struct LentModel {
    weights: ModelWeights,
    runner: Box<dyn DeviceRunner>,
    model_name: String,
}

impl Worker {
    /// Lends the weights and the runner (the worker cannot step until
    /// [`Worker::restore_model`] gives them back).
    pub fn lend_model(&mut self) -> Result<LentModel, WorkerError> {
        // A sleeping worker's weights may be off the device: wake it first.
        self.check_awake("a worker-extension call")?;
        let (weights, runner) = match (self.weights.take(), self.runner.take()) {
            (Some(w), Some(r)) => (w, r),
            (w, r) => {
                (self.weights, self.runner) = (w, r);
                return Err(WorkerError::OutOfOrder {
                    called: "a worker-extension call",
                    missing: "load_model",
                });
            }
        };
        let model_name = self
            .config
            .model
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        Ok(LentModel {
            weights,
            runner,
            model_name,
        })
    }

    /// Takes back what [`Worker::lend_model`] lent.
    pub fn restore_model(&mut self, lent: LentModel) {
        self.weights = Some(lent.weights);
        self.runner = Some(lent.runner);
    }
}

impl LentModel {
    fn tensor(&self, name: &str) -> Result<&Tensor, String> {
        self.weights
            .tensors()
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| unknown_weight(&self.weights, name))
    }
}

/// The tensor `name` of `weights`, mutably.
fn tensor_mut<'a>(weights: &'a mut ModelWeights, name: &str) -> Option<&'a mut Tensor> {
    let ModelWeights {
        embed,
        layers,
        final_norm,
        lm_head,
        ..
    } = weights;
    let mut all: Vec<&mut Tensor> = vec![embed, final_norm];
    all.extend(lm_head.as_mut());
    for l in layers {
        all.extend([
            &mut l.attn_norm,
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.ffn_norm,
            &mut l.w_gate,
            &mut l.w_up,
            &mut l.w_down,
        ]);
    }
    all.into_iter().find(|t| t.name == name)
}

/// Checks that `values` can replace the tensor `name` of `weights`: the
/// name exists, the count matches its shape, every value is finite.
pub(super) fn check_update(
    weights: &ModelWeights,
    name: &str,
    values: &[f32],
) -> Result<(), String> {
    let t = weights
        .tensors()
        .into_iter()
        .find(|t| t.name == name)
        .ok_or_else(|| unknown_weight(weights, name))?;
    if values.len() != t.numel() {
        return Err(format!(
            "{name} has {} values (shape {:?}), but {} were given",
            t.numel(),
            t.shape,
            values.len()
        ));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("value {i} for {name} is {}, not finite", values[i]));
    }
    Ok(())
}

/// Replaces the tensor `name` of `weights` (checked by [`check_update`])
/// with `values` re-quantized to its own type, and prepares again what the
/// runner builds from it. On failure both keep the old values.
pub(super) fn update_weight(
    weights: &mut ModelWeights,
    runner: &mut dyn DeviceRunner,
    name: &str,
    values: &[f32],
) -> Result<(), String> {
    let unknown = unknown_weight(weights, name);
    let t = tensor_mut(weights, name).ok_or(unknown)?;
    let bytes = quant::quantize(t.dtype, values)
        .ok_or_else(|| format!("{name} cannot be re-quantized to {:?}", t.dtype))?;
    let old = std::mem::replace(&mut t.storage, Storage::Owned(Arc::new(bytes)));
    if let Err(e) = runner.reload_weight(weights, name) {
        // Keep the weights and the runner in agreement: the old values.
        if let Some(t) = tensor_mut(weights, name) {
            t.storage = old;
        }
        return Err(format!(
            "{name} cannot be prepared for the {}: {e}; it keeps its old values",
            runner.device_name()
        ));
    }
    Ok(())
}

/// The error for a weight name that does not exist, with a few that do.
fn unknown_weight(weights: &ModelWeights, name: &str) -> String {
    let names: Vec<&str> = weights
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .take(12)
        .collect();
    format!(
        "no weight named {name:?}; weight-names() lists all {} (e.g. {})",
        weights.tensors().len(),
        names.join(", ")
    )
}

impl HostApi for LentModel {
    fn model_info(&self) -> ModelInfo {
        let c = self.runner.model_config();
        let mut dtypes: Vec<String> = Vec::new();
        for t in self.weights.tensors() {
            let d = format!("{:?}", t.dtype);
            if !dtypes.contains(&d) {
                dtypes.push(d);
            }
        }
        ModelInfo {
            name: self.model_name.clone(),
            architecture: "llama".into(),
            num_layers: c.num_hidden_layers as u32,
            hidden_size: c.hidden_size as u32,
            intermediate_size: c.intermediate_size as u32,
            vocab_size: c.vocab_size as u32,
            num_heads: c.num_attention_heads as u32,
            num_kv_heads: c.num_key_value_heads as u32,
            max_model_len: self.runner.runner_config().max_model_len as u32,
            dtype: dtypes.join(", "),
        }
    }

    fn weight_names(&self) -> Vec<String> {
        self.weights
            .tensors()
            .iter()
            .map(|t| t.name.clone())
            .collect()
    }

    fn read_weight(&self, name: &str) -> Result<Weight, String> {
        let t = self.tensor(name)?;
        Ok(Weight {
            shape: t.shape.iter().map(|&d| d as u32).collect(),
            dtype: format!("{:?}", t.dtype),
            values: dequant::dequantize(t),
        })
    }

    fn update_weight(&mut self, name: &str, values: &[f32]) -> Result<(), String> {
        check_update(&self.weights, name, values)?;
        update_weight(&mut self.weights, self.runner.as_mut(), name, values)
    }

    fn kv_cache_stats(&self) -> KvCacheStats {
        let shape = self.runner.kv_cache_shape();
        KvCacheStats {
            num_blocks: self.runner.num_kv_blocks() as u32,
            block_size: shape.block_size as u32,
            bytes_per_block: self.runner.bytes_per_block() as u64,
            num_layers: shape.num_layers as u32,
            num_kv_heads: shape.num_kv_heads as u32,
            head_dim: shape.head_dim as u32,
        }
    }
}
