//! The KV cache manager: per-request block tables over a shared [`BlockPool`],
//! with prefix-cache lookup and caching of computed full blocks.
//!
//! The manager does not own requests. Each request's KV state is a
//! [`RequestBlocks`] stored inside the request by the scheduler, which passes
//! it in together with the request's token ids (prompt followed by output).
//!
//! A block is offered to the prefix cache only once its KV is certainly
//! computed, i.e. once it lies below a request's `num_computed_tokens` at the
//! *start* of a step (or when the request is freed). vLLM caches blocks at
//! allocation time, relying on every layer writing the whole batch's KV before
//! attention reads it; caching one step later is safe whatever order the model
//! runner processes the batch in, at the cost of one step of latency.

use std::ops::Range;

use super::block_pool::BlockPool;
use super::events::KvCacheEvent;
use super::hashing::{BlockHash, BlockHasher};
use super::{BlockId, KvCacheError};

/// One request's KV state: its block table and the hashes of its full blocks.
#[derive(Debug, Clone, Default)]
pub struct RequestBlocks {
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    /// Leading blocks already offered to the prefix cache.
    num_cached_blocks: usize,
    extra_key: Option<u64>,
}

impl RequestBlocks {
    /// Empty state; `extra_key` (a cache salt or adapter id) must match for a
    /// prefix hit, so requests with different keys never share blocks.
    pub fn new(extra_key: Option<u64>) -> Self {
        Self {
            extra_key,
            ..Self::default()
        }
    }

    /// The block table: block `i` holds the KV of tokens `i*block_size ..`.
    pub fn block_ids(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Hashes of the full blocks hashed so far (they stay valid while the
    /// request lives, since tokens are only ever appended).
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Extends the hashes to cover the first `n` full blocks of `tokens`.
    fn ensure_hashes(&mut self, hasher: &BlockHasher, bs: usize, tokens: &[u32], n: usize) {
        while self.hashes.len() < n {
            let k = self.hashes.len();
            let extra = if k == 0 { self.extra_key } else { None };
            let h = hasher.hash_block(
                self.hashes.last().copied(),
                &tokens[k * bs..(k + 1) * bs],
                extra,
            );
            self.hashes.push(h);
        }
    }
}

/// The result of a prefix-cache lookup, passed back to
/// [`KVCacheManager::allocate_slots`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ComputedBlocks {
    /// Cached blocks holding the request's longest cached prefix, in order.
    pub blocks: Vec<BlockId>,
    /// Tokens they cover (`blocks.len() * block_size`).
    pub num_tokens: usize,
    /// Tokens that were looked up (for hit-rate statistics).
    num_queried_tokens: usize,
}

impl ComputedBlocks {
    /// No prefix hit (for requests that already hold blocks).
    pub const NONE: ComputedBlocks = ComputedBlocks {
        blocks: Vec::new(),
        num_tokens: 0,
        num_queried_tokens: 0,
    };
}

/// Prefix-cache counters, in tokens, over requests admitted with a lookup.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrefixCacheStats {
    /// Admissions that looked up the cache.
    pub requests: u64,
    /// Tokens looked up.
    pub queries: u64,
    /// Tokens found cached.
    pub hits: u64,
}

impl PrefixCacheStats {
    /// `hits / queries`, or 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// Allocates KV blocks to requests and maintains the prefix cache.
#[derive(Debug, Clone)]
pub struct KVCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
    hasher: BlockHasher,
    stats: PrefixCacheStats,
}

