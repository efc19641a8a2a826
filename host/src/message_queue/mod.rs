//! The shared-memory broadcast queue between the engine and its workers
//! (vLLM's `shm_broadcast.MessageQueue`): one writer, N readers, a ring of
//! chunks in one POSIX shared-memory segment for the readers on this host,
//! and a TCP connection each for readers on other hosts.
//!
//! - **Ring protocol** (`queue.rs`): each chunk has a written flag (a
//!   sequence number) and one read flag per reader, atomics with
//!   Release/Acquire ordering; `model.rs` checks it over every interleaving.
//! - **Large messages** take an overflow segment of their own, written once
//!   in place; the ring slot still carries their turn, so order holds.
//! - **Waiting** (`wait.rs`): spin with `sched_yield` for
//!   [`QueueConfig::spin_window`], then sleep on a futex in the segment.
//!   Shutdown and the death of a peer wake or stop every waiter.
//! - **Lifetime** (`process.rs`): the segment's name is unlinked as soon as
//!   every reader has attached (after that the kernel frees the memory when
//!   the last process exits, whatever the cause). Until then, names carry
//!   their owner's pid and start time, so a reader that finds the owner dead
//!   and every new writer unlink the segments of dead owners.
//! - **Remote readers** (`tcp/`, routed by `endpoint.rs`): the writer
//!   listens, each remote rank connects and says hello (magic, version,
//!   rank), and gets every message as a length-prefixed frame; a lost
//!   connection is [`QueueError::ConnectionLost`] naming the peer and rank.
//!   [`MessageQueue::new_writer_with_remote`] picks the remote ranks.
//! - **Encoding** (`codec.rs`): serde over postcard.
//! - **Distrust**: every length, kind, sequence number, pid and size read
//!   from shared memory, a socket or a handle is checked before use; a bad one is
//!   [`QueueError::Corrupt`] naming the queue and the field, never a panic,
//!   an out-of-bounds read or a hang (`tests_corrupt.rs` tries each field).
//!
//! ```no_run
//! use host::message_queue::{MessageQueue, QueueConfig};
//! use std::time::Duration;
//! let writer = MessageQueue::new_writer(1, QueueConfig::default())?;
//! let handle = writer.export_handle(); // send to the reader process
//! let reader = MessageQueue::create_from_handle(&handle, 0)?;
//! writer.wait_until_ready(Duration::from_secs(10))?;
//! writer.enqueue(&("execute_model", 42u32), None)?;
//! let (method, step): (String, u32) = reader.dequeue(Some(Duration::from_secs(1)))?;
//! # Ok::<(), host::message_queue::QueueError>(())
//! ```

mod codec;
mod endpoint;
mod error;
mod handle;
mod layout;
#[cfg(test)]
mod model;
pub(crate) mod net;
pub(crate) mod process;
mod queue;
mod tcp;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_corrupt;
#[cfg(test)]
mod tests_tcp;
pub(crate) mod wait;

use std::time::Duration;

pub use codec::{decode, encode, encoded_len};
pub use endpoint::MessageQueue;
pub use error::{QueueError, ReaderLag};
pub use handle::{Handle, ShmHandle, HANDLE_VERSION};
pub use layout::MAX_READERS;
pub use process::{shm_names, sweep_dead_owners, NAME_PREFIX};

/// How long a waiting party spins (yielding) before it sleeps on the futex.
/// Measured with `cargo bench -p host --bench message_queue` on the 2-core
/// VM: a futex wake-up costs 17–47 µs (p50), a spinning reader answers in
/// 0.7 µs. Spinning for about 4–5 wake-ups' worth bounds the cost of a wrong
/// guess (ski rental), keeps back-to-back traffic at microsecond latency and
/// lets an idle party sleep within 0.2 ms (a blocked reader then uses 0.15%
/// of a core). A wait also sleeps early when its yields show the core is
/// contended (see `wait.rs`).
pub const DEFAULT_SPIN_WINDOW: Duration = Duration::from_micros(200);

/// Shape of a queue's ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Number of chunks (messages in flight before the writer waits).
    pub n_chunks: usize,
    /// Payload capacity of a chunk; larger messages go to an overflow
    /// segment. /dev/shm pages are only used once written, so a generous
    /// capacity costs address space, not memory.
    pub max_chunk_bytes: usize,
    /// See [`DEFAULT_SPIN_WINDOW`].
    pub spin_window: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            n_chunks: 8,
            max_chunk_bytes: 4 << 20,
            spin_window: DEFAULT_SPIN_WINDOW,
        }
    }
}

impl QueueConfig {
    fn validate(&self) -> Result<(), QueueError> {
        if !(1..=layout::MAX_CHUNKS).contains(&self.n_chunks) {
            return Err(QueueError::InvalidConfig(format!(
                "n_chunks = {}; use 1..={}",
                self.n_chunks,
                layout::MAX_CHUNKS
            )));
        }
        if !(1..=layout::MAX_CHUNK_BYTES).contains(&self.max_chunk_bytes) {
            return Err(QueueError::InvalidConfig(format!(
                "max_chunk_bytes = {}; use 1..=1 GiB (larger messages overflow automatically)",
                self.max_chunk_bytes
            )));
        }
        Ok(())
    }
}
