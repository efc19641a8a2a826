//! Hugging Face checkpoints: `config.json` plus one or more `.safetensors`
//! files (sharded through `model.safetensors.index.json`) holding F32, F16
//! or BF16 tensors.
//!
//! Tensors are renamed to GGUF's names and the Q/K projections' rows are
//! permuted from Hugging Face's rotate-half RoPE layout to GGUF's
//! interleaved one, as llama.cpp's `convert_hf_to_gguf.py` does, so the
//! model runner has a single RoPE convention (see [`crate::model`]).

mod header;
mod hf_config;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use super::check::{self, ShapeError};
use super::dequant::to_f32;
use super::{DType, LayerWeights, ModelWeights, Storage, Tensor};

pub use hf_config::read_config;

/// The sharded checkpoint's index file.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Why a Hugging Face checkpoint cannot be used. Every variant names the
/// file or directory.
#[derive(Debug, Error)]
pub enum SafetensorsError {
    /// A file cannot be read or mapped.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The directory is not a safetensors checkpoint.
    #[error("{} is not a Hugging Face checkpoint: {reason}", path.display())]
    NotACheckpoint {
        /// The directory.
        path: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// A safetensors header or the shard index is malformed.
    #[error("{} is malformed: {reason}", path.display())]
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor has a dtype other than F32, F16 or BF16.
    #[error(
        "{}: tensor `{tensor}` has dtype {dtype}, which is not supported; \
         save the checkpoint in float32, float16 or bfloat16",
        path.display()
    )]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor (Hugging Face name).
        tensor: String,
        /// The safetensors dtype.
        dtype: String,
    },
    /// A `config.json` key is missing or unusable.
    #[error("{}: `{key}` {reason}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the model needs is in no shard.
    #[error("{}: tensor `{tensor}` is missing from the checkpoint", path.display())]
    MissingTensor {
        /// The directory.
        path: PathBuf,
        /// The tensor (Hugging Face name).
        tensor: String,
    },
    /// The config and the tensors do not form a runnable llama.
    #[error("{}: {source}", path.display())]
    Shape {
        /// The directory or config file.
        path: PathBuf,
        /// The inconsistency.
        source: ShapeError,
    },
}

