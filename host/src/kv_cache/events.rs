//! What the prefix cache tells routers (vLLM's `KVCacheEvent`s): blocks it
//! stored, blocks it evicted, and that it forgot everything. Recorded in
//! order by the [`BlockPool`](super::BlockPool) only while events are on,
//! so the hot path pays one branch when they are off.

/// One change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvCacheEvent {
    /// Full blocks, consecutive in one request, entered the prefix cache.
    BlockStored {
        /// Their hashes, in order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first (`None`: the first block
        /// of the sequence).
        parent_block_hash: Option<u64>,
        /// Their tokens, `block_size` per block.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The first block's extra key (its request's cache salt) when the
        /// run starts the sequence; the chain carries it to every later
        /// block. Not on the wire: vLLM's event has no place for it.
        #[serde(default)]
        extra_key: Option<u64>,
    },
    /// Cached blocks were evicted (their memory went to other tokens).
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was forgotten (a reset, new weights, new
    /// workers).
    AllBlocksCleared,
}

/// The events recorded since they were last taken; `None` when off.
#[derive(Debug, Clone, Default)]
pub(super) struct EventLog(Option<Vec<KvCacheEvent>>);

impl EventLog {
    pub(super) fn enable(&mut self) {
        self.0.get_or_insert_with(Vec::new);
    }

    pub(super) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    pub(super) fn push(&mut self, event: impl FnOnce() -> KvCacheEvent) {
        if let Some(log) = &mut self.0 {
            log.push(event());
        }
    }

    pub(super) fn take(&mut self) -> Vec<KvCacheEvent> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::KvCacheEvent::{self, AllBlocksCleared, BlockRemoved, BlockStored};
    use crate::kv_cache::{KVCacheManager, RequestBlocks};

    /// Prefills `tokens` in one step and frees the request; its hashes.
    fn prefill_and_free(m: &mut KVCacheManager, tokens: &[u32]) -> Vec<u64> {
        let mut r = RequestBlocks::new(None);
        let c = m.get_computed_blocks(&mut r, tokens);
        let n = tokens.len() - c.num_tokens;
        m.allocate_slots(&mut r, tokens, 0, n, &c).unwrap();
        m.free(&mut r, tokens, tokens.len());
        r.block_hashes().iter().map(|h| h.0).collect()
    }

    fn removed(events: &[KvCacheEvent]) -> Vec<u64> {
        let mut hashes: Vec<u64> = events
            .iter()
            .flat_map(|e| match e {
                BlockRemoved { block_hashes } => block_hashes.clone(),
                other => panic!("only removals expected: {other:?}"),
            })
            .collect();
        hashes.sort_unstable();
        hashes
    }

    #[test]
    fn stored_runs_chain_to_their_parent_and_evictions_and_resets_are_told() {
        let mut m = KVCacheManager::new(4, 4, true).unwrap();
        m.enable_events();
        let a: Vec<u32> = (0..10).collect();
        let ha = prefill_and_free(&mut m, &a);
        assert_eq!(
            m.take_events(),
            [BlockStored {
                block_hashes: ha.clone(),
                parent_block_hash: None,
                token_ids: (0..8).collect(),
                block_size: 4,
                extra_key: None,
            }]
        );
        // Shares a's first block: only its own blocks are stored, chained
        // to the shared one.
        let b: Vec<u32> = (0..4).chain(50..58).collect();
        let hb = prefill_and_free(&mut m, &b);
        assert_eq!(hb[0], ha[0]);
        assert_eq!(
            m.take_events(),
            [BlockStored {
                block_hashes: hb[1..].to_vec(),
                parent_block_hash: Some(ha[0]),
                token_ids: (50..58).collect(),
                block_size: 4,
                extra_key: None,
            }]
        );
        // Four blocks of new tokens evict every cached block.
        let c: Vec<u32> = (100..116).collect();
        let mut r = RequestBlocks::new(None);
        let computed = m.get_computed_blocks(&mut r, &c);
        m.allocate_slots(&mut r, &c, 0, c.len(), &computed).unwrap();
        let mut all = vec![ha[0], ha[1], hb[1], hb[2]];
        all.sort_unstable();
        assert_eq!(removed(&m.take_events()), all);
        m.reset_prefix_cache();
        assert_eq!(m.take_events(), [AllBlocksCleared]);
    }

    #[test]
    fn nothing_is_recorded_while_events_are_off() {
        let mut m = KVCacheManager::new(4, 4, true).unwrap();
        prefill_and_free(&mut m, &(0..10).collect::<Vec<u32>>());
        m.reset_prefix_cache();
        m.enable_events();
        assert!(m.take_events().is_empty());
    }
}
