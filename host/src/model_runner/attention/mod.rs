//! Causal paged attention over a flattened batch.
//!
//! A query at position `p` of a sequence attends to positions `0..=p` of the
//! same sequence, which it finds through the block table; query head `h`
//! reads KV head `h / (heads / kv_heads)` (grouped-query attention).
//!
//! A query's keys are cut into chunks of [`CHUNK_TOKENS`] at fixed
//! positions. Each chunk gives a partial result — its largest score, the sum
//! of its `exp(score - largest)` and their weighted sum of V — and the
//! partials are merged in chunk order (flash-decoding's split-K). The
//! chunking depends only on the position, so a query gets the same bits
//! however the work is cut: in one item that does all its chunks, or spread
//! over the threads, one item per chunk, when a decode batch is too small to
//! keep them busy otherwise (see [`AttnPlan::build`]). Either way each K and
//! V tile is read once for all the query heads that share it.

mod plan;
#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::kv_cache::{KvCache, KvTiles, KvView};
use crate::kernels::{
    axpy, axpy_rows, dot_rows_scaled, prefetch, softmax_parts, HeadsLayout, KvElem, ThreadPool,
};
pub(crate) use plan::AttnPlan;
use plan::SPLIT_MAX_QUERIES;

/// Keys per chunk: long enough that merging costs little next to the
/// chunk (a few percent of a 4096-token prefill), short enough that a
/// decode over a few hundred tokens already makes an item per thread.
pub(crate) const CHUNK_TOKENS: usize = 128;

/// Chunks of `keys` keys.
fn chunks_of(keys: usize) -> usize {
    keys.div_ceil(CHUNK_TOKENS)
}

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

impl SeqSpan {
    /// The position of query `qi` (it attends to keys `0..=pos`).
    fn pos(&self, qi: usize) -> usize {
        self.context_len - self.query_len + qi
    }
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

impl AttnDims {
    /// Query heads per KV head.
    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Floats of a chunk's partial result: max, sum, weighted V.
    fn part_len(&self) -> usize {
        self.head_dim + 2
    }
}

/// Attention's working memory, sized once for the longest context.
pub(crate) struct AttnScratch {
    /// Per thread: `group` rows of [`CHUNK_TOKENS`] scores, then `group`
    /// rows of `max_chunks` partials.
    per_thread: Vec<f32>,
    /// Threads it has room for.
    n_threads: usize,
    /// Chunks of the longest context.
    max_chunks: usize,
    /// The split queries' partials: `[SPLIT_MAX_QUERIES, num_heads,
    /// max_chunks]` records.
    split: Vec<f32>,
}

impl AttnScratch {
    /// Room for `n_threads` threads and contexts up to `max_model_len`.
    /// Zeroed allocations, so pages no step reaches are never resident.
    pub fn new(dims: AttnDims, n_threads: usize, max_model_len: usize) -> AttnScratch {
        let max_chunks = chunks_of(max_model_len);
        let head_stride = max_chunks * dims.part_len();
        AttnScratch {
            per_thread: vec![0.0; n_threads * dims.group() * (CHUNK_TOKENS + head_stride)],
            n_threads,
            max_chunks,
            split: vec![0.0; SPLIT_MAX_QUERIES * dims.num_heads * head_stride],
        }
    }
}

/// A raw pointer that threads share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every work item writes a distinct (token, head) range or chunk
// record and every thread its own scratch; `ThreadPool::run` returns only
// after all threads are done, so the pointers never outlive the borrowed
// buffers.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// `len` floats at `at` (a method, so closures capture the whole `Sync`
    /// wrapper rather than the raw field).
    ///
    /// # Safety
    /// The range lies inside the buffer and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
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
    /// The step's plan.
    pub plan: &'a AttnPlan,
    /// Rotated queries: token `t`, head `h` at `t * q_stride + h * head_dim`.
    pub q: &'a [f32],
    /// Floats between the queries of consecutive tokens (at least
    /// `num_heads * head_dim`; more when Q shares rows with K and V).
    pub q_stride: usize,
}

