//! Choosing the data-parallel engine for a request: the one that holds the
//! longest prefix of its prompt in its prefix cache, unless another is so
//! much less loaded that queueing behind the cache costs more than
//! recomputing the prefix (what vLLM's DP coordinator does by load alone and
//! llm-d's precise prefix-cache scorer by cached blocks).
//!
//! The router learns each engine's cached blocks from its KV-cache events
//! ([`KvCacheEvent`]): an engine names blocks by its own keyed hashes, so
//! the router re-hashes every stored block's tokens under its own key,
//! chained through the parent the event names, and keeps per engine the
//! engine's hash → the router's. A prompt is then hashed once, block by
//! block, and each engine's match is the longest run of its first blocks
//! the engine holds. The index is best effort: a block whose parent the
//! router never heard of (events missed) is not indexed, which only costs
//! a worse choice, never a wrong answer.

use std::collections::HashMap;

use crate::kv_cache::{BlockHash, BlockHasher, KvCacheEvent};

/// How many prompt tokens one request waiting ahead is worth: the router
/// prefers an engine whose cache saves `n` tokens of prefill over one with
/// `n / LOAD_TOKENS` fewer requests queued. 64 tokens is about the prefill
/// a decode step's worth of batch slots buys back on a CPU engine; a
/// waiting request costs four running ones, as vLLM's DP coordinator counts.
const LOAD_TOKENS: f64 = 64.0;

/// An engine's queue, as its stats report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Requests waiting to be scheduled.
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
}

impl EngineLoad {
    fn weight(self) -> f64 {
        (4 * self.waiting + self.running) as f64
    }
}

/// What one engine's prefix cache holds, in the router's hashes.
#[derive(Debug, Default)]
struct EngineBlocks {
    /// The engine's hash of each cached block → the router's.
    ours: HashMap<u64, BlockHash>,
    /// The router's hashes of the cached blocks, with how many of the
    /// engine's blocks carry each (two requests may cache equal blocks).
    held: HashMap<BlockHash, u32>,
}

impl EngineBlocks {
    fn store(&mut self, theirs: u64, ours: BlockHash) {
        if self.ours.insert(theirs, ours).is_none() {
            *self.held.entry(ours).or_default() += 1;
        }
    }

    fn remove(&mut self, theirs: u64) {
        let Some(ours) = self.ours.remove(&theirs) else {
            return;
        };
        if let Some(n) = self.held.get_mut(&ours) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&ours);
            }
        }
    }
}

/// Which prefixes each data-parallel engine holds, and the choice it
/// leads to.
#[derive(Debug)]
pub struct DpRouter {
    block_size: usize,
    hasher: BlockHasher,
    engines: Vec<EngineBlocks>,
}

impl DpRouter {
    /// A router over `num_engines` engines with `block_size`-token blocks.
    pub fn new(num_engines: usize, block_size: usize) -> DpRouter {
        DpRouter {
            block_size: block_size.max(1),
            hasher: BlockHasher::default(),
            engines: (0..num_engines).map(|_| EngineBlocks::default()).collect(),
        }
    }

