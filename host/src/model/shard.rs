//! Megatron-LM sharding of llama weights across `n` tensor-parallel ranks.
//!
//! Rank `r` of `n` owns whole heads: query heads `[r·H/n, (r+1)·H/n)` and the
//! KV heads they read (`[r·KV/n, (r+1)·KV/n)`, so grouped-query attention stays
//! local), and `FF/n` MLP channels. Q, K, V, gate and up are split by output
//! rows; the attention output and down projections by input columns, so each
//! rank's output is a partial sum that an all-reduce completes. Embedding,
//! norms and `lm_head` are replicated. The sharded [`ModelWeights`] carries a
//! config with the rank's head and channel counts, so the model runner runs
//! it unchanged, plus the two all-reduces.
//!
//! Quantized rows are blocks of 32 along the input dimension, so a column
//! split must fall on block boundaries; row splits always do.

use std::sync::Arc;

use thiserror::Error;

use super::{LayerWeights, LlamaConfig, ModelWeights, Storage, Tensor};

/// Why weights cannot be sharded.
#[derive(Debug, Error, PartialEq)]
pub enum ShardError {
    /// The model's shape does not divide into `size` ranks.
    #[error(
        "parallel.tensor_parallel_size = {size} does not fit this model: {reason}; \
         sizes that work: {valid}"
    )]
    Size {
        /// The requested tensor-parallel size.
        size: usize,
        /// The first condition it breaks.
        reason: String,
        /// The sizes this model accepts, comma-separated.
        valid: String,
    },
    /// A tensor's bytes do not match its shape (checked at load; a bug if hit).
    #[error("cannot shard `{tensor}`: {reason}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
}

/// The largest block length among the column-split matrices (1 for floats).
fn column_block(w: &ModelWeights) -> usize {
    w.layers
        .iter()
        .flat_map(|l| [l.wo.dtype.block_len(), l.w_down.dtype.block_len()])
        .max()
        .unwrap_or(1)
}

/// Why `n` ranks cannot shard a model of config `c` whose column-split
/// matrices have blocks of `block` elements, or `None` when they can.
fn why_not(c: &LlamaConfig, block: usize, n: usize) -> Option<String> {
    let (h, kv, ff) = (
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
    );
    if n == 0 {
        Some("it must be at least 1".into())
    } else if h % n != 0 || kv % n != 0 {
        Some(format!(
            "it must divide both the {h} query heads and the {kv} key/value heads"
        ))
    } else if ff % n != 0 {
        Some(format!("it must divide the MLP width {ff}"))
    } else if !(h / n * c.head_dim).is_multiple_of(block) || !(ff / n).is_multiple_of(block) {
        Some(format!(
            "each rank's share of the attention output ({} columns) and of the MLP ({} columns) \
             must be whole quantization blocks of {block}",
            h / n * c.head_dim,
            ff / n
        ))
    } else {
        None
    }
}

/// The tensor-parallel sizes `w` can be sharded into, smallest first.
pub fn valid_sizes(w: &ModelWeights) -> Vec<usize> {
    let block = column_block(w);
    (1..=w.config.num_key_value_heads)
        .filter(|&n| why_not(&w.config, block, n).is_none())
        .collect()
}

