//! [`CpuModelRunner`]: the llama forward pass on the CPU over a paged KV
//! cache, for a flattened batch that mixes prefill chunks and decodes.
//!
//! Every matmul runs once per layer over all tokens of the step (weights are
//! streamed once per step, whatever the batch); attention runs per
//! (sequence, head, query run) in parallel; the LM head runs only on each
//! sequence's last token, and on the tokens a step asks logits of (prompt
//! logprobs), in bounded chunks.

use std::sync::Arc;

use super::attention::{AttnDims, SeqSpan};
use super::input::{Limits, ModelInput};
use super::kv_cache::{KvCache, KvCacheShape, KvDtype};
use super::layer::{norm_weight, weight_matrix, Layer, StepCtx};
use super::profile::{Laps, Op, StepProfile};
use super::scratch::Scratch;
use super::{Logits, LogitsSink, LogitsSpan, RunnerError};
use crate::config::CacheDtype;
use crate::distributed::TpGroup;
use crate::kernels::{
    matmul_with, pack_weights, rms_norm, MatmulPath, RopeTable, ThreadPool, WeightMatrix,
};
use crate::model::{check, shard, LlamaConfig, ModelWeights};

/// Limits of the steps a runner accepts, and how it computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerConfig {
    /// Most tokens in one step; the activation buffers are sized for it.
    pub max_num_batched_tokens: usize,
    /// Longest context of a sequence (at most the model's
    /// `max_position_embeddings`).
    pub max_model_len: usize,
    /// Token slots per KV-cache block.
    pub block_size: usize,
    /// The KV cache's element type (`auto`: f32 on the CPU).
    pub cache_dtype: CacheDtype,
    /// Which matmul kernels to use: `Auto` in production (batch-invariant
    /// 8-bit kernels for quantized weights); tests force the f32 GEMM to
    /// compare with the reference at full precision.
    pub matmul_path: MatmulPath,
}

/// The CPU model runner of a llama-family model.
pub struct CpuModelRunner {
    /// Model hyper-parameters.
    config: LlamaConfig,
    /// Step limits.
    limits: RunnerConfig,
    /// Threads for matmuls and attention.
    pool: Arc<ThreadPool>,
    /// Token embedding (also the output projection when tied).
    embed: WeightMatrix,
    /// Separate output projection, when not tied.
    lm_head: Option<WeightMatrix>,
    /// The transformer blocks.
    layers: Vec<Layer>,
    /// Final RMSNorm weight.
    final_norm: Vec<f32>,
    /// RoPE angles for positions below `max_model_len`.
    rope: RopeTable,
    /// Activation buffers.
    scratch: Scratch,
    /// Final-norm rows of the step's last tokens, `[seqs, hidden]`.
    last_hidden: Vec<f32>,
    /// The paged KV cache, once allocated.
    kv: Option<KvCache>,
    /// The tensor-parallel group, when the weights are one rank's shard.
    all_reduce: Option<Arc<TpGroup>>,
    /// Time per operation, while profiling is on.
    profile: Option<Box<StepProfile>>,
}

impl CpuModelRunner {
    /// Prepares `weights` for the kernels (every matrix repacked, norms as
    /// f32) and allocates the activation buffers. The KV cache comes later,
    /// from [`CpuModelRunner::initialize_kv_cache`], once its size is known.
    pub fn new(
        weights: &ModelWeights,
        pool: Arc<ThreadPool>,
        limits: RunnerConfig,
    ) -> Result<CpuModelRunner, RunnerError> {
        let c = &weights.config;
        check::check_weights(weights).map_err(|e| RunnerError::Unsupported(e.to_string()))?;
        if limits.max_num_batched_tokens == 0 || limits.block_size == 0 || limits.max_model_len == 0
        {
            return Err(RunnerError::Config(format!(
                "max_num_batched_tokens ({}), max_model_len ({}) and block_size ({}) must all be at least 1",
                limits.max_num_batched_tokens, limits.max_model_len, limits.block_size
            )));
        }
        if limits.max_model_len > c.max_position_embeddings {
            return Err(RunnerError::Config(format!(
                "max_model_len = {} exceeds the model's context of {} tokens; lower max_model_len",
                limits.max_model_len, c.max_position_embeddings
            )));
        }
        let mut layers = weights
            .layers
            .iter()
            .map(Layer::new)
            .collect::<Result<Vec<_>, _>>()?;
        let mut lm_head = weights.lm_head.as_ref().map(weight_matrix).transpose()?;
        let mut embed = weight_matrix(&weights.embed)?;
        pack_weights(
            layers
                .iter_mut()
                .flat_map(Layer::matrices_mut)
                .chain([&mut embed])
                .chain(lm_head.as_mut()),
        );
        Ok(CpuModelRunner {
            config: c.clone(),
            limits,
            embed,
            lm_head,
            layers,
            final_norm: norm_weight(&weights.final_norm),
            rope: RopeTable::new(c.rope_dim, c.rope_theta, limits.max_model_len),
            scratch: Scratch::new(
                c,
                attn_dims(c, limits.block_size),
                limits.max_num_batched_tokens,
                limits.max_model_len,
                pool.num_threads(),
            )?,
            last_hidden: vec![0.0; limits.max_num_batched_tokens * c.hidden_size],
            kv: None,
            all_reduce: None,
            profile: None,
            pool,
        })
    }

