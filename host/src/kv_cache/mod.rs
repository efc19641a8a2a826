//! The paged KV cache's bookkeeping (vLLM's `KVCacheManager` and `BlockPool`):
//! which fixed-size blocks of KV memory each request owns, which blocks are
//! free, and which free or shared blocks still hold a reusable prefix.
//!
//! This module holds no KV tensors; the model runner owns the memory and
//! addresses it by the block ids handed out here.

pub mod block_pool;
pub mod events;
pub mod free_queue;
pub mod hashing;
pub mod manager;

pub use block_pool::BlockPool;
pub use events::KvCacheEvent;
pub use hashing::{cache_salt_key, BlockHash, BlockHasher};
pub use manager::{ComputedBlocks, KVCacheManager, PrefixCacheStats, RequestBlocks};

use thiserror::Error;

/// Index of a KV block, `0..num_blocks`.
pub type BlockId = u32;

/// A KV cache configured with impossible sizes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvCacheError {
    /// The block count must be in `1..u32::MAX`.
    #[error("num_blocks = {0}: the KV cache needs at least one block (and fewer than 2^32 - 1); give it more memory or lower block_size")]
    InvalidNumBlocks(u32),
    /// The block size must be at least one token.
    #[error("block_size = {0}: a KV block must hold at least one token (vLLM uses 16)")]
    InvalidBlockSize(u32),
}
