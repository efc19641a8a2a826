//! Dummy weights for any llama shape, as vLLM's `load_format = "dummy"`:
//! random values from a seeded generator, for memory and speed work on
//! shapes whose real weights are not at hand.
//!
//! Each matrix is uniform with standard deviation `0.5 / sqrt(in_features)`
//! (and the embedding likewise over `hidden`), so every projection roughly
//! halves the scale of its normalised input: activations stay finite and
//! of order one through any depth, and tied logits stay moderate. Norm
//! weights are 1.0 (F32), as in a freshly initialised model.

use std::sync::Arc;

use thiserror::Error;

use super::check::{self, ShapeError};
use super::quant::quantize;
use super::{DType, LayerWeights, LlamaConfig, ModelWeights, Storage, Tensor};

/// Why dummy weights cannot be made for a config.
#[derive(Debug, Error)]
pub enum DummyError {
    /// The config is not a runnable llama.
    #[error("cannot generate dummy weights: {0}")]
    Shape(#[from] ShapeError),
    /// A quantized type needs rows that are whole blocks.
    #[error(
        "cannot generate dummy {dtype:?} weights: `{tensor}` has rows of {cols} elements, \
         not a multiple of {block}; choose F32, F16 or BF16 for this shape"
    )]
    NotBlocks {
        /// The requested type.
        dtype: DType,
        /// The first tensor whose rows do not fit.
        tensor: String,
        /// Its row length.
        cols: usize,
        /// The type's block length.
        block: usize,
    },
}

/// Named shapes for dummy runs: `(name, config)`.
pub fn presets() -> Vec<(&'static str, LlamaConfig)> {
    let llama = |vocab, hidden, ffn, layers, heads, kv, theta, ctx, tied| LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim: hidden / heads,
        rope_dim: hidden / heads,
        rope_theta: theta,
        rms_norm_eps: 1e-5,
        max_position_embeddings: ctx,
        tie_word_embeddings: tied,
    };
    vec![
        (
            "smollm2-135m",
            llama(49_152, 576, 1536, 30, 9, 3, 100_000.0, 8192, true),
        ),
        (
            "llama-3.2-1b",
            llama(128_256, 2048, 8192, 16, 32, 8, 500_000.0, 131_072, true),
        ),
        (
            "llama-3.1-8b",
            llama(128_256, 4096, 14_336, 32, 32, 8, 500_000.0, 131_072, false),
        ),
    ]
}

/// The preset called `name` (see [`presets`]).
pub fn preset(name: &str) -> Option<LlamaConfig> {
    presets()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| c)
}

/// SplitMix64: tiny, fast and statistically sound enough for weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A generator for one tensor, keyed by the seed and the tensor's name so
/// each tensor is the same whatever order (or thread) generates it.
fn rng_for(seed: u64, name: &str) -> SplitMix64 {
    // FNV-1a of the name.
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    SplitMix64(seed ^ h)
}