/// Checks that `w` can be sharded into `n` ranks; the error lists the sizes
/// that work.
pub fn check_size(w: &ModelWeights, n: usize) -> Result<(), ShardError> {
    match why_not(&w.config, column_block(w), n) {
        None => Ok(()),
        Some(reason) => Err(ShardError::Size {
            size: n,
            reason,
            valid: valid_sizes(w)
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Rank `rank`'s shard of `w` for `n` ranks (a clone when `n == 1`).
pub fn shard(w: &ModelWeights, rank: usize, n: usize) -> Result<ModelWeights, ShardError> {
    check_size(w, n)?;
    if rank >= n {
        return Err(ShardError::Size {
            size: n,
            reason: format!("rank {rank} does not exist"),
            valid: format!("ranks 0..{n}"),
        });
    }
    let c = &w.config;
    let hd = c.head_dim;
    let (q, kv, ff) = (
        c.num_attention_heads / n * hd,
        c.num_key_value_heads / n * hd,
        c.intermediate_size / n,
    );
    let layers = w
        .layers
        .iter()
        .map(|l| {
            Ok(LayerWeights {
                attn_norm: l.attn_norm.clone(),
                wq: rows(&l.wq, rank * q, q)?,
                wk: rows(&l.wk, rank * kv, kv)?,
                wv: rows(&l.wv, rank * kv, kv)?,
                wo: cols(&l.wo, rank * q, q)?,
                ffn_norm: l.ffn_norm.clone(),
                w_gate: rows(&l.w_gate, rank * ff, ff)?,
                w_up: rows(&l.w_up, rank * ff, ff)?,
                w_down: cols(&l.w_down, rank * ff, ff)?,
            })
        })
        .collect::<Result<Vec<_>, ShardError>>()?;
    Ok(ModelWeights {
        config: LlamaConfig {
            num_attention_heads: c.num_attention_heads / n,
            num_key_value_heads: c.num_key_value_heads / n,
            intermediate_size: ff,
            ..c.clone()
        },
        embed: w.embed.clone(),
        layers,
        final_norm: w.final_norm.clone(),
        lm_head: w.lm_head.clone(),
    })
}

/// Bytes of one row of `t`.
fn row_bytes(t: &Tensor) -> Result<usize, ShardError> {
    t.dtype
        .bytes_for(t.cols())
        .ok_or_else(|| ShardError::Tensor {
            tensor: t.name.clone(),
            reason: format!("rows of {} are not whole {:?} blocks", t.cols(), t.dtype),
        })
}

/// Rows `[start, start + len)` of matrix `t`; a slice of a memory map stays
/// mapped (no copy).
pub fn rows(t: &Tensor, start: usize, len: usize) -> Result<Tensor, ShardError> {
    let rb = row_bytes(t)?;
    if t.shape.len() != 2 || start + len > t.rows() {
        return Err(ShardError::Tensor {
            tensor: t.name.clone(),
            reason: format!("rows {start}..{} of shape {:?}", start + len, t.shape),
        });
    }
    let (from, bytes) = (start * rb, len * rb);
    let storage = match &t.storage {
        Storage::Mapped { map, offset, .. } => Storage::Mapped {
            map: map.clone(),
            offset: offset + from,
            len: bytes,
        },
        Storage::Owned(v) => Storage::Owned(Arc::new(v[from..from + bytes].to_vec())),
    };
    Ok(Tensor {
        name: t.name.clone(),
        dtype: t.dtype,
        shape: vec![len, t.cols()],
        storage,
    })
}

/// Columns `[start, start + len)` of matrix `t`; both must fall on block
/// boundaries of its type.
pub fn cols(t: &Tensor, start: usize, len: usize) -> Result<Tensor, ShardError> {
    let block = t.dtype.block_len();
    if t.shape.len() != 2
        || start + len > t.cols()
        || !start.is_multiple_of(block)
        || !len.is_multiple_of(block)
    {
        return Err(ShardError::Tensor {
            tensor: t.name.clone(),
            reason: format!(
                "columns {start}..{} of shape {:?} are not whole {:?} blocks of {block}",
                start + len,
                t.shape,
                t.dtype
            ),
        });
    }
    let rb = row_bytes(t)?;
    let (from, bytes) = (
        start / block * t.dtype.block_bytes(),
        len / block * t.dtype.block_bytes(),
    );
    let mut out = Vec::with_capacity(t.rows() * bytes);
    for row in t.storage.bytes().chunks_exact(rb) {
        out.extend_from_slice(&row[from..from + bytes]);
    }
    Ok(Tensor {
        name: t.name.clone(),
        dtype: t.dtype,
        shape: vec![t.rows(), len],
        storage: Storage::Owned(Arc::new(out)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant::dequantize;
    use crate::model::dummy::{dummy_weights, preset};
    use crate::model::DType;

    /// SmolLM2's shape, cut to two layers and a small vocabulary.
    fn smollm2(dtype: DType) -> ModelWeights {
        let mut c = preset("smollm2-135m").unwrap();
        c.num_hidden_layers = 2;
        c.vocab_size = 64;
        dummy_weights(&c, dtype, 7).unwrap()
    }

    /// Row-major f32 values of `t`.
    fn values(t: &Tensor) -> Vec<f32> {
        dequantize(t)
    }

    /// Concatenates row-major `[rows, cols_i]` matrices along columns.
    fn hcat(parts: &[Vec<f32>], rows: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for r in 0..rows {
            for p in parts {
                let w = p.len() / rows;
                out.extend_from_slice(&p[r * w..(r + 1) * w]);
            }
        }
        out
    }

    #[test]
    fn concatenating_the_shards_gives_back_every_tensor() {
        for dtype in [DType::Q4_1, DType::Q8_0, DType::BF16, DType::F32] {
            let w = smollm2(dtype);
            let shards: Vec<_> = (0..3).map(|r| shard(&w, r, 3).unwrap()).collect();
            for (i, l) in w.layers.iter().enumerate() {
                let by_rows = |f: fn(&LayerWeights) -> &Tensor| {
                    shards
                        .iter()
                        .flat_map(|s| values(f(&s.layers[i])))
                        .collect::<Vec<_>>()
                };
                let by_cols = |f: fn(&LayerWeights) -> &Tensor| {
                    let parts: Vec<_> = shards.iter().map(|s| values(f(&s.layers[i]))).collect();
                    hcat(&parts, f(l).rows())
                };
                assert_eq!(by_rows(|l| &l.wq), values(&l.wq), "{dtype:?} wq");
                assert_eq!(by_rows(|l| &l.wk), values(&l.wk), "{dtype:?} wk");
                assert_eq!(by_rows(|l| &l.wv), values(&l.wv), "{dtype:?} wv");
                assert_eq!(by_rows(|l| &l.w_gate), values(&l.w_gate), "{dtype:?} gate");
                assert_eq!(by_rows(|l| &l.w_up), values(&l.w_up), "{dtype:?} up");
                assert_eq!(by_cols(|l| &l.wo), values(&l.wo), "{dtype:?} wo");
                assert_eq!(by_cols(|l| &l.w_down), values(&l.w_down), "{dtype:?} down");
                for s in &shards {
                    assert_eq!(values(&s.layers[i].attn_norm), values(&l.attn_norm));
                    assert_eq!(s.layers[i].wo.shape, vec![576, 192]);
                    assert_eq!(s.layers[i].w_down.shape, vec![576, 512]);
                }
            }
            for s in &shards {
                assert_eq!(values(&s.embed), values(&w.embed));
                assert_eq!(
                    (
                        s.config.num_attention_heads,
                        s.config.num_key_value_heads,
                        s.config.intermediate_size
                    ),
                    (3, 1, 512)
                );
                crate::model::check::check_weights(s).expect("a shard is a consistent model");
            }
        }
    }

    #[test]
    fn rank_r_owns_the_kv_heads_its_query_heads_read() {
        // 8 query heads over 4 KV heads (groups of 2), TP = 2: rank 1 owns
        // query heads 4..8 and KV heads 2..4 -- the ones heads 4..8 read.
        let mut c = preset("smollm2-135m").unwrap();
        (
            c.num_hidden_layers,
            c.vocab_size,
            c.num_attention_heads,
            c.num_key_value_heads,
        ) = (1, 64, 8, 4);
        c.head_dim = 576 / 8;
        c.rope_dim = c.head_dim;
        let w = dummy_weights(&c, DType::F32, 3).unwrap();
        let s = shard(&w, 1, 2).unwrap();
        let hd = c.head_dim;
        let (q, k) = (values(&w.layers[0].wq), values(&w.layers[0].wk));
        assert_eq!(values(&s.layers[0].wq), q[4 * hd * 576..].to_vec());
        assert_eq!(values(&s.layers[0].wk), k[2 * hd * 576..].to_vec());
    }

    #[test]
    fn a_size_that_does_not_divide_the_heads_is_refused_listing_those_that_work() {
        let w = smollm2(DType::Q4_1);
        assert_eq!(valid_sizes(&w), vec![1, 3]);
        for n in [2, 4, 9] {
            let err = shard(&w, 0, n).unwrap_err().to_string();
            assert!(
                err.contains(&format!("tensor_parallel_size = {n}")),
                "{err}"
            );
            assert!(err.contains("sizes that work: 1, 3"), "{err}");
        }
        assert!(check_size(&w, 0).is_err());
    }

    #[test]
    fn column_splits_off_block_boundaries_are_refused() {
        // 4 heads of 48 over 4 KV heads, Q4_1: TP = 4 gives each rank 48
        // attention-output columns, not a whole number of 32-blocks.
        let mut c = preset("smollm2-135m").unwrap();
        (
            c.num_hidden_layers,
            c.vocab_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
        ) = (1, 64, 192, 4, 4);
        (c.head_dim, c.rope_dim, c.intermediate_size) = (48, 48, 256);
        let w = dummy_weights(&c, DType::Q4_1, 1).unwrap();
        assert_eq!(valid_sizes(&w), vec![1, 2]);
        let err = check_size(&w, 4).unwrap_err().to_string();
        assert!(err.contains("quantization blocks of 32"), "{err}");
        let f = dummy_weights(&c, DType::F32, 1).unwrap();
        assert_eq!(valid_sizes(&f), vec![1, 2, 4]);
    }
}