    /// The runner of one tensor-parallel rank: prepares `group`'s rank's
    /// shard of `weights` (see [`crate::model::shard`]) and all-reduces the
    /// row-parallel projections across the group; with no group, the whole
    /// model ([`CpuModelRunner::new`]). Every rank must then run the same
    /// steps in the same order. A group size that does not divide the model
    /// is refused, naming the sizes that work.
    pub fn new_rank(
        weights: &ModelWeights,
        pool: Arc<ThreadPool>,
        limits: RunnerConfig,
        group: Option<Arc<TpGroup>>,
    ) -> Result<CpuModelRunner, RunnerError> {
        let Some(group) = group else {
            return CpuModelRunner::new(weights, pool, limits);
        };
        let rank_weights = shard::shard(weights, group.rank(), group.world_size())?;
        let mut runner = CpuModelRunner::new(&rank_weights, pool, limits)?;
        runner.all_reduce = Some(group);
        Ok(runner)
    }

    /// The model's hyper-parameters (of this rank's shard: its share of
    /// the heads and of the MLP width, under tensor parallelism).
    pub fn model_config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The step limits.
    pub fn runner_config(&self) -> RunnerConfig {
        self.limits
    }

    /// Switches the matmul kernel family for the following steps.
    pub fn set_matmul_path(&mut self, path: MatmulPath) {
        self.limits.matmul_path = path;
    }

