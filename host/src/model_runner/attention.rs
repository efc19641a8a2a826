//! Causal paged attention over a flattened batch.
//!
//! A query at position `p` of a sequence attends to positions `0..=p` of the
//! same sequence, which it finds through the block table; query head `h`
//! reads KV head `h / (heads / kv_heads)` (grouped-query attention). The work
//! is cut into items of (sequence, query heads, run of queries) and threads
//! take items from a shared counter, longest first, so a long prefill chunk
//! and a handful of decodes in the same step keep both cores busy.
//!
//! An item holds every query head of one KV head when the step has work
//! enough to keep the threads busy that way, so each K and V tile is read
//! once for all the heads that share it (three for the default model)
//! rather than once per head; a step too small for that (a single decode)
//! gets one item per query head instead. Either way each (query, head)
//! goes through the same operations in the same order, so the items'
//! shape never changes a result.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::kv_cache::KvCache;
use crate::kernels::{axpy_rows, dot_rows_scaled, softmax_inplace, ThreadPool};

/// Queries per work item: small enough to balance a prefill chunk over the
/// threads, large enough that taking an item costs nothing in comparison.
const QUERIES_PER_ITEM: usize = 16;

/// One sequence of the step, as attention sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqSpan {
    /// Index of its first query token in the flattened batch.
    pub token_start: usize,
    /// Query tokens in the step.
    pub query_len: usize,
    /// Tokens in the cache after the step.
    pub context_len: usize,
}

/// A unit of attention work.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    /// Index into the step's sequences.
    seq: usize,
    /// First query head; all of `head .. head + heads` share one KV head.
    head: usize,
    /// Query heads.
    heads: usize,
    /// First query (within the sequence's query tokens).
    q_begin: usize,
    /// One past the last query.
    q_end: usize,
}

/// Fills `items` with the step's work, costliest first (late queries of
/// long contexts attend to more keys): per KV head when that makes at least
/// four items per thread, else per query head. Depends only on the batch
/// and the thread count, so it is built once per step and shared by every
/// layer.
pub(crate) fn plan(seqs: &[SeqSpan], dims: AttnDims, n_threads: usize, items: &mut Vec<WorkItem>) {
    let runs: usize = seqs
        .iter()
        .map(|s| s.query_len.div_ceil(QUERIES_PER_ITEM))
        .sum();
    let group = dims.num_heads / dims.num_kv_heads;
    let heads = if runs * dims.num_kv_heads >= 4 * n_threads {
        group
    } else {
        1
    };
    items.clear();
    for (seq, s) in seqs.iter().enumerate() {
        for q_begin in (0..s.query_len).step_by(QUERIES_PER_ITEM) {
            let q_end = (q_begin + QUERIES_PER_ITEM).min(s.query_len);
            for head in (0..dims.num_heads).step_by(heads) {
                items.push(WorkItem {
                    seq,
                    head,
                    heads,
                    q_begin,
                    q_end,
                });
            }
        }
    }
    let cost = |it: &WorkItem| {
        let s = &seqs[it.seq];
        (s.context_len - s.query_len + it.q_end) * (it.q_end - it.q_begin) * it.heads
    };
    items.sort_unstable_by_key(|it| std::cmp::Reverse(cost(it)));
}

/// The shapes attention needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnDims {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
}

/// A raw pointer that threads share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every work item writes a distinct (token, head) range and every
// thread its own score row; `ThreadPool::run` returns only after all threads
// are done, so the pointers never outlive the borrowed buffers.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper
    /// rather than the raw field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The buffers and tables of one attention call.
pub(crate) struct AttnArgs<'a> {
    /// Cache to read (this step's K/V already written).
    pub cache: &'a KvCache,
    /// Layer index.
    pub layer: usize,
    /// The step's sequences.
    pub seqs: &'a [SeqSpan],
    /// Each sequence's block table.
    pub block_tables: &'a [&'a [u32]],
    /// The plan from [`plan`].
    pub items: &'a [WorkItem],
    /// Rotated queries: token `t`, head `h` at `t * q_stride + h * head_dim`.
    pub q: &'a [f32],
    /// Floats between the queries of consecutive tokens (at least
    /// `num_heads * head_dim`; more when Q shares rows with K and V).
    pub q_stride: usize,
}