impl KVCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens (the worker's
    /// `determine_available_memory` decides `num_blocks`).
    pub fn new(
        num_blocks: u32,
        block_size: u32,
        enable_prefix_caching: bool,
    ) -> Result<Self, KvCacheError> {
        if block_size == 0 {
            return Err(KvCacheError::InvalidBlockSize(block_size));
        }
        Ok(Self {
            pool: BlockPool::new(num_blocks)?,
            block_size: block_size as usize,
            enable_prefix_caching,
            hasher: BlockHasher::default(),
            stats: PrefixCacheStats::default(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The underlying pool (read-only; for statistics and checks).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.pool.num_blocks()
    }

    /// Blocks that an allocation could take now (free and evictable).
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.num_free_blocks()
    }

    /// Fraction of blocks owned by requests, in [0, 1].
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Prefix-cache counters since creation.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Forgets every cached prefix. Blocks in use keep their contents; the
    /// counters are kept.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
    }

    /// Looks up the longest cached prefix of `tokens` in whole blocks. The
    /// last token is never counted as cached, even when the whole sequence
    /// is, because the model must compute at least one position to produce
    /// the next token's logits. Returns nothing when caching is off or the
    /// request already holds blocks. Takes no references: pass the result to
    /// [`allocate_slots`](Self::allocate_slots) before anything else allocates.
    pub fn get_computed_blocks(
        &mut self,
        req: &mut RequestBlocks,
        tokens: &[u32],
    ) -> ComputedBlocks {
        let mut out = ComputedBlocks::default();
        if !self.enable_prefix_caching || tokens.is_empty() || !req.blocks.is_empty() {
            return out;
        }
        let bs = self.block_size;
        out.num_queried_tokens = tokens.len();
        let max_blocks = (tokens.len() - 1) / bs;
        for k in 0..max_blocks {
            req.ensure_hashes(&self.hasher, bs, tokens, k + 1);
            match self.pool.get_cached_block(req.hashes[k]) {
                Some(b) => out.blocks.push(b),
                None => break,
            }
        }
        out.num_tokens = out.blocks.len() * bs;
        out
    }

    /// Makes room for `num_new_tokens` more tokens after the
    /// `num_computed_tokens` already computed plus the prefix hits in
    /// `computed` (pass `ComputedBlocks::default()` when there are none).
    /// Returns the range of `req.block_ids()` added by this call (hits first,
    /// then fresh blocks), or `None`, changing nothing, when not enough blocks
    /// are free. `tokens` may be shorter than the slots being allocated (async
    /// scheduling allocates for tokens not sampled yet).
    #[inline]
    pub fn allocate_slots(
        &mut self,
        req: &mut RequestBlocks,
        tokens: &[u32],
        num_computed_tokens: usize,
        num_new_tokens: usize,
        computed: &ComputedBlocks,
    ) -> Option<Range<usize>> {
        if computed.blocks.is_empty()
            && num_computed_tokens + num_new_tokens <= req.blocks.len() * self.block_size
        {
            // Fast path (most decode steps): the last block has room.
            let len = req.blocks.len();
            self.cache_full_blocks(req, tokens, num_computed_tokens);
            return Some(len..len);
        }
        self.allocate_new_blocks(req, tokens, num_computed_tokens, num_new_tokens, computed)
    }

    /// The rest of `allocate_slots`: prefix hits and fresh blocks.
    fn allocate_new_blocks(
        &mut self,
        req: &mut RequestBlocks,
        tokens: &[u32],
        num_computed_tokens: usize,
        num_new_tokens: usize,
        computed: &ComputedBlocks,
    ) -> Option<Range<usize>> {
        debug_assert!(computed.blocks.is_empty() || req.blocks.is_empty());
        let num_computed = num_computed_tokens + computed.num_tokens;
        let need = self.blocks_for_tokens(num_computed + num_new_tokens);
        let have = req.blocks.len() + computed.blocks.len();
        let num_new_blocks = need.saturating_sub(have);
        let revived = computed
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        if num_new_blocks + revived > self.pool.num_free_blocks() as usize {
            return None;
        }
        let start = req.blocks.len();
        if !computed.blocks.is_empty() {
            self.pool.touch(&computed.blocks);
            req.blocks.extend_from_slice(&computed.blocks);
            req.num_cached_blocks = req.blocks.len();
        }
        if computed.num_queried_tokens > 0 {
            self.stats.requests += 1;
            self.stats.queries += computed.num_queried_tokens as u64;
            self.stats.hits += computed.num_tokens as u64;
        }
        let got = self.pool.get_new_blocks(num_new_blocks, &mut req.blocks);
        debug_assert!(got, "availability was checked above");
        self.cache_full_blocks(req, tokens, num_computed);
        Some(start..req.blocks.len())
    }

    /// Offers `req`'s full blocks below `num_computed_tokens` to the cache.
    /// The check is a multiplication, so a decode step whose block has not
    /// filled costs no division and no hashing.
    #[inline]
    fn cache_full_blocks(
        &mut self,
        req: &mut RequestBlocks,
        tokens: &[u32],
        num_computed_tokens: usize,
    ) {
        let upto = num_computed_tokens.min(tokens.len());
        if self.enable_prefix_caching && upto >= (req.num_cached_blocks + 1) * self.block_size {
            self.cache_new_full_blocks(req, tokens, upto / self.block_size);
        }
    }

    /// Hashes and caches blocks `req.num_cached_blocks..full`.
    fn cache_new_full_blocks(&mut self, req: &mut RequestBlocks, tokens: &[u32], full: usize) {
        req.ensure_hashes(&self.hasher, self.block_size, tokens, full);
        let events = self.pool.events_enabled();
        // With events on: the first block of the run of newly stored ones.
        let mut run = None;
        for k in req.num_cached_blocks..full {
            let fresh = events && self.pool.get_cached_block(req.hashes[k]).is_none();
            self.pool.cache_block(req.blocks[k], req.hashes[k]);
            match (fresh, run) {
                (true, None) => run = Some(k),
                (false, Some(first)) => {
                    self.record_stored(req, tokens, first..k);
                    run = None;
                }
                _ => {}
            }
        }
        if let Some(first) = run {
            self.record_stored(req, tokens, first..full);
        }
        req.num_cached_blocks = full;
    }

    /// Records that `req`'s blocks `run` entered the cache.
    fn record_stored(&mut self, req: &RequestBlocks, tokens: &[u32], run: Range<usize>) {
        let bs = self.block_size;
        self.pool.record_event(|| KvCacheEvent::BlockStored {
            block_hashes: req.hashes[run.clone()].iter().map(|h| h.0).collect(),
            parent_block_hash: run.start.checked_sub(1).map(|p| req.hashes[p].0),
            token_ids: tokens[run.start * bs..run.end * bs].to_vec(),
            block_size: bs as u32,
            extra_key: req.extra_key.filter(|_| run.start == 0),
        });
    }

    /// Records [`KvCacheEvent`]s from now on (for routers).
    pub fn enable_events(&mut self) {
        self.pool.enable_events();
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        self.pool.take_events()
    }

    /// Releases all of `req`'s blocks (finish, abort or preemption), first
    /// caching its computed full blocks so that a resumed or later request can
    /// reuse them. Blocks are freed tail first, so the suffix is evicted
    /// before the prefix. The request's hashes are kept.
    pub fn free(&mut self, req: &mut RequestBlocks, tokens: &[u32], num_computed_tokens: usize) {
        self.cache_full_blocks(req, tokens, num_computed_tokens);
        self.pool.free_blocks(req.blocks.iter().rev().copied());
        req.blocks.clear();
        req.num_cached_blocks = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr(num_blocks: u32, caching: bool) -> KVCacheManager {
        KVCacheManager::new(num_blocks, 4, caching).unwrap()
    }

    /// Runs a request's whole prompt as one prefill step and then frees it.
    fn prefill_and_free(m: &mut KVCacheManager, tokens: &[u32]) -> RequestBlocks {
        let mut r = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r, tokens);
        let n = tokens.len() - c.num_tokens;
        m.allocate_slots(&mut r, tokens, 0, n, &c).unwrap();
        m.free(&mut r, tokens, tokens.len());
        r
    }

    #[test]
    fn rejects_zero_block_size() {
        assert!(matches!(
            KVCacheManager::new(4, 0, true),
            Err(KvCacheError::InvalidBlockSize(0))
        ));
    }

    #[test]
    fn prefix_hit_covers_shared_full_blocks_only() {
        let mut m = mgr(16, true);
        let a: Vec<u32> = (0..10).collect(); // blocks [0..4) [4..8), partial [8..10)
        prefill_and_free(&mut m, &a);
        assert_eq!(
            m.pool().num_cached_blocks(),
            2,
            "only full blocks are cached"
        );
        let mut b: Vec<u32> = (0..6).collect();
        b.extend([99, 98, 97, 96, 95]);
        let mut r = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r, &b);
        assert_eq!(c.num_tokens, 4, "second block differs at token 6");
        let range = m.allocate_slots(&mut r, &b, 0, b.len() - 4, &c).unwrap();
        assert_eq!(range, 0..3);
        assert_eq!(r.block_ids()[0], c.blocks[0]);
        let s = m.prefix_cache_stats();
        assert_eq!((s.requests, s.queries, s.hits), (2, 21, 4));
    }

    #[test]
    fn never_the_whole_prompt_even_when_fully_cached() {
        let mut m = mgr(16, true);
        let a: Vec<u32> = (0..8).collect(); // exactly two full blocks
        prefill_and_free(&mut m, &a);
        let mut r = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r, &a);
        assert_eq!(
            c.num_tokens, 4,
            "the last block holds the last token, which must be computed"
        );
        let longer: Vec<u32> = (0..9).collect();
        let mut r2 = RequestBlocks::new(None);
        assert_eq!(m.get_computed_blocks(&mut r2, &longer).num_tokens, 8);
    }

    #[test]
    fn extra_key_isolates_prefixes() {
        let mut m = mgr(16, true);
        let a: Vec<u32> = (0..9).collect();
        prefill_and_free(&mut m, &a);
        let mut salted = RequestBlocks::new(Some(42));
        assert_eq!(m.get_computed_blocks(&mut salted, &a).num_tokens, 0);
    }

    #[test]
    fn caching_off_never_hits_or_hashes() {
        let mut m = mgr(16, false);
        let a: Vec<u32> = (0..9).collect();
        let r = prefill_and_free(&mut m, &a);
        assert!(r.block_hashes().is_empty());
        assert_eq!(m.pool().num_cached_blocks(), 0);
        let mut r2 = RequestBlocks::new(None);
        assert_eq!(m.get_computed_blocks(&mut r2, &a).num_tokens, 0);
        assert_eq!(m.prefix_cache_stats().queries, 0);
    }

    #[test]
    fn allocation_failure_changes_nothing_and_free_returns_everything() {
        let mut m = mgr(4, true);
        let t: Vec<u32> = (0..20).collect();
        let mut r = RequestBlocks::new(None);
        assert_eq!(
            m.allocate_slots(&mut r, &t, 0, 17, &ComputedBlocks::default()),
            None
        );
        assert!(r.block_ids().is_empty());
        assert_eq!(m.num_free_blocks(), 4);
        assert_eq!(
            m.allocate_slots(&mut r, &t, 0, 6, &ComputedBlocks::default()),
            Some(0..2)
        );
        // Decode steps: a new block only when the previous one is full.
        assert_eq!(
            m.allocate_slots(&mut r, &t, 6, 1, &ComputedBlocks::default()),
            Some(2..2)
        );
        assert_eq!(
            m.allocate_slots(&mut r, &t, 7, 1, &ComputedBlocks::default()),
            Some(2..2)
        );
        assert_eq!(
            m.allocate_slots(&mut r, &t, 8, 1, &ComputedBlocks::default()),
            Some(2..3)
        );
        assert_eq!(
            m.pool().num_cached_blocks(),
            2,
            "blocks below num_computed are cached"
        );
        m.free(&mut r, &t, 9);
        assert_eq!(m.num_free_blocks(), 4);
        assert!(m.usage().abs() < 1e-12);
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn hits_on_free_cached_blocks_count_against_free_space() {
        let mut m = mgr(3, true);
        let a: Vec<u32> = (0..9).collect();
        prefill_and_free(&mut m, &a); // blocks 0,1 cached and free, 2 unhashed
        let mut r = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r, &a);
        assert_eq!(c.blocks.len(), 2);
        // 2 revived + 2 new > 3 free: must fail without touching anything.
        assert_eq!(m.allocate_slots(&mut r, &a, 0, 5, &c), None);
        assert_eq!(m.num_free_blocks(), 3);
        assert_eq!(m.allocate_slots(&mut r, &a, 0, 1, &c), Some(0..3));
        assert_eq!(m.num_free_blocks(), 0);
        m.pool().check_invariants().unwrap();
    }

    #[test]
    fn shared_blocks_are_ref_counted_across_requests() {
        let mut m = mgr(8, true);
        let a: Vec<u32> = (0..9).collect();
        let mut r1 = RequestBlocks::new(None);
        m.allocate_slots(&mut r1, &a, 0, 9, &ComputedBlocks::default())
            .unwrap();
        // The next step starts with 9 computed tokens: blocks 0 and 1 get cached.
        m.allocate_slots(&mut r1, &a, 9, 0, &ComputedBlocks::default())
            .unwrap();
        let mut r2 = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r2, &a);
        m.allocate_slots(&mut r2, &a, 0, 1, &c).unwrap();
        assert_eq!(&r2.block_ids()[..2], &r1.block_ids()[..2]);
        assert_eq!(m.pool().ref_count(r1.block_ids()[0]), 2);
        m.free(&mut r1, &a, 9);
        assert_eq!(m.pool().ref_count(r2.block_ids()[0]), 1);
        m.free(&mut r2, &a, 9);
        assert_eq!(m.num_free_blocks(), 8);
        m.pool().check_invariants().unwrap();
    }
}