/// Computes softmax(q·kᵀ / √d)·v for every query token and head into `out`
/// (`[n_tokens, num_heads * head_dim]`).
pub(crate) fn paged_attention(
    pool: &ThreadPool,
    dims: AttnDims,
    args: &AttnArgs<'_>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    match args.cache.view() {
        KvView::F32(kv) => attend(pool, dims, args, kv, out, scratch),
        KvView::F16(kv) => attend(pool, dims, args, kv, out, scratch),
        KvView::Bf16(kv) => attend(pool, dims, args, kv, out, scratch),
    }
}

/// [`paged_attention`] over a cache whose values are `E`.
fn attend<E: KvElem>(
    pool: &ThreadPool,
    dims: AttnDims,
    args: &AttnArgs<'_>,
    cache: KvTiles<'_, E>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
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
    assert!(
        chunks_of(max_ctx) <= scratch.max_chunks
            && pool.num_threads() <= scratch.n_threads
            && args.plan.split.len() <= SPLIT_MAX_QUERIES,
        "attention scratch too small"
    );
    let (hd, group, part) = (dims.head_dim, dims.group(), dims.part_len());
    let head_stride = scratch.max_chunks * part;
    let thread_len = group * (CHUNK_TOKENS + head_stride);
    let out_ptr = SharedOut(out.as_mut_ptr());
    let thread_ptr = SharedOut(scratch.per_thread.as_mut_ptr());
    let split_ptr = SharedOut(scratch.split.as_mut_ptr());
    let next = AtomicUsize::new(0);
    pool.run(|tid, _| {
        // SAFETY: thread `tid` owns its slice of the per-thread scratch
        // (inside it: `tid < n_threads`, checked above).
        let mine = unsafe { thread_ptr.slice(tid * thread_len, thread_len) };
        let (scores, parts) = mine.split_at_mut(group * CHUNK_TOKENS);
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = args.plan.items.get(i) else {
                break;
            };
            let s = &args.seqs[item.seq];
            let kv = HeadKv {
                dims,
                cache,
                layer: args.layer,
                table: args.block_tables[item.seq],
                kv_head: item.head / group,
                prefetch: item.q_end - item.q_begin == 1,
            };
            let width = item.heads * hd;
            for qi in item.q_begin..item.q_end {
                let token = s.token_start + qi;
                let q_at = token * args.q_stride + item.head * hd;
                let q = &args.q[q_at..q_at + width];
                let pos = s.pos(qi);
                if let Some(p) = item.split {
                    kv.chunk_partial(q, pos, p.chunk, scores, parts, head_stride);
                    for h in 0..item.heads {
                        let record = (p.slot * dims.num_heads + item.head + h) * head_stride;
                        // SAFETY: (slot, head, chunk) belongs to this item
                        // only, and `slot < SPLIT_MAX_QUERIES` (checked).
                        let dst = unsafe { split_ptr.slice(record + p.chunk * part, part) };
                        dst.copy_from_slice(&parts[h * head_stride..][..part]);
                    }
                    continue;
                }
                let n_chunks = chunks_of(pos + 1);
                for c in 0..n_chunks {
                    kv.chunk_partial(q, pos, c, scores, &mut parts[c * part..], head_stride);
                }
                // SAFETY: (token, heads) belong to this item only, and the
                // range lies inside `out` (checked above).
                let o = unsafe { out_ptr.slice(token * row_stride + item.head * hd, width) };
                for (h, o) in o.chunks_exact_mut(hd).enumerate() {
                    merge(&parts[h * head_stride..][..n_chunks * part], o);
                }
            }
        }
    });
    let split = &args.plan.split;
    if split.is_empty() {
        return;
    }
    let records = &scratch.split;
    let next = AtomicUsize::new(0);
    pool.run(|_, _| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= split.len() * dims.num_heads {
            break;
        }
        let (slot, head) = (i / dims.num_heads, i % dims.num_heads);
        let q = split[slot];
        let at = (slot * dims.num_heads + head) * head_stride;
        // SAFETY: (token, head) belongs to this index only, inside `out`.
        let o = unsafe { out_ptr.slice(q.token * row_stride + head * hd, hd) };
        merge(&records[at..at + chunks_of(q.pos + 1) * part], o);
    });
}

