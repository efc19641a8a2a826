//! Reading a llama-family model out of a GGUF file: the hyper-parameters
//! from `{arch}.*` metadata and the tensors by llama.cpp's names.

use super::{GgufError, GgufFile};
use crate::model::check::{self, ShapeError};
use crate::model::dequant::to_f32;
use crate::model::{LayerWeights, LlamaConfig, ModelWeights, Tensor};

/// Architectures whose GGUF layout is llama's (llama.cpp writes Mistral
/// and Llama 2/3 checkpoints as `llama`).
const LLAMA_ARCHS: &[&str] = &["llama"];

/// RoPE base when `{arch}.rope.freq_base` is absent (llama.cpp's default).
const DEFAULT_ROPE_THETA: f32 = 10_000.0;

impl GgufFile {
    fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        let v = self.get_u64(key)?;
        usize::try_from(v).map_err(|_| GgufError::BadValue {
            path: self.path.clone(),
            key: key.into(),
            expected: "a size that fits in memory".into(),
            found: v.to_string(),
        })
    }

    fn get_usize_or(&self, key: &str, default: usize) -> Result<usize, GgufError> {
        if self.get(key).is_some() {
            self.get_usize(key)
        } else {
            Ok(default)
        }
    }

    fn shape_error(&self, source: ShapeError) -> GgufError {
        GgufError::Shape {
            path: self.path.clone(),
            source,
        }
    }

    /// The model's hyper-parameters, from `general.architecture` and the
    /// `{arch}.*` keys llama.cpp writes.
    pub fn llama_config(&self) -> Result<LlamaConfig, GgufError> {
        let arch = self.get_str("general.architecture")?;
        if !LLAMA_ARCHS.contains(&arch) {
            return Err(GgufError::UnsupportedArchitecture {
                path: self.path.clone(),
                arch: arch.into(),
            });
        }
        let key = |name: &str| format!("{arch}.{name}");
        let hidden_size = self.get_usize(&key("embedding_length"))?;
        let num_attention_heads = self.get_usize(&key("attention.head_count"))?;
        let num_key_value_heads =
            self.get_usize_or(&key("attention.head_count_kv"), num_attention_heads)?;
        let head_dim_key = key("attention.key_length");
        let head_dim = if self.get(&head_dim_key).is_some() {
            self.get_usize(&head_dim_key)?
        } else if num_attention_heads != 0 && hidden_size % num_attention_heads == 0 {
            hidden_size / num_attention_heads
        } else {
            return Err(self.shape_error(ShapeError::Config(format!(
                "embedding_length ({hidden_size}) is not a multiple of attention.head_count \
                 ({num_attention_heads}) and {head_dim_key} is absent"
            ))));
        };
        let vocab_key = key("vocab_size");
        let vocab_size = if self.get(&vocab_key).is_some() {
            self.get_usize(&vocab_key)?
        } else {
            match self.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
                Some(tokens) => tokens.len(),
                None => {
                    return Err(GgufError::MissingKey {
                        path: self.path.clone(),
                        key: vocab_key,
                    })
                }
            }
        };
        let theta_key = key("rope.freq_base");
        let rope_theta = if self.get(&theta_key).is_some() {
            self.get_f32(&theta_key)?
        } else {
            DEFAULT_ROPE_THETA
        };
        if let Some(kind) = self.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            if kind != "none" {
                tracing::warn!(path = %self.path.display(), kind, "RoPE scaling is ignored");
            }
        }
        let config = LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size: self.get_usize(&key("feed_forward_length"))?,
            num_hidden_layers: self.get_usize(&key("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_dim: self.get_usize_or(&key("rope.dimension_count"), head_dim)?,
            rope_theta,
            rms_norm_eps: self.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            max_position_embeddings: self.get_usize(&key("context_length"))?,
            tie_word_embeddings: !self.has_tensor("output.weight"),
        };
        check::validate_config(&config).map_err(|e| self.shape_error(e))?;
        Ok(config)
    }

    /// A norm weight, converted to F32 when stored narrower, so the runner
    /// sees F32 norms from every loader.
    fn norm(&self, name: &str) -> Result<Tensor, GgufError> {
        let t = self.tensor(name)?;
        Ok(if t.dtype == crate::model::DType::F32 {
            t
        } else {
            to_f32(&t)
        })
    }

    /// All weights of a llama model, checked against [`Self::llama_config`].
    /// Matrices stay in the file's types, borrowed from the memory map;
    /// norms are F32.
    pub fn load_weights(&self) -> Result<ModelWeights, GgufError> {
        let config = self.llama_config()?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let t = |name: &str| self.tensor(&format!("blk.{i}.{name}.weight"));
                Ok(LayerWeights {
                    attn_norm: self.norm(&format!("blk.{i}.attn_norm.weight"))?,
                    wq: t("attn_q")?,
                    wk: t("attn_k")?,
                    wv: t("attn_v")?,
                    wo: t("attn_output")?,
                    ffn_norm: self.norm(&format!("blk.{i}.ffn_norm.weight"))?,
                    w_gate: t("ffn_gate")?,
                    w_up: t("ffn_up")?,
                    w_down: t("ffn_down")?,
                })
            })
            .collect::<Result<Vec<_>, GgufError>>()?;
        let weights = ModelWeights {
            embed: self.tensor("token_embd.weight")?,
            layers,
            final_norm: self.norm("output_norm.weight")?,
            lm_head: if config.tie_word_embeddings {
                None
            } else {
                Some(self.tensor("output.weight")?)
            },
            config,
        };
        check::check_weights(&weights).map_err(|e| self.shape_error(e))?;
        Ok(weights)
    }
}