/// Computes softmax(q·kᵀ / √d)·v for every query token and head into `out`
/// (`[n_tokens, num_heads * head_dim]`). `scores` is scratch of at least
/// `num_threads * heads_per_kv_head * max_context` floats.
pub(crate) fn paged_attention(
    pool: &ThreadPool,
    dims: AttnDims,
    args: &AttnArgs<'_>,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let n_threads = pool.num_threads();
    let max_ctx = args.seqs.iter().map(|s| s.context_len).max().unwrap_or(0);
    let row_stride = dims.num_heads * dims.head_dim;
    let n_tokens = args
        .seqs
        .iter()
        .map(|s| s.token_start + s.query_len)
        .max()
        .unwrap_or(0);
    assert!(
        args.q_stride >= row_stride && args.q.len() >= n_tokens * args.q_stride,
        "attention queries too short"
    );
    assert!(
        out.len() >= n_tokens * row_stride,
        "attention output too small"
    );
    let group = dims.num_heads / dims.num_kv_heads;
    assert!(
        scores.len() >= n_threads * group * max_ctx,
        "attention scratch too small"
    );
    let scores_stride = scores.len() / n_threads;
    let out_ptr = SharedOut(out.as_mut_ptr());
    let scores_ptr = SharedOut(scores.as_mut_ptr());
    let next = AtomicUsize::new(0);
    pool.run(|tid, _| {
        // SAFETY: thread `tid` owns score row `tid` (rows do not overlap and
        // lie inside `scores`, checked above).
        let s_row = unsafe {
            std::slice::from_raw_parts_mut(scores_ptr.get().add(tid * scores_stride), scores_stride)
        };
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = args.items.get(i) else { break };
            let s = &args.seqs[item.seq];
            for qi in item.q_begin..item.q_end {
                let token = s.token_start + qi;
                let at = token * row_stride + item.head * dims.head_dim;
                let width = item.heads * dims.head_dim;
                // SAFETY: (token, heads) belong to this item only, and `at +
                // width <= n_tokens * row_stride <= out.len()` (checked).
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), width) };
                let q_at = token * args.q_stride + item.head * dims.head_dim;
                let q = &args.q[q_at..q_at + width];
                let pos = s.context_len - s.query_len + qi;
                attend(dims, args, item, q, pos, s_row, o);
            }
        }
    });
}

