//! How a step's attention is cut into work items.

use super::{chunks_of, AttnDims, SeqSpan, CHUNK_TOKENS};

/// Queries per work item: small enough to balance a prefill chunk over the
/// threads, large enough that taking an item costs nothing in comparison.
pub(crate) const QUERIES_PER_ITEM: usize = 16;

/// Most query tokens a step may have for its chunks to be spread over the
/// threads (see [`AttnPlan::build`]); bounds the shared partials buffer.
pub(crate) const SPLIT_MAX_QUERIES: usize = 8;

/// A unit of attention work: some query heads of one KV head, for a run of
/// one sequence's queries, over all their keys or over one chunk of them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkItem {
    /// Index into the step's sequences.
    pub seq: usize,
    /// First query head; all of `head .. head + heads` share one KV head.
    pub head: usize,
    /// Query heads.
    pub heads: usize,
    /// First query (within the sequence's query tokens).
    pub q_begin: usize,
    /// One past the last query.
    pub q_end: usize,
    /// `Some` when the item covers one chunk of one query's keys and leaves
    /// its partial result for the merge pass; `None` when it finishes its
    /// queries.
    pub split: Option<SplitPart>,
}

/// The chunk a split item covers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SplitPart {
    /// Chunk index (keys `chunk * CHUNK_TOKENS ..`).
    pub chunk: usize,
    /// The query's index in [`AttnPlan::split`].
    pub slot: usize,
}

/// A query whose chunks are computed by separate items and merged after.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SplitQuery {
    /// Its token in the flattened batch.
    pub token: usize,
    /// Its position (it attends to keys `0..=pos`).
    pub pos: usize,
}

/// A step's attention work. Depends only on the batch and the thread
/// count, so it is built once per step and shared by every layer.
#[derive(Debug, Default)]
pub(crate) struct AttnPlan {
    /// The items, costliest first.
    pub items: Vec<WorkItem>,
    /// The split queries, when the items are per chunk.
    pub split: Vec<SplitQuery>,
}

impl AttnPlan {
    /// Plans the step, in one of three shapes, from the most work to the
    /// least:
    /// - per KV head (every query head that shares it in one item, so each
    ///   K and V tile is read once for all of them), when that makes four
    ///   items per thread;
    /// - per KV head and chunk of keys, for a step of a few queries (a
    ///   decode batch) over contexts long enough to make two items per
    ///   thread that way: each item leaves a partial result and a second
    ///   pass merges a query's chunks;
    /// - else per query head, to keep the threads busy on a short context.
    ///
    /// Items of any shape run the same per-chunk operations and the same
    /// merge, so the plan never changes a result.
    pub fn build(&mut self, seqs: &[SeqSpan], dims: AttnDims, n_threads: usize) {
        self.items.clear();
        self.split.clear();
        let runs: usize = seqs
            .iter()
            .map(|s| s.query_len.div_ceil(QUERIES_PER_ITEM))
            .sum();
        let queries: usize = seqs.iter().map(|s| s.query_len).sum();
        let group = dims.num_heads / dims.num_kv_heads;
        let small = runs * dims.num_kv_heads < 4 * n_threads;
        let chunk_items = || -> usize {
            let per_query: usize = seqs
                .iter()
                .flat_map(|s| (0..s.query_len).map(|qi| chunks_of(s.pos(qi) + 1)))
                .sum();
            per_query * dims.num_kv_heads
        };
        if small && queries <= SPLIT_MAX_QUERIES && chunk_items() >= 2 * n_threads {
            self.build_split(seqs, dims);
        } else {
            let heads = if small { 1 } else { group };
            for (seq, s) in seqs.iter().enumerate() {
                for q_begin in (0..s.query_len).step_by(QUERIES_PER_ITEM) {
                    let q_end = (q_begin + QUERIES_PER_ITEM).min(s.query_len);
                    for head in (0..dims.num_heads).step_by(heads) {
                        self.items.push(WorkItem {
                            seq,
                            head,
                            heads,
                            q_begin,
                            q_end,
                            split: None,
                        });
                    }
                }
            }
        }
        // Keys attended, times heads.
        let cost = |it: &WorkItem| {
            let s = &seqs[it.seq];
            let keys = match it.split {
                Some(p) => (s.pos(it.q_begin) + 1 - p.chunk * CHUNK_TOKENS).min(CHUNK_TOKENS),
                None => (s.pos(it.q_end - 1) + 1) * (it.q_end - it.q_begin),
            };
            keys * it.heads
        };
        self.items
            .sort_unstable_by_key(|it| std::cmp::Reverse(cost(it)));
    }

    /// One item per (query, KV head, chunk).
    fn build_split(&mut self, seqs: &[SeqSpan], dims: AttnDims) {
        let group = dims.num_heads / dims.num_kv_heads;
        for (seq, s) in seqs.iter().enumerate() {
            for qi in 0..s.query_len {
                let slot = self.split.len();
                let pos = s.pos(qi);
                self.split.push(SplitQuery {
                    token: s.token_start + qi,
                    pos,
                });
                for chunk in 0..chunks_of(pos + 1) {
                    for head in (0..dims.num_heads).step_by(group) {
                        self.items.push(WorkItem {
                            seq,
                            head,
                            heads: group,
                            q_begin: qi,
                            q_end: qi + 1,
                            split: Some(SplitPart { chunk, slot }),
                        });
                    }
                }
            }
        }
    }
}