fn owned(name: String, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Tensor {
    Tensor {
        name,
        dtype,
        shape,
        storage: Storage::Owned(Arc::new(bytes)),
    }
}

/// A random `[rows, cols]` matrix; rows must be whole blocks of `dtype`
/// (checked by the caller).
fn matrix(name: String, rows: usize, cols: usize, dtype: DType, seed: u64) -> Tensor {
    let mut rng = rng_for(seed, &name);
    let scale = 0.5 * (3.0 / cols as f32).sqrt();
    let mut bytes = Vec::with_capacity(dtype.bytes_for(rows * cols).unwrap_or(0));
    let mut row = vec![0.0f32; cols];
    for _ in 0..rows {
        row.iter_mut().for_each(|x| *x = scale * rng.unit());
        bytes.extend(quantize(dtype, &row).unwrap_or_default());
    }
    owned(name, dtype, vec![rows, cols], bytes)
}

fn ones(name: String, n: usize) -> Tensor {
    owned(name, DType::F32, vec![n], 1.0f32.to_le_bytes().repeat(n))
}

fn layer(c: &LlamaConfig, i: usize, dtype: DType, seed: u64) -> LayerWeights {
    let (h, q, kv, ff) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    let m =
        |name: &str, rows, cols| matrix(format!("blk.{i}.{name}.weight"), rows, cols, dtype, seed);
    LayerWeights {
        attn_norm: ones(format!("blk.{i}.attn_norm.weight"), h),
        wq: m("attn_q", q, h),
        wk: m("attn_k", kv, h),
        wv: m("attn_v", kv, h),
        wo: m("attn_output", h, q),
        ffn_norm: ones(format!("blk.{i}.ffn_norm.weight"), h),
        w_gate: m("ffn_gate", ff, h),
        w_up: m("ffn_up", ff, h),
        w_down: m("ffn_down", h, ff),
    }
}

/// Random weights of shape `config` in `dtype` (norms F32), deterministic
/// in `seed`. Layers are generated on all cores.
pub fn dummy_weights(
    config: &LlamaConfig,
    dtype: DType,
    seed: u64,
) -> Result<ModelWeights, DummyError> {
    check::validate_config(config)?;
    let q = config.num_attention_heads * config.head_dim;
    let row_lengths = [
        ("token_embd.weight", config.hidden_size),
        ("blk.0.attn_output.weight", q),
        ("blk.0.ffn_down.weight", config.intermediate_size),
    ];
    let block = dtype.block_len();
    if let Some((tensor, cols)) = row_lengths.into_iter().find(|(_, cols)| cols % block != 0) {
        return Err(DummyError::NotBlocks {
            dtype,
            tensor: tensor.into(),
            cols,
            block,
        });
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = config.num_hidden_layers.div_ceil(threads).max(1);
    let indices: Vec<usize> = (0..config.num_hidden_layers).collect();
    let layers = std::thread::scope(|s| {
        let handles: Vec<_> = indices
            .chunks(per_thread)
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|&i| layer(config, i, dtype, seed))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let (v, h) = (config.vocab_size, config.hidden_size);
    let weights = ModelWeights {
        embed: matrix("token_embd.weight".into(), v, h, dtype, seed),
        layers,
        final_norm: ones("output_norm.weight".into(), h),
        lm_head: (!config.tie_word_embeddings)
            .then(|| matrix("output.weight".into(), v, h, dtype, seed)),
        config: config.clone(),
    };
    check::check_weights(&weights)?;
    Ok(weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant::dequantize;

    fn tiny() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 96,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rope_dim: 16,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 128,
            tie_word_embeddings: false,
        }
    }

    #[test]
    fn every_dtype_has_the_config_shapes_and_is_deterministic() {
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
        ] {
            // dummy_weights ran check_weights; spot-check what it does not.
            let a = dummy_weights(&tiny(), dtype, 7).unwrap();
            assert_eq!(a.layers.len(), 3);
            assert_eq!(a.layers[2].w_down.dtype, dtype);
            assert_eq!(a.layers[2].w_down.shape, vec![64, 96]);
            assert_eq!(a.final_norm.dtype, DType::F32);
            assert!(dequantize(&a.layers[1].ffn_norm).iter().all(|&x| x == 1.0));
            let wq = |w: &ModelWeights| dequantize(&w.layers[1].wq);
            assert_eq!(
                wq(&a),
                wq(&dummy_weights(&tiny(), dtype, 7).unwrap()),
                "{dtype:?}"
            );
            assert_ne!(
                wq(&a),
                wq(&dummy_weights(&tiny(), dtype, 8).unwrap()),
                "{dtype:?}"
            );
            assert_ne!(dequantize(&a.layers[1].wk)[..64], wq(&a)[..64], "{dtype:?}");
        }
    }

    #[test]
    fn values_have_the_documented_spread() {
        let w = dummy_weights(&tiny(), DType::F32, 1).unwrap();
        for t in [&w.layers[0].w_down, &w.embed, w.lm_head.as_ref().unwrap()] {
            let xs = dequantize(t);
            let n = xs.len() as f32;
            let mean = xs.iter().sum::<f32>() / n;
            let std = (xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n).sqrt();
            let want = 0.5 / (t.cols() as f32).sqrt();
            assert!(mean.abs() < 0.1 * want, "{}: mean {mean}", t.name);
            assert!(
                (std / want - 1.0).abs() < 0.05,
                "{}: std {std}, want {want}",
                t.name
            );
            assert!(
                xs.iter().all(|x| x.abs() <= want * 3f32.sqrt()),
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn tied_configs_have_no_lm_head() {
        let c = LlamaConfig {
            tie_word_embeddings: true,
            ..tiny()
        };
        assert!(dummy_weights(&c, DType::BF16, 0).unwrap().lm_head.is_none());
    }

    #[test]
    fn unfit_shapes_are_errors() {
        let c = LlamaConfig {
            intermediate_size: 80,
            ..tiny()
        };
        let e = dummy_weights(&c, DType::Q4_1, 0).unwrap_err();
        assert!(e.to_string().contains("blk.0.ffn_down.weight"), "{e}");
        assert!(dummy_weights(&c, DType::F16, 0).is_ok());
        let c = LlamaConfig {
            num_key_value_heads: 3,
            ..tiny()
        };
        let e = dummy_weights(&c, DType::F32, 0).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads (3)"), "{e}");
    }

    #[test]
    fn presets_are_valid_and_named() {
        for (name, c) in presets() {
            check::validate_config(&c).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(preset(name), Some(c));
        }
        assert_eq!(
            preset("llama-3.1-8b").map(|c| c.num_hidden_layers),
            Some(32)
        );
        assert_eq!(preset("nope"), None);
    }
}
