//! The serialisable description of a queue that lets another process attach.

use serde::{Deserialize, Serialize};

/// Everything a reader needs to attach to a queue, in the shape of vLLM's
/// `Handle`: the ranks in `local_reader_ranks` attach to the shared segment;
/// every other rank below `n_readers` connects over TCP to `remote_addr`
/// (see `tcp/`). Send it to the reader processes in any serde format
/// (JSON on a pipe, an environment variable, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handle {
    /// Layout version; a reader refuses a handle of another version.
    pub version: u32,
    /// Total number of readers.
    pub n_readers: usize,
    /// The ranks that read from the shared segment, in flag order (a rank's
    /// read-flag slot is its index here); any subset of `0..n_readers`.
    pub local_reader_ranks: Vec<usize>,
    /// The shared segment, if any rank is local.
    pub shm: Option<ShmHandle>,
    /// The writer's TCP listener, `"ip:port"`, if any rank is remote.
    pub remote_addr: Option<String>,
}

/// The shared segment's name and geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmHandle {
    /// POSIX shared-memory name (starts with `/`).
    pub name: String,
    /// Number of chunks in the ring.
    pub n_chunks: usize,
    /// Payload capacity of each chunk.
    pub max_chunk_bytes: usize,
    /// The writer's pid.
    pub owner_pid: u32,
    /// The writer's start time, which tells a reused pid apart.
    pub owner_start_time: u64,
}

/// The current handle version (2: ranks outside `local_reader_ranks`
/// connect to `remote_addr` over TCP). The TCP hello carries it too, so a
/// reader and a writer of different builds refuse each other.
pub const HANDLE_VERSION: u32 = 2;
