//! The block pool: reference counts, the free queue and the prefix cache map.
//!
//! Every block is either in use (reference count ≥ 1, owned by that many
//! requests) or free (count 0, in the free queue). A free block may still hold
//! the hash of the tokens whose KV it contains; such a block stays in the
//! cached map until it is handed out again, so a later request with the same
//! prefix can revive it (`touch`) instead of recomputing it.
//!
//! Eviction follows vLLM: blocks are handed out from the head of the free
//! queue; freed blocks that hold a hash go to the tail (evicted last, so the
//! queue is LRU over freeing time), freed blocks without a hash go to the head
//! (nothing to lose, and reusing them first keeps cached ones longer). Callers
//! free a request's blocks tail first, so a request's suffix is evicted before
//! its prefix (which other requests are more likely to share).

use std::collections::HashMap;

use super::events::{EventLog, KvCacheEvent};
use super::free_queue::FreeBlockQueue;
use super::hashing::{BlockHash, BlockHashState};
use super::{BlockId, KvCacheError};

/// A fixed set of KV blocks with reference counts and a prefix cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    free: FreeBlockQueue,
    cached: HashMap<BlockHash, BlockId, BlockHashState>,
    events: EventLog,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, ids `0..num_blocks`.
    pub fn new(num_blocks: u32) -> Result<Self, KvCacheError> {
        if num_blocks == 0 || num_blocks == u32::MAX {
            return Err(KvCacheError::InvalidNumBlocks(num_blocks));
        }
        let n = num_blocks as usize;
        Ok(Self {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            free: FreeBlockQueue::new_full(num_blocks),
            cached: HashMap::default(),
            events: EventLog::default(),
        })
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks not owned by any request (including evictable cached ones).
    pub fn num_free_blocks(&self) -> u32 {
        self.free.len() as u32
    }

    /// Fraction of blocks in use, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.ref_cnt.len() as f64
    }

    /// How many requests own `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt[block as usize]
    }

    /// The hash `block` is cached under, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.hash[block as usize]
    }

    /// Number of entries in the prefix cache map.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The cached block holding `hash`, if any.
    pub fn get_cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Appends `n` fresh blocks (reference count 1, no hash) to `out`, taking
    /// them from the head of the free queue and evicting any cached hash they
    /// still hold. Takes nothing and returns false when fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.free.len() {
            return false;
        }
        out.reserve(n);
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                unreachable!("free queue shorter than its length");
            };
            self.evict_hash(b);
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        true
    }

    /// Drops `block`'s hash from the block and from the map (if the map still
    /// points at this block).
    fn evict_hash(&mut self, block: BlockId) {
        if let Some(h) = self.hash[block as usize].take() {
            if self.cached.get(&h) == Some(&block) {
                self.cached.remove(&h);
                self.events.push(|| KvCacheEvent::BlockRemoved {
                    block_hashes: vec![h.0],
                });
            }
        }
    }

    /// Takes one more reference on each block; a free block (a cache hit on a
    /// block nobody owns) leaves the free queue, in O(1).
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let rc = &mut self.ref_cnt[b as usize];
            if *rc == 0 {
                self.free.remove(b);
            }
            *rc += 1;
        }
    }

    /// Drops one reference on each block in iteration order; blocks reaching
    /// zero join the free queue (hashed at the tail, unhashed at the head), so
    /// blocks freed earlier in the iteration are evicted earlier.
    pub fn free_blocks<I: IntoIterator<Item = BlockId>>(&mut self, ordered: I) {
        for b in ordered {
            let rc = &mut self.ref_cnt[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc -= 1;
            if *rc == 0 {
                if self.hash[b as usize].is_some() {
                    self.free.push_back(b);
                } else {
                    self.free.push_front(b);
                }
            }
        }
    }

    /// Records that `block` (in use) holds the KV of the full block `hash`.
    /// Returns false and changes nothing when another block already holds that
    /// hash (two requests computed the same block at once); the duplicate stays
    /// uncached and is reused first when freed.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> bool {
        match self.cached.entry(hash) {
            std::collections::hash_map::Entry::Occupied(e) => *e.get() == block,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(block);
                self.hash[block as usize] = Some(hash);
                true
            }
        }
    }

    /// Forgets every cached hash (blocks keep their contents and owners).
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
        self.events.push(|| KvCacheEvent::AllBlocksCleared);
    }

    /// Records [`KvCacheEvent`]s from now on, for [`Self::take_events`].
    pub fn enable_events(&mut self) {
        self.events.enable();
    }

    /// Whether events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events.is_on()
    }

    /// Records an event (when events are on).
    pub fn record_event(&mut self, event: impl FnOnce() -> KvCacheEvent) {
        self.events.push(event);
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        self.events.take()
    }

    /// Free blocks from the next to be handed out to the last.
    pub fn free_queue(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter()
    }

    /// Checks the pool's own invariants: queued exactly when unowned, queue
    /// length consistent, and the map and per-block hashes agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut queued = vec![false; self.ref_cnt.len()];
        for b in self.free.iter() {
            if std::mem::replace(&mut queued[b as usize], true) {
                return Err(format!("block {b} queued twice"));
            }
        }
        let listed = queued.iter().filter(|q| **q).count();
        if listed != self.free.len() {
            return Err(format!(
                "free queue holds {listed} blocks but counts {}",
                self.free.len()
            ));
        }
        for (b, (&rc, &q)) in self.ref_cnt.iter().zip(&queued).enumerate() {
            if (rc == 0) != q {
                return Err(format!("block {b}: ref count {rc} but queued = {q}"));
            }
        }
        for (&h, &b) in &self.cached {
            if self.hash[b as usize] != Some(h) {
                return Err(format!(
                    "map entry {h:?} -> {b} but block holds {:?}",
                    self.hash[b as usize]
                ));
            }
        }
        let hashed = self.hash.iter().filter(|h| h.is_some()).count();
        if hashed != self.cached.len() {
            return Err(format!(
                "{hashed} hashed blocks but {} map entries",
                self.cached.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(p: &BlockPool) -> Vec<BlockId> {
        p.free_queue().collect()
    }

    #[test]
    fn rejects_zero_blocks() {
        assert!(matches!(
            BlockPool::new(0),
            Err(KvCacheError::InvalidNumBlocks(0))
        ));
    }

    #[test]
    fn allocation_takes_from_head_and_fails_whole_when_short() {
        let mut p = BlockPool::new(4).unwrap();
        let mut out = Vec::new();
        assert!(p.get_new_blocks(3, &mut out));
        assert_eq!(out, vec![0, 1, 2]);
        assert!(!p.get_new_blocks(2, &mut out), "only one block is free");
        assert_eq!(out.len(), 3, "a failed allocation takes nothing");
        assert_eq!(p.num_free_blocks(), 1);
        assert!((p.usage() - 0.75).abs() < 1e-12);
        p.check_invariants().unwrap();
    }

    #[test]
    fn ref_counts_share_and_release() {
        let mut p = BlockPool::new(3).unwrap();
        let mut a = Vec::new();
        p.get_new_blocks(2, &mut a);
        p.touch(&a); // a second owner
        assert_eq!(p.ref_count(0), 2);
        p.free_blocks(a.iter().rev().copied());
        assert_eq!(p.num_free_blocks(), 1, "still owned once");
        p.free_blocks(a.iter().rev().copied());
        assert_eq!(p.num_free_blocks(), 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn lru_order_later_freed_evicted_later_and_tail_first_within_a_request() {
        let mut p = BlockPool::new(6).unwrap();
        let (mut r1, mut r2) = (Vec::new(), Vec::new());
        p.get_new_blocks(3, &mut r1); // 0 1 2
        p.get_new_blocks(3, &mut r2); // 3 4 5
        for (i, &b) in r1.iter().chain(&r2).enumerate() {
            assert!(p.cache_block(b, BlockHash(100 + i as u64)));
        }
        // r1 finishes first, then r2; each frees tail first.
        p.free_blocks(r1.iter().rev().copied());
        p.free_blocks(r2.iter().rev().copied());
        assert_eq!(queue(&p), vec![2, 1, 0, 5, 4, 3]);
        // Allocation evicts in exactly that order and drops the hashes.
        let mut got = Vec::new();
        p.get_new_blocks(2, &mut got);
        assert_eq!(got, vec![2, 1]);
        assert_eq!(p.block_hash(2), None);
        assert_eq!(
            p.get_cached_block(BlockHash(102)),
            None,
            "eviction drops the hash"
        );
        assert_eq!(
            p.get_cached_block(BlockHash(100)),
            Some(0),
            "unevicted stays cached"
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn unhashed_blocks_are_reused_before_cached_ones() {
        let mut p = BlockPool::new(4).unwrap();
        let mut r = Vec::new();
        p.get_new_blocks(4, &mut r);
        p.cache_block(0, BlockHash(7));
        p.free_blocks(r.iter().rev().copied()); // 3,2,1 unhashed -> head; 0 -> tail
        assert_eq!(queue(&p), vec![1, 2, 3, 0]);
    }

    #[test]
    fn touching_a_cached_free_block_removes_it_from_the_middle() {
        let mut p = BlockPool::new(5).unwrap();
        let mut r = Vec::new();
        p.get_new_blocks(5, &mut r);
        for &b in &r {
            p.cache_block(b, BlockHash(b as u64 + 10));
        }
        p.free_blocks(r.iter().copied());
        assert_eq!(queue(&p), vec![0, 1, 2, 3, 4]);
        let hit = p.get_cached_block(BlockHash(12)).unwrap();
        p.touch(&[hit]);
        assert_eq!(queue(&p), vec![0, 1, 3, 4]);
        assert_eq!(p.ref_count(2), 1);
        assert_eq!(
            p.block_hash(2),
            Some(BlockHash(12)),
            "a revived block keeps its hash"
        );
        p.free_blocks([2]);
        assert_eq!(
            queue(&p),
            vec![0, 1, 3, 4, 2],
            "re-freed block is most recently used"
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hash_is_not_cached_twice_and_reset_forgets_all() {
        let mut p = BlockPool::new(3).unwrap();
        let mut r = Vec::new();
        p.get_new_blocks(2, &mut r);
        assert!(p.cache_block(0, BlockHash(5)));
        assert!(!p.cache_block(1, BlockHash(5)));
        assert!(
            p.cache_block(0, BlockHash(5)),
            "re-caching the same block is fine"
        );
        assert_eq!(p.block_hash(1), None);
        assert_eq!(p.num_cached_blocks(), 1);
        p.reset_prefix_cache();
        assert_eq!(p.num_cached_blocks(), 0);
        assert_eq!(p.block_hash(0), None);
        p.check_invariants().unwrap();
    }
}
