//! Causal paged attention over a flattened batch.
//!
//! A query at position `p` of a sequence attends to positions `0..=p` of the
//! same sequence, which it finds through the block table; query head `h`
//! reads KV head `h / (heads / kv_heads)` (grouped-query attention).
//!
//! A query's keys are cut into chunks of [`CHUNK_TOKENS`] at fixed
//! positions. Each chunk gives a partial result — its largest score, the sum
//! of its `exp(score - largest)` and their weighted sum of V — and the
//! partials are folded in chunk order (flash-decoding's split-K) by
//! [`fold`]. The chunking depends only on the position, so a query gets the
//! same bits however the work is cut: in one item that does all its chunks,
//! or spread over the threads, one item per chunk, when a decode batch is
//! too small to keep them busy otherwise (see [`AttnPlan::build`]). Either
//! way each K and V tile is read once for all the query heads that share
//! it, and an item of several queries runs them chunk by chunk, so a
//! chunk's K and V (64 KiB in f32) are read from memory once and from L2
//! for the rest of its queries. A half-width cache's chunk is widened to
//! f32 once for such an item rather than once per query (widening is
//! exact, so the bits are the same).

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
use plan::{QUERIES_PER_ITEM, SPLIT_MAX_QUERIES};

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
    /// Per thread: `group` rows of [`CHUNK_TOKENS`] scores, `group` chunk
    /// records, the running records of an item's queries
    /// (`QUERIES_PER_ITEM × group`), then a chunk's K and V widened to f32
    /// (`CHUNK_TOKENS × head_dim` each).
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
        AttnScratch {
            per_thread: vec![0.0; n_threads * Self::thread_len(dims)],
            n_threads,
            max_chunks,
            split: vec![0.0; SPLIT_MAX_QUERIES * dims.num_heads * max_chunks * dims.part_len()],
        }
    }

    /// Floats of one thread's part of `per_thread`.
    fn thread_len(dims: AttnDims) -> usize {
        dims.group() * (CHUNK_TOKENS + (1 + QUERIES_PER_ITEM) * dims.part_len())
            + 2 * CHUNK_TOKENS * dims.head_dim
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
    let thread_len = AttnScratch::thread_len(dims);
    let out_ptr = SharedOut(out.as_mut_ptr());
    let thread_ptr = SharedOut(scratch.per_thread.as_mut_ptr());
    let split_ptr = SharedOut(scratch.split.as_mut_ptr());
    let next = AtomicUsize::new(0);
    pool.run(|tid, _| {
        // SAFETY: thread `tid` owns its slice of the per-thread scratch
        // (inside it: `tid < n_threads`, checked above).
        let mine = unsafe { thread_ptr.slice(tid * thread_len, thread_len) };
        let (scores, rest) = mine.split_at_mut(group * CHUNK_TOKENS);
        let (record, rest) = rest.split_at_mut(group * part);
        let (running, wide) = rest.split_at_mut(QUERIES_PER_ITEM * group * part);
        let (wide_k, wide_v) = wide.split_at_mut(CHUNK_TOKENS * hd);
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
            let query = |qi: usize| {
                let at = (s.token_start + qi) * args.q_stride + item.head * hd;
                &args.q[at..at + width]
            };
            if let Some(p) = item.split {
                let pos = s.pos(item.q_begin);
                kv.chunk_partial(query(item.q_begin), pos, p.chunk, scores, record);
                for (h, r) in record.chunks_exact(part).take(item.heads).enumerate() {
                    let at = (p.slot * dims.num_heads + item.head + h) * head_stride;
                    // SAFETY: (slot, head, chunk) belongs to this item
                    // only, and `slot < SPLIT_MAX_QUERIES` (checked).
                    unsafe { split_ptr.slice(at + p.chunk * part, part) }.copy_from_slice(r);
                }
                continue;
            }
            // Chunk by chunk, each chunk for all the item's queries that
            // reach it; query `j`'s head `h` folds into running record
            // `j * heads + h`. Several queries over a half-width cache read
            // the chunk widened once.
            let queries = item.q_begin..item.q_end;
            let last = s.pos(item.q_end - 1);
            let widen = queries.len() > 1 && std::mem::size_of::<E>() < 4;
            for c in 0..chunks_of(last + 1) {
                if widen {
                    kv.widen_chunk(c, last, wide_k, wide_v);
                }
                for (j, qi) in queries.clone().enumerate() {
                    let pos = s.pos(qi);
                    if c >= chunks_of(pos + 1) {
                        continue;
                    }
                    if widen {
                        let keys = chunk_keys(c, pos);
                        let n = keys.len() * hd;
                        let piece = (keys.start, &wide_k[..n], &wide_v[..n]);
                        chunk_partial(
                            dims,
                            std::iter::once(piece),
                            false,
                            query(qi),
                            keys,
                            scores,
                            record,
                        );
                    } else {
                        kv.chunk_partial(query(qi), pos, c, scores, record);
                    }
                    let mine = &mut running[j * item.heads * part..];
                    let records = record.chunks_exact(part).take(item.heads);
                    for (acc, r) in mine.chunks_exact_mut(part).zip(records) {
                        if c == 0 {
                            acc.copy_from_slice(r);
                        } else {
                            fold(acc, r);
                        }
                    }
                }
            }
            for (j, qi) in queries.enumerate() {
                let token = s.token_start + qi;
                // SAFETY: (token, heads) belong to this item only, and the
                // range lies inside `out` (checked above).
                let o = unsafe { out_ptr.slice(token * row_stride + item.head * hd, width) };
                let mine = running[j * item.heads * part..].chunks_exact(part);
                for (o, acc) in o.chunks_exact_mut(hd).zip(mine) {
                    finish(acc, o);
                }
            }
        }
    });
    let split = &args.plan.split;
    if split.is_empty() {
        return;
    }
    let next = AtomicUsize::new(0);
    pool.run(|_, _| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= split.len() * dims.num_heads {
            break;
        }
        let (slot, head) = (i / dims.num_heads, i % dims.num_heads);
        let q = split[slot];
        let at = (slot * dims.num_heads + head) * head_stride;
        // SAFETY: (slot, head)'s records and (token, head)'s output belong
        // to this index only; both lie inside their buffers (checked).
        let records = unsafe { split_ptr.slice(at, chunks_of(q.pos + 1) * part) };
        let (acc, rest) = records.split_at_mut(part);
        rest.chunks_exact(part).for_each(|r| fold(acc, r));
        let o = unsafe { out_ptr.slice(q.token * row_stride + head * hd, hd) };
        finish(acc, o);
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
    fn tiles(&self, keys: Range<usize>) -> impl Iterator<Item = (usize, &'a [E], &'a [E])> + Clone {
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

    /// The partial results of chunk `chunk` of a query at `pos` (see
    /// [`chunk_partial`]), read from the cache's tiles.
    fn chunk_partial(
        &self,
        q: &[f32],
        pos: usize,
        chunk: usize,
        scores: &mut [f32],
        records: &mut [f32],
    ) {
        let keys = chunk_keys(chunk, pos);
        let pieces = self.tiles(keys.clone());
        chunk_partial(self.dims, pieces, self.prefetch, q, keys, scores, records);
    }

    /// Chunk `chunk`'s K and V up to key `pos`, widened to f32 into the
    /// front of `k` and `v` (`[key][head_dim]`, the chunk's first key
    /// first).
    fn widen_chunk(&self, chunk: usize, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let keys = chunk_keys(chunk, pos);
        let hd = self.dims.head_dim;
        for (first, kt, vt) in self.tiles(keys.clone()) {
            let at = (first - keys.start) * hd;
            E::widen(kt, &mut k[at..at + kt.len()]);
            E::widen(vt, &mut v[at..at + vt.len()]);
        }
    }
}

/// The keys of chunk `chunk` of a query at `pos`.
fn chunk_keys(chunk: usize, pos: usize) -> Range<usize> {
    let start = chunk * CHUNK_TOKENS;
    start..(start + CHUNK_TOKENS).min(pos + 1)
}

/// The partial results of one chunk of a query, its `keys`, for each of its
/// heads (`q`: the heads one after the other): head `h`'s record `[max,
/// sum, acc]` goes to `records[h * part_len..]`. `scores` holds a
/// [`CHUNK_TOKENS`] row per head. `pieces` hold the chunk's K and V rows in
/// order as (first key, K rows, V rows); each is read once for all the
/// heads, and per head the operations and their order are those of one
/// head alone, whatever the pieces (a row's score is its own dot product,
/// and the weighted sum adds the rows in key order), so the bits do not
/// depend on how the chunk is cut. With `prefetch`, each K piece is asked
/// for a piece ahead and each V piece during the K pass.
fn chunk_partial<'p, E: KvElem>(
    dims: AttnDims,
    pieces: impl Iterator<Item = (usize, &'p [E], &'p [E])> + Clone,
    prefetch_ahead: bool,
    q: &[f32],
    keys: Range<usize>,
    scores: &mut [f32],
    records: &mut [f32],
) {
    let (hd, part) = (dims.head_dim, dims.part_len());
    let heads = q.len() / hd;
    let start = keys.start;
    let scale = 1.0 / (hd as f32).sqrt();
    // Head `h`'s scores of the `n` keys from `first`.
    let row = |h: usize, first: usize, n: usize| {
        let at = h * CHUNK_TOKENS + first - start;
        at..at + n
    };
    // A piece of `rows` values against heads `head_stride` apart.
    let layout = |rows: usize, head_stride: usize| HeadsLayout {
        heads,
        keys: rows / hd,
        head_dim: hd,
        score_stride: CHUNK_TOKENS,
        head_stride,
    };
    let mut ahead = pieces.clone().peekable();
    if prefetch_ahead {
        if let Some((_, k, _)) = ahead.peek() {
            prefetch(k);
        }
    }
    while let Some((first, k, v)) = ahead.next() {
        if prefetch_ahead {
            if let Some((_, next_k, _)) = ahead.peek() {
                prefetch(next_k);
            }
            prefetch(v);
        }
        let scores = &mut scores[row(0, first, 0).start..];
        dot_rows_scaled(layout(k.len(), hd), q, k, scale, scores);
    }
    for h in 0..heads {
        let (max, sum) = softmax_parts(&mut scores[row(h, start, keys.len())]);
        let record = &mut records[h * part..][..part];
        record[0] = max;
        record[1] = sum;
        record[2..].fill(0.0);
    }
    for (first, _, v) in pieces {
        axpy_rows(
            layout(v.len(), part),
            &scores[row(0, first, 0).start..],
            v,
            &mut records[2..],
        );
    }
}

/// Folds chunk record `r` into the running record `acc` (both `[max, sum,
/// weighted V]`, `acc` holding the chunks before `r`): the side with the
/// smaller max is scaled by `exp(its max - the larger)`. Every plan folds a
/// query's chunks in chunk order with this one function, so the plan never
/// changes a bit.
fn fold(acc: &mut [f32], r: &[f32]) {
    if r[0] > acc[0] {
        let w = (acc[0] - r[0]).exp();
        acc[0] = r[0];
        acc[1] = acc[1] * w + r[1];
        for (a, &x) in acc[2..].iter_mut().zip(&r[2..]) {
            *a = *a * w + x;
        }
    } else {
        let w = (r[0] - acc[0]).exp();
        acc[1] += w * r[1];
        axpy(w, &r[2..], &mut acc[2..]);
    }
}

/// A query head's output from its folded record: the weighted sum of V
/// divided by the sum of the weights.
fn finish(acc: &[f32], out: &mut [f32]) {
    let inv = 1.0 / acc[1];
    for (o, &a) in out.iter_mut().zip(&acc[2..]) {
        *o = a * inv;
    }
}