    /// Starts timing every operation of the following steps (from zero),
    /// or stops; see [`CpuModelRunner::profile`].
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(Box::default);
    }

    /// The time per operation of the steps since profiling started.
    pub fn profile(&self) -> Option<&StepProfile> {
        self.profile.as_deref()
    }

    /// The KV cache's dimensions (everything but the number of blocks).
    pub fn kv_cache_shape(&self) -> KvCacheShape {
        KvCacheShape {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            block_size: self.limits.block_size,
            dtype: KvDtype::for_cpu(self.limits.cache_dtype),
        }
    }

    /// Allocates (or replaces) the KV cache with `num_blocks` blocks.
    pub fn initialize_kv_cache(&mut self, num_blocks: usize) -> Result<(), RunnerError> {
        self.kv = None;
        self.kv = Some(KvCache::new(self.kv_cache_shape(), num_blocks)?);
        Ok(())
    }

    /// Frees the KV cache; [`CpuModelRunner::initialize_kv_cache`] brings
    /// it back, empty.
    pub fn free_kv_cache(&mut self) {
        self.kv = None;
    }

    /// Prepares again what the tensor `name` of `weights` feeds (its layer,
    /// the embedding, the final norm or the LM head) after it changed, so
    /// the next step uses it (vLLM's `update_weights`). The KV cache is
    /// kept: entries written with the old weights stay until overwritten.
    /// A reloaded matrix gets an allocation of its own, off the huge pages
    /// [`pack_weights`] gave the rest, whose old bytes stay with them until
    /// the runner is dropped (at most one more copy of the weights).
    pub fn reload_weight(&mut self, weights: &ModelWeights, name: &str) -> Result<(), RunnerError> {
        // A tensor-parallel rank holds its shard: prepare that shard.
        let sharded;
        let weights = match &self.all_reduce {
            Some(group) => {
                sharded = shard::shard(weights, group.rank(), group.world_size())?;
                &sharded
            }
            None => weights,
        };
        if name == weights.embed.name {
            self.embed = weight_matrix(&weights.embed)?;
        } else if name == weights.final_norm.name {
            self.final_norm = norm_weight(&weights.final_norm);
        } else if let Some(head) = weights.lm_head.as_ref().filter(|h| h.name == name) {
            self.lm_head = Some(weight_matrix(head)?);
        } else {
            let Some(i) = weights.layers.iter().position(|l| {
                [
                    &l.attn_norm,
                    &l.wq,
                    &l.wk,
                    &l.wv,
                    &l.wo,
                    &l.ffn_norm,
                    &l.w_gate,
                    &l.w_up,
                    &l.w_down,
                ]
                .iter()
                .any(|t| t.name == name)
            }) else {
                return Err(RunnerError::Config(format!(
                    "no weight named `{name}` to reload"
                )));
            };
            self.layers[i] = Layer::new(&weights.layers[i])?;
        }
        Ok(())
    }

    /// The KV cache, once allocated.
    pub fn kv_cache(&self) -> Option<&KvCache> {
        self.kv.as_ref()
    }

    /// Runs one step: writes the K/V of every token of `input` into the
    /// cache and returns the logits of each sequence's last query token.
    pub fn execute_model(&mut self, input: &ModelInput) -> Result<Logits, RunnerError> {
        self.execute_model_with_spans(input, &[], &mut |_, _, _| {})
    }

    /// [`Self::execute_model`], and also the logits of the query tokens of
    /// each of `spans`, handed to `sink` one row at a time as `(span index,
    /// row within the span, logits)`, in order. The LM head runs on those
    /// rows in chunks of [`LOGITS_CHUNK_ROWS`], so memory stays bounded
    /// however long the spans are (prompt logprobs of a long prefill).
    pub fn execute_model_with_spans(
        &mut self,
        input: &ModelInput,
        spans: &[LogitsSpan],
        sink: &mut LogitsSink<'_>,
    ) -> Result<Logits, RunnerError> {
        let Self {
            config: c,
            limits,
            pool,
            embed,
            lm_head,
            layers,
            final_norm,
            rope,
            scratch: s,
            last_hidden,
            kv,
            all_reduce,
            profile,
        } = self;
        let profile = profile.as_deref();
        let cache = kv.as_mut().ok_or(RunnerError::NoKvCache)?;
        input.validate(&Limits {
            vocab_size: c.vocab_size,
            max_model_len: limits.max_model_len,
            max_num_batched_tokens: limits.max_num_batched_tokens,
            num_blocks: cache.num_blocks(),
            block_size: limits.block_size,
        })?;
        let (n, hid) = (input.token_ids.len(), c.hidden_size);
        s.spans.clear();
        let mut start = 0;
        for seq in &input.seqs {
            s.spans.push(SeqSpan {
                token_start: start,
                query_len: seq.query_len,
                context_len: seq.context_len,
            });
            start += seq.query_len;
        }
        let dims = attn_dims(c, limits.block_size);
        s.plan.build(&s.spans, dims, pool.num_threads());
        let block_tables: Vec<&[u32]> = input.seqs.iter().map(|q| &q.block_table[..]).collect();
        let mut laps = Laps::start(profile);
        for (row, &id) in s.h[..n * hid].chunks_exact_mut(hid).zip(&input.token_ids) {
            embed.dequantize_row(id as usize, row);
        }
        laps.lap(Op::Embed);
        let ctx = StepCtx {
            pool,
            path: limits.matmul_path,
            dims,
            hidden: hid,
            intermediate: c.intermediate_size,
            eps: c.rms_norm_eps,
            rope,
            block_tables: &block_tables,
            positions: &input.positions,
            all_reduce: all_reduce.as_deref(),
            profile,
        };
        for (i, layer) in layers.iter().enumerate() {
            layer.forward(i, &ctx, s, cache)?;
        }
        let mut laps = Laps::start(profile);
        let ns = s.spans.len();
        // Extra rows that fit one chunk (a step's draft positions, a short
        // prompt-logprobs span) ride along with the last rows, so the LM
        // head streams once per step; the kernels give each row the same
        // bits in any batch.
        let extra = check_spans(&s.spans, spans)?;
        let room = last_hidden.len() / hid - ns;
        let along = if extra <= LOGITS_CHUNK_ROWS.min(room) {
            extra
        } else {
            0
        };
        let riding = if along > 0 { spans } else { &[] };
        let last_rows = s.spans.iter().map(|q| q.token_start + q.query_len - 1);
        let extra_rows = riding.iter().flat_map(|x| {
            let base = s.spans[x.seq].token_start + x.first;
            base..base + x.len
        });
        let rows = ns + along;
        for (t, out) in last_rows
            .chain(extra_rows)
            .zip(last_hidden.chunks_exact_mut(hid))
        {
            rms_norm(
                &s.h[t * hid..(t + 1) * hid],
                final_norm,
                c.rms_norm_eps,
                out,
            );
        }
        laps.lap(Op::FinalNorm);
        let head = lm_head.as_ref().unwrap_or(embed);
        let vocab = head.rows();
        let mut data = vec![0.0; rows * vocab];
        matmul_with(
            pool,
            head,
            &last_hidden[..rows * hid],
            rows,
            &mut data,
            limits.matmul_path,
        );
        laps.lap(Op::LmHead);
        if let Some(p) = profile {
            p.count_step();
        }
        if along > 0 {
            let mut extra_logits = data[ns * vocab..].chunks_exact(vocab);
            for (i, span) in spans.iter().enumerate() {
                for (row, logits) in extra_logits.by_ref().take(span.len).enumerate() {
                    sink(i, row, logits);
                }
            }
            data.truncate(ns * vocab);
        } else if !spans.is_empty() {
            span_logits(
                pool,
                head,
                final_norm,
                c.rms_norm_eps,
                limits.matmul_path,
                &s.h[..n * hid],
                &s.spans,
                spans,
                sink,
            )?;
        }
        Ok(Logits {
            num_seqs: ns,
            vocab_size: head.rows(),
            data,
        })
    }
}

