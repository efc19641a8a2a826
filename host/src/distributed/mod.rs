//! Tensor parallelism across worker processes: the all-reduce the sharded
//! model runner calls twice per layer (after the attention output
//! projection and after the MLP's down projection), as Megatron-LM and
//! vLLM's `tensor_model_parallel_all_reduce` do. The weights' sharding
//! itself lives in [`crate::model::shard`].
//!
//! - [`all_reduce`]: [`AllReduceGroup`], for ranks on one machine: one
//!   shared-memory segment with a slot per rank, a per-rank arrival
//!   counter, and a sum in rank order (bit-identical on every rank); a dead
//!   or stalled peer is an error naming its rank.
//! - [`tcp`]: [`TcpAllReduceGroup`], for ranks on several hosts: a star
//!   through a [`TcpAllReduceHub`] in the executor process, which sums in
//!   the same rank order (bit-identical to the shared-memory group); a rank
//!   hanging up makes the hub close every connection, so all ranks fail at
//!   once.
//! - [`TpGroup`]: either kind, as a worker holds it; attached from a
//!   [`GroupHandle`] in the worker's bootstrap.

pub mod all_reduce;
pub mod tcp;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_tcp;

use serde::{Deserialize, Serialize};

pub use all_reduce::{
    AllReduceError, AllReduceGroup, AllReduceHandle, AllReduceOwner, DEFAULT_SLOT_FLOATS,
};
pub use tcp::{TcpAllReduceGroup, TcpAllReduceHandle, TcpAllReduceHub, TCP_CHUNK_FLOATS};

/// How a rank reaches its tensor-parallel group; travels in the worker
/// bootstrap.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupHandle {
    /// A shared-memory segment (every rank on this machine).
    Shm(AllReduceHandle),
    /// A TCP hub (ranks on several hosts).
    Tcp(TcpAllReduceHandle),
}

impl GroupHandle {
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self {
            GroupHandle::Shm(h) => h.world_size,
            GroupHandle::Tcp(h) => h.world_size,
        }
    }
}

/// One rank's end of a tensor-parallel group, of either kind. `Sync`: a
/// rank's calls are serialised internally.
pub enum TpGroup {
    /// Over shared memory.
    Shm(AllReduceGroup),
    /// Over TCP, through the hub.
    Tcp(TcpAllReduceGroup),
}

impl TpGroup {
    /// Attaches to (or connects to) the group `handle` names, as `rank`.
    pub fn attach(handle: &GroupHandle, rank: usize) -> Result<TpGroup, AllReduceError> {
        Ok(match handle {
            GroupHandle::Shm(h) => TpGroup::Shm(AllReduceGroup::attach(h, rank)?),
            GroupHandle::Tcp(h) => TpGroup::Tcp(TcpAllReduceGroup::connect(h, rank)?),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        match self {
            TpGroup::Shm(g) => g.rank(),
            TpGroup::Tcp(g) => g.rank(),
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        match self {
            TpGroup::Shm(g) => g.world_size(),
            TpGroup::Tcp(g) => g.world_size(),
        }
    }

    /// Replaces `data` with the element-wise sum of every rank's `data`,
    /// summed in rank order (bit-identical on every rank, and between the
    /// two kinds). Every rank must call it with the same length, in the
    /// same order.
    pub fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), AllReduceError> {
        match self {
            TpGroup::Shm(g) => g.all_reduce_sum(data),
            TpGroup::Tcp(g) => g.all_reduce_sum(data),
        }
    }
}

impl From<AllReduceGroup> for TpGroup {
    fn from(g: AllReduceGroup) -> TpGroup {
        TpGroup::Shm(g)
    }
}

impl From<TcpAllReduceGroup> for TpGroup {
    fn from(g: TcpAllReduceGroup) -> TpGroup {
        TpGroup::Tcp(g)
    }
}