/// The shard files of the checkpoint in `dir`: those the index lists, or
/// else every `.safetensors` file.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, SafetensorsError> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let bad = |reason: String| SafetensorsError::Header {
            path: index.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&index).map_err(|source| SafetensorsError::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("`weight_map` is missing or not an object".into()))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if files.is_empty() || map.values().any(|v| !v.is_string()) {
            return Err(bad(
                "`weight_map` must map tensor names to file names".into()
            ));
        }
        if let Some(f) = files
            .iter()
            .find(|f| Path::new(f).file_name() != Some(f.as_ref()))
        {
            return Err(bad(format!(
                "shard `{f}` is not a plain file name in the same directory"
            )));
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let entries = std::fs::read_dir(dir).map_err(|source| SafetensorsError::Io {
        path: dir.into(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(SafetensorsError::NotACheckpoint {
            path: dir.into(),
            reason: format!("it holds no .safetensors file and no {INDEX_FILE}"),
        });
    }
    Ok(files)
}

/// Rows of a Q or K projection reordered from rotate-half RoPE (each
/// head's first half pairs with its second half) to interleaved RoPE
/// (adjacent rows pair): within each head of `head_dim` rows, new row
/// `2i + j` is old row `j * head_dim / 2 + i`.
pub fn permute_rows_for_interleaved_rope(t: &Tensor, n_heads: usize) -> Tensor {
    let rows = t.rows();
    let head_dim = rows / n_heads.max(1);
    let row_bytes = t.storage.bytes().len() / rows.max(1);
    let src = t.storage.bytes();
    let mut out = Vec::with_capacity(src.len());
    for h in 0..n_heads {
        for i in 0..head_dim / 2 {
            for j in 0..2 {
                let r = h * head_dim + j * (head_dim / 2) + i;
                out.extend_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
            }
        }
    }
    Tensor {
        storage: Storage::Owned(Arc::new(out)),
        ..t.clone()
    }
}

/// Tensors of a checkpoint by Hugging Face name, handed out renamed.
struct Shards {
    dir: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl Shards {
    fn take(&mut self, hf_name: &str, gguf_name: &str) -> Result<Tensor, SafetensorsError> {
        let mut t =
            self.tensors
                .remove(hf_name)
                .ok_or_else(|| SafetensorsError::MissingTensor {
                    path: self.dir.clone(),
                    tensor: hf_name.into(),
                })?;
        t.name = gguf_name.into();
        Ok(t)
    }

    /// A norm weight as F32, the type every loader gives norms.
    fn norm(&mut self, hf_name: &str, gguf_name: &str) -> Result<Tensor, SafetensorsError> {
        let t = self.take(hf_name, gguf_name)?;
        Ok(if t.dtype == DType::F32 { t } else { to_f32(&t) })
    }

    /// A Q or K projection, permuted for interleaved RoPE once its shape
    /// is known to be `[n_heads * head_dim, hidden]`.
    fn rope_proj(
        &mut self,
        hf_name: &str,
        gguf_name: &str,
        n_heads: usize,
        expected: [usize; 2],
    ) -> Result<Tensor, SafetensorsError> {
        let t = self.take(hf_name, gguf_name)?;
        check::check_tensor(&t, &expected).map_err(|source| SafetensorsError::Shape {
            path: self.dir.clone(),
            source,
        })?;
        Ok(permute_rows_for_interleaved_rope(&t, n_heads))
    }
}

/// Loads the Hugging Face llama checkpoint in `dir` (`config.json` and
/// safetensors shards). Matrices keep their stored type (borrowed from the
/// memory map, Q/K owned after permutation); norms are F32.
pub fn load_safetensors(dir: &Path) -> Result<ModelWeights, SafetensorsError> {
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(SafetensorsError::NotACheckpoint {
            path: dir.into(),
            reason: "config.json is missing".into(),
        });
    }
    let config = read_config(&config_path)?;
    let mut shards = Shards {
        dir: dir.into(),
        tensors: HashMap::new(),
    };
    for file in shard_files(dir)? {
        for (name, t) in header::read_tensors(&file)? {
            if shards.tensors.insert(name.clone(), t).is_some() {
                return Err(SafetensorsError::Header {
                    path: file,
                    reason: format!("tensor `{name}` is also in another shard"),
                });
            }
        }
    }
    let (h, q, kv) = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    );
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let hf = |s: &str| format!("model.layers.{i}.{s}.weight");
        let gg = |s: &str| format!("blk.{i}.{s}.weight");
        let s = &mut shards;
        layers.push(LayerWeights {
            attn_norm: s.norm(&hf("input_layernorm"), &gg("attn_norm"))?,
            wq: s.rope_proj(
                &hf("self_attn.q_proj"),
                &gg("attn_q"),
                config.num_attention_heads,
                [q, h],
            )?,
            wk: s.rope_proj(
                &hf("self_attn.k_proj"),
                &gg("attn_k"),
                config.num_key_value_heads,
                [kv, h],
            )?,
            wv: s.take(&hf("self_attn.v_proj"), &gg("attn_v"))?,
            wo: s.take(&hf("self_attn.o_proj"), &gg("attn_output"))?,
            ffn_norm: s.norm(&hf("post_attention_layernorm"), &gg("ffn_norm"))?,
            w_gate: s.take(&hf("mlp.gate_proj"), &gg("ffn_gate"))?,
            w_up: s.take(&hf("mlp.up_proj"), &gg("ffn_up"))?,
            w_down: s.take(&hf("mlp.down_proj"), &gg("ffn_down"))?,
        });
    }
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(shards.take("lm_head.weight", "output.weight")?)
    };
    let weights = ModelWeights {
        embed: shards.take("model.embed_tokens.weight", "token_embd.weight")?,
        layers,
        final_norm: shards.norm("model.norm.weight", "output_norm.weight")?,
        lm_head,
        config,
    };
    check::check_weights(&weights).map_err(|source| SafetensorsError::Shape {
        path: dir.into(),
        source,
    })?;
    Ok(weights)
}

#[cfg(test)]
mod tests;