/// Rows of extra logits computed at once: 32 rows of a 49152-token
/// vocabulary take 6 MiB.
pub const LOGITS_CHUNK_ROWS: usize = 32;

/// The logits of `spans`' query tokens (checked by [`check_spans`]), from
/// the final residual stream `h` (`[tokens, hidden]`), in chunks of
/// [`LOGITS_CHUNK_ROWS`] rows.
#[allow(clippy::too_many_arguments)]
fn span_logits(
    pool: &ThreadPool,
    head: &WeightMatrix,
    final_norm: &[f32],
    eps: f32,
    path: MatmulPath,
    h: &[f32],
    seqs: &[SeqSpan],
    spans: &[LogitsSpan],
    sink: &mut LogitsSink<'_>,
) -> Result<(), RunnerError> {
    let (hid, vocab) = (head.cols(), head.rows());
    let rows = spans
        .iter()
        .map(|s| s.len)
        .max()
        .unwrap_or(0)
        .min(LOGITS_CHUNK_ROWS);
    let mut normed = vec![0.0; rows * hid];
    let mut logits = vec![0.0; rows * vocab];
    for (i, span) in spans.iter().enumerate() {
        let base = seqs[span.seq].token_start + span.first;
        let mut done = 0;
        while done < span.len {
            let m = (span.len - done).min(LOGITS_CHUNK_ROWS);
            for (r, out) in normed[..m * hid].chunks_exact_mut(hid).enumerate() {
                let t = base + done + r;
                rms_norm(&h[t * hid..(t + 1) * hid], final_norm, eps, out);
            }
            matmul_with(
                pool,
                head,
                &normed[..m * hid],
                m,
                &mut logits[..m * vocab],
                path,
            );
            for (r, row) in logits[..m * vocab].chunks_exact(vocab).enumerate() {
                sink(i, done + r, row);
            }
            done += m;
        }
    }
    Ok(())
}

/// Checks that every span lies within its sequence's query tokens;
/// returns their rows in all.
fn check_spans(seqs: &[SeqSpan], spans: &[LogitsSpan]) -> Result<usize, RunnerError> {
    let mut rows = 0;
    for (i, span) in spans.iter().enumerate() {
        let fits = seqs.get(span.seq).is_some_and(|q| {
            span.first
                .checked_add(span.len)
                .is_some_and(|e| e <= q.query_len)
        });
        if !fits {
            return Err(RunnerError::Input(format!(
                "logits span {i} ({span:?}) is outside its sequence's query tokens"
            )));
        }
        rows += span.len;
    }
    Ok(rows)
}

/// The shapes attention needs, from the model's and the cache's.
fn attn_dims(c: &LlamaConfig, block_size: usize) -> AttnDims {
    AttnDims {
        num_heads: c.num_attention_heads,
        num_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        block_size,
    }
}
