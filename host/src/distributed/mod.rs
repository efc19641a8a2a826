//! Tensor parallelism across worker processes on one machine: the
//! shared-memory all-reduce the sharded model runner calls twice per layer
//! (after the attention output projection and after the MLP's down
//! projection), as Megatron-LM and vLLM's `tensor_model_parallel_all_reduce`
//! do. The weights' sharding itself lives in [`crate::model::shard`].
//!
//! - [`all_reduce`]: [`AllReduceGroup`], one segment with a slot per rank,
//!   a per-rank arrival counter, and a sum in rank order (bit-identical on
//!   every rank); a dead or stalled peer is an error naming its rank.

pub mod all_reduce;
#[cfg(test)]
mod tests;

pub use all_reduce::{
    AllReduceError, AllReduceGroup, AllReduceHandle, AllReduceOwner, DEFAULT_SLOT_FLOATS,
};