/// Attention of one query (at `pos`) of the item's heads over positions
/// `0..=pos`: `q` and `out` hold the heads one after the other, `scores`
/// is this thread's scratch (`heads` rows of `scores.len() / group`). Each
/// K and V tile is read once for all the heads; per head the operations
/// and their order are those of one head alone.
fn attend(
    dims: AttnDims,
    args: &AttnArgs<'_>,
    item: &WorkItem,
    q: &[f32],
    pos: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (hd, bs) = (dims.head_dim, dims.block_size);
    let group = dims.num_heads / dims.num_kv_heads;
    let kv_head = item.head / group;
    let table = args.block_tables[item.seq];
    let scale = 1.0 / (hd as f32).sqrt();
    let n = pos + 1;
    let stride = scores.len() / group;
    let rows = |h: usize| h * stride..h * stride + n;
    for (b, keys) in (0..n).step_by(bs).enumerate() {
        let tile = args.cache.k_tile(args.layer, table[b] as usize, kv_head);
        let keys = keys..(keys + bs).min(n);
        for h in 0..item.heads {
            let row = &mut scores[rows(h)][keys.clone()];
            dot_rows_scaled(&q[h * hd..(h + 1) * hd], tile, scale, row);
        }
    }
    for h in 0..item.heads {
        softmax_inplace(&mut scores[rows(h)]);
    }
    out.fill(0.0);
    for (b, keys) in (0..n).step_by(bs).enumerate() {
        let tile = args.cache.v_tile(args.layer, table[b] as usize, kv_head);
        let keys = keys..(keys + bs).min(n);
        for (h, out) in out.chunks_exact_mut(hd).enumerate() {
            let p = &scores[rows(h)][keys.clone()];
            axpy_rows(std::iter::once((p, tile)), out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_runner::kv_cache::KvCacheShape;

    /// Deterministic pseudo-random values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Textbook attention on contiguous K/V, `[ctx, kv_heads * hd]`.
    fn naive(q: &[f32], k: &[f32], v: &[f32], pos: usize, head: usize, dims: AttnDims) -> Vec<f32> {
        let hd = dims.head_dim;
        let g = head / (dims.num_heads / dims.num_kv_heads);
        let kvw = dims.num_kv_heads * hd;
        let s: Vec<f64> = (0..=pos)
            .map(|j| {
                (0..hd)
                    .map(|d| q[d] as f64 * k[j * kvw + g * hd + d] as f64)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                (0..=pos)
                    .map(|j| e[j] / z * v[j * kvw + g * hd + d] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    }

    #[test]
    fn matches_textbook_attention_through_scattered_blocks() {
        let dims = AttnDims {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
        };
        let shape = KvCacheShape {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
        };
        let mut cache = KvCache::new(shape, 16).unwrap();
        // Two sequences: a 5-token decode tail of an 11-token context and a
        // 19-token prefill, with blocks scattered and interleaved.
        let ctx = [11usize, 19];
        let qlen = [1usize, 19];
        let tables: [Vec<u32>; 2] = [vec![7, 2, 12], vec![0, 15, 3, 9, 5]];
        let kvw = 2 * 8;
        let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .map(|s| {
                (
                    values(ctx[s] * kvw, 10 + s as u64),
                    values(ctx[s] * kvw, 20 + s as u64),
                )
            })
            .collect();
        for s in 0..2 {
            for p in 0..ctx[s] {
                let (b, slot) = (tables[s][p / 4] as usize, p % 4);
                cache.write(
                    0,
                    b,
                    slot,
                    &kv[s].0[p * kvw..(p + 1) * kvw],
                    &kv[s].1[p * kvw..(p + 1) * kvw],
                );
            }
        }
        let n_tokens = qlen.iter().sum::<usize>();
        let q = values(n_tokens * 6 * 8, 99);
        let seqs = [
            SeqSpan {
                token_start: 0,
                query_len: 1,
                context_len: 11,
            },
            SeqSpan {
                token_start: 1,
                query_len: 19,
                context_len: 19,
            },
        ];
        let refs: Vec<&[u32]> = tables.iter().map(|t| &t[..]).collect();
        // Planned for one thread, the step's 3 query runs x 2 KV heads make
        // per-KV-head items; for two or more, per-query-head items. Each
        // plan runs on 1 to 3 threads, and all give the same bits.
        let mut first: Option<Vec<f32>> = None;
        for (plan_threads, threads) in [(1, 1), (1, 3), (2, 2), (3, 3), (2, 1)] {
            let mut items = Vec::new();
            plan(&seqs, dims, plan_threads, &mut items);
            let (len, heads) = if plan_threads == 1 {
                (3 * 2, 3)
            } else {
                (3 * 6, 1)
            };
            assert_eq!(items.len(), len);
            assert!(items.iter().all(|it| it.heads == heads));
            let pool = ThreadPool::new(threads);
            let mut out = vec![f32::NAN; q.len()];
            let mut scores = vec![0.0; threads * 3 * 19];
            let args = AttnArgs {
                cache: &cache,
                layer: 0,
                seqs: &seqs,
                block_tables: &refs,
                items: &items,
                q: &q,
                q_stride: 48,
            };
            paged_attention(&pool, dims, &args, &mut out, &mut scores);
            for (s, span) in seqs.iter().enumerate() {
                for qi in 0..span.query_len {
                    let t = span.token_start + qi;
                    let pos = span.context_len - span.query_len + qi;
                    for h in 0..6 {
                        let at = t * 48 + h * 8;
                        let want = naive(&q[at..at + 8], &kv[s].0, &kv[s].1, pos, h, dims);
                        for d in 0..8 {
                            assert!(
                                (out[at + d] - want[d]).abs() < 1e-5,
                                "seq {s} q {qi} head {h}: {} vs {}",
                                out[at + d],
                                want[d]
                            );
                        }
                    }
                }
            }
            let first = first.get_or_insert_with(|| out.clone());
            let same = out
                .iter()
                .zip(first.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "plan for {plan_threads} on {threads} threads changed a result"
            );
        }
    }
}