/// One sequence's keys and values under one KV head of one layer.
struct HeadKv<'a, E> {
    dims: AttnDims,
    cache: KvTiles<'a, E>,
    layer: usize,
    table: &'a [u32],
    kv_head: usize,
    /// Whether to prefetch the next K and V pieces: worth it when one
    /// query reads them (a decode), so they come from memory once; a run
    /// of queries finds them in cache after the first, and prefetching
    /// there only costs.
    prefetch: bool,
}

impl<'a, E: KvElem> HeadKv<'a, E> {
    /// The pieces of K and V that hold `keys`, in order, as (first key, K
    /// rows, V rows): a block's tile, or part of it at the range's ends.
    fn tiles(&self, keys: Range<usize>) -> impl Iterator<Item = (usize, &'a [E], &'a [E])> {
        let (bs, hd) = (self.dims.block_size, self.dims.head_dim);
        let (cache, layer, table, kv_head) = (self.cache, self.layer, self.table, self.kv_head);
        let mut key = keys.start;
        std::iter::from_fn(move || {
            if key >= keys.end {
                return None;
            }
            let (b, slot) = (key / bs, key % bs);
            let len = (bs - slot).min(keys.end - key);
            let block = table[b] as usize;
            let rows = slot * hd..(slot + len) * hd;
            let (k, v) = cache.tile(layer, block, kv_head);
            let (k, v) = (&k[rows.clone()], &v[rows]);
            let first = key;
            key += len;
            Some((first, k, v))
        })
    }

    /// The partial results of chunk `chunk` of a query at `pos` for each
    /// of its heads (`q`: the heads one after the other): head `h`'s record
    /// `[max, sum, acc]` goes to `parts[h * head_stride..]`. `scores` holds
    /// a [`CHUNK_TOKENS`] row per head. Each K and V piece is read once for
    /// all the heads; per head the operations and their order are those of
    /// one head alone.
    fn chunk_partial(
        &self,
        q: &[f32],
        pos: usize,
        chunk: usize,
        scores: &mut [f32],
        parts: &mut [f32],
        head_stride: usize,
    ) {
        let hd = self.dims.head_dim;
        let heads = q.len() / hd;
        let start = chunk * CHUNK_TOKENS;
        let keys = start..(start + CHUNK_TOKENS).min(pos + 1);
        let scale = 1.0 / (hd as f32).sqrt();
        // Head `h`'s scores of the `n` keys from `first`.
        let row = |h: usize, first: usize, n: usize| {
            let at = h * CHUNK_TOKENS + first - start;
            at..at + n
        };
        let mut pieces = self.tiles(keys.clone()).peekable();
        while let Some((first, k, v)) = pieces.next() {
            if self.prefetch {
                if let Some((_, next_k, _)) = pieces.peek() {
                    prefetch(next_k);
                }
                prefetch(v);
            }
            let n = k.len() / hd;
            for h in 0..heads {
                dot_rows_scaled(
                    &q[h * hd..(h + 1) * hd],
                    k,
                    scale,
                    &mut scores[row(h, first, n)],
                );
            }
        }
        for h in 0..heads {
            let (max, sum) = softmax_parts(&mut scores[row(h, start, keys.len())]);
            let record = &mut parts[h * head_stride..][..self.dims.part_len()];
            record[0] = max;
            record[1] = sum;
            record[2..].fill(0.0);
        }
        for (first, _, v) in self.tiles(keys) {
            let layout = HeadsLayout {
                heads,
                keys: v.len() / hd,
                head_dim: hd,
                p_stride: CHUNK_TOKENS,
                out_stride: head_stride,
            };
            axpy_rows(
                layout,
                &scores[row(0, first, 0).start..],
                v,
                &mut parts[2..],
            );
        }
    }
}

/// A query head's output from its chunks' records (`[max, sum, acc]` each,
/// in key order): every chunk weighted by `exp(its max - the largest)`, in
/// chunk order, then divided by the weighted sum.
fn merge(parts: &[f32], out: &mut [f32]) {
    let part = out.len() + 2;
    let records = || parts.chunks_exact(part);
    let max = records().map(|r| r[0]).fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    out.fill(0.0);
    for r in records() {
        let w = (r[0] - max).exp();
        sum += w * r[1];
        axpy(w, &r[2..], out);
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}