    /// Learns what engine `engine` stored, evicted or cleared, in order.
    pub fn apply(&mut self, engine: usize, events: &[KvCacheEvent]) {
        let Some(blocks) = self.engines.get_mut(engine) else {
            return;
        };
        for event in events {
            match event {
                KvCacheEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    extra_key,
                } => {
                    if *block_size as usize != self.block_size {
                        continue;
                    }
                    let mut extra = *extra_key;
                    let mut parent = match parent_block_hash {
                        None => None,
                        Some(p) => match blocks.ours.get(p) {
                            Some(&ours) => Some(ours),
                            // A chain the router cannot place.
                            None => continue,
                        },
                    };
                    let chunks = token_ids.chunks_exact(self.block_size);
                    for (&theirs, tokens) in block_hashes.iter().zip(chunks) {
                        let ours = self.hasher.hash_block(parent, tokens, extra.take());
                        blocks.store(theirs, ours);
                        parent = Some(ours);
                    }
                }
                KvCacheEvent::BlockRemoved { block_hashes } => {
                    for &h in block_hashes {
                        blocks.remove(h);
                    }
                }
                KvCacheEvent::AllBlocksCleared => *blocks = EngineBlocks::default(),
            }
        }
    }

    /// The router's hashes of `prompt`'s full blocks, for a request with
    /// the cache salt `salt` ([`cache_salt_key`](crate::kv_cache::cache_salt_key)).
    pub fn prompt_hashes(&self, prompt: &[u32], salt: Option<u64>) -> Vec<BlockHash> {
        let mut parent = None;
        let mut extra = salt;
        prompt
            .chunks_exact(self.block_size)
            .map(|tokens| {
                let h = self.hasher.hash_block(parent, tokens, extra.take());
                parent = Some(h);
                h
            })
            .collect()
    }

    /// How many of `hashes`' leading blocks `engine` holds.
    pub fn matched_blocks(&self, engine: usize, hashes: &[BlockHash]) -> usize {
        self.engines.get(engine).map_or(0, |blocks| {
            hashes
                .iter()
                .take_while(|h| blocks.held.contains_key(h))
                .count()
        })
    }

    /// The engine for a request with `prompt` and cache salt `salt`
    /// ([`cache_salt_key`](crate::kv_cache::cache_salt_key)), given each engine's load: the best trade of
    /// cached tokens against queued requests; ties go to the less loaded,
    /// then the lower rank.
    pub fn choose(&self, prompt: &[u32], salt: Option<u64>, loads: &[EngineLoad]) -> usize {
        let hashes = self.prompt_hashes(prompt, salt);
        let score = |engine: usize| {
            let cached = (self.matched_blocks(engine, &hashes) * self.block_size) as f64;
            let load = loads.get(engine).copied().unwrap_or_default().weight();
            (cached - LOAD_TOKENS * load, -load)
        };
        (0..self.engines.len())
            .map(|e| (e, score(e)))
            .fold(
                None,
                |best: Option<(usize, (f64, f64))>, (e, s)| match best {
                    Some((_, b)) if b >= s => best,
                    _ => Some((e, s)),
                },
            )
            .map_or(0, |(e, _)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{cache_salt_key, KVCacheManager, RequestBlocks};

    const BS: usize = 4;

    /// Prefills `tokens` salted with `salt` on `m` and frees the request,
    /// as an engine does for a request that finished.
    fn serve(m: &mut KVCacheManager, tokens: &[u32], salt: Option<u64>) {
        let mut r = RequestBlocks::new(salt);
        let c = m.get_computed_blocks(&mut r, tokens);
        let n = tokens.len() - c.num_tokens;
        m.allocate_slots(&mut r, tokens, 0, n, &c)
            .expect("the test's engine has room");
        m.free(&mut r, tokens, tokens.len());
    }

    fn engine(num_blocks: u32) -> KVCacheManager {
        let mut m = KVCacheManager::new(num_blocks, BS as u32, true).unwrap();
        m.enable_events();
        m
    }

    #[test]
    fn the_index_predicts_each_engines_own_prefix_hit() {
        // Two engines with their own hash keys serve different prompts,
        // some with a cache salt, with evictions (16 blocks each); after
        // every request the router's match must equal what the engine
        // itself would reuse, salted or not.
        let mut engines = [engine(16), engine(16)];
        let mut router = DpRouter::new(2, BS);
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let salts = [None, Some(cache_salt_key("a")), Some(cache_salt_key("b"))];
        let stems: Vec<Vec<u32>> = (0..4)
            .map(|s| (0..24).map(|t| s * 100 + t).collect())
            .collect();
        for _ in 0..200 {
            let e = (next() % 2) as usize;
            let mut prompt = stems[(next() % 4) as usize][..(next() % 25) as usize].to_vec();
            prompt.extend((0..next() % 12).map(|_| 1000 + (next() % 5) as u32));
            if prompt.is_empty() {
                continue;
            }
            serve(&mut engines[e], &prompt, salts[(next() % 3) as usize]);
            router.apply(e, &engines[e].take_events());
            for (i, m) in engines.iter_mut().enumerate() {
                let probe: Vec<u32> = prompt.iter().copied().chain([9999]).collect();
                for salt in salts {
                    let mut r = RequestBlocks::new(salt);
                    let hit = m.get_computed_blocks(&mut r, &probe).num_tokens / BS;
                    assert_eq!(
                        router.matched_blocks(i, &router.prompt_hashes(&probe, salt)),
                        hit,
                        "engine {i}, prompt {probe:?}, salt {salt:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_shared_prefix_goes_where_it_is_cached_unless_that_engine_is_swamped() {
        let mut engines = [engine(64), engine(64)];
        let mut router = DpRouter::new(2, BS);
        let system: Vec<u32> = (0..128).collect();
        serve(&mut engines[1], &system, None);
        router.apply(1, &engines[1].take_events());
        let mut prompt = system.clone();
        prompt.extend([500, 501, 502]);
        let idle = [EngineLoad::default(); 2];
        assert_eq!(
            router.choose(&prompt, None, &idle),
            1,
            "the cached prefix wins"
        );
        // One request more running on engine 1 costs less than the 128
        // cached tokens save.
        let busier = [
            EngineLoad::default(),
            EngineLoad {
                waiting: 0,
                running: 1,
            },
        ];
        assert_eq!(router.choose(&prompt, None, &busier), 1);
        let swamped = [
            EngineLoad::default(),
            EngineLoad {
                waiting: 8,
                running: 8,
            },
        ];
        assert_eq!(
            router.choose(&prompt, None, &swamped),
            0,
            "queueing costs more"
        );
        // Without a cached prefix, the least loaded engine, then rank 0.
        assert_eq!(router.choose(&[7, 7, 7, 7, 7], None, &busier), 0);
        assert_eq!(router.choose(&[7, 7, 7, 7, 7], None, &idle), 0);
        // A cleared engine is forgotten.
        engines[1].reset_prefix_cache();
        router.apply(1, &engines[1].take_events());
        assert_eq!(
            router.matched_blocks(1, &router.prompt_hashes(&prompt, None)),
            0
        );
    }
}
