//! The queue's error type: every failure names the party at fault and a fix.

use std::time::Duration;

/// The state of one reader, as reported when the writer cannot make progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderLag {
    /// The reader's rank.
    pub rank: usize,
    /// The reader's process id, or `None` if it never attached.
    pub pid: Option<u32>,
    /// Whether that process is still running.
    pub alive: bool,
}

impl std::fmt::Display for ReaderLag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            None => write!(f, "reader {} (never attached)", self.rank),
            Some(pid) if self.alive => {
                write!(f, "reader {} (pid {pid}, alive but slow)", self.rank)
            }
            Some(pid) => write!(f, "reader {} (pid {pid}, dead)", self.rank),
        }
    }
}

/// Formats a list of lagging readers for an error message.
fn list(lags: &[ReaderLag]) -> String {
    lags.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The writer's state in a [`QueueError::Timeout`] message.
fn writer_state(pid: u32) -> String {
    if pid == 0 {
        "the writer has not yet accepted this reader's TCP connection; has it called wait_until_ready?".into()
    } else {
        format!("the writer, pid {pid}, is alive but sent nothing")
    }
}

/// The refused connections in a [`QueueError::NotReady`] message.
fn refused(rejected: &[String]) -> String {
    if rejected.is_empty() {
        String::new()
    } else {
        format!(
            " The writer refused these TCP connections: {}",
            rejected.join("; ")
        )
    }
}

/// Errors of [`super::MessageQueue`] and its message encoding.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// A configuration value is out of range.
    #[error("invalid message queue config: {0}")]
    InvalidConfig(String),
    /// Creating, opening or mapping a shared-memory segment failed.
    #[error("shared memory segment '{name}': {what} failed: {detail} (is /dev/shm mounted and large enough? in a container use --shm-size or --ipc=host)")]
    Shm {
        /// The segment's name.
        name: String,
        /// The operation that failed.
        what: &'static str,
        /// The operating system's description.
        detail: String,
    },
    /// A value read from shared memory (or from the handle that describes
    /// it) is impossible: another process wrote garbage. The queue never
    /// trusts such a value; this error says which field held what.
    #[error("message queue `{queue}` is corrupt: {what}")]
    Corrupt {
        /// The queue's segment name.
        queue: String,
        /// The field, the value it held, what was allowed, and the party at fault.
        what: String,
    },
    /// The ring stayed full for the whole timeout.
    #[error("enqueue of message {seq} timed out after {waited:?}: all {chunks} chunks are full because {} has not read message {oldest}; raise the timeout or find out why that reader is stuck", list(.behind))]
    Full {
        /// The message that could not be written.
        seq: u64,
        /// How long the writer waited.
        waited: Duration,
        /// The ring's chunk count.
        chunks: usize,
        /// The oldest unread message, which blocks the chunk.
        oldest: u64,
        /// The readers that have not read it.
        behind: Vec<ReaderLag>,
    },
    /// No message arrived within the timeout.
    #[error("dequeue by reader {rank} timed out after {waited:?} waiting for message {seq} ({})", writer_state(*.writer_pid))]
    Timeout {
        /// The waiting reader's rank.
        rank: usize,
        /// The message it waited for.
        seq: u64,
        /// How long it waited.
        waited: Duration,
        /// The writer's process id; 0 while a TCP reader has not yet been
        /// accepted (the writer's pid arrives in its welcome).
        writer_pid: u32,
    },
    /// Not every reader attached within the timeout.
    #[error(
        "readers {missing:?} did not attach within {waited:?}; did their processes start and call create_from_handle?{}", refused(.rejected)
    )]
    NotReady {
        /// The ranks still missing.
        missing: Vec<usize>,
        /// How long the writer waited.
        waited: Duration,
        /// TCP connections the writer refused while it waited, each as
        /// "peer address: reason" (a wrong rank, version or magic); at most
        /// a few, so a flood of bad connections cannot grow the error.
        rejected: Vec<String>,
    },
    /// The queue was shut down and no message is left to read.
    #[error("the message queue was shut down")]
    Shutdown,
    /// The writer's process exited without shutting the queue down.
    #[error("the writer process (pid {pid}) died; no more messages will arrive")]
    WriterDead {
        /// The writer's process id.
        pid: u32,
    },
    /// A remote reader's TCP connection failed: the peer closed or reset
    /// it, a send or a frame could not complete, or it never connected.
    /// `peer` is the other end's address and `rank` the reader's rank, on
    /// either side; `detail` says which side saw what. Treat it like the
    /// death of that process.
    #[error("the TCP connection between the writer and reader rank {rank} was lost (peer {peer}): {detail}")]
    ConnectionLost {
        /// The address of the other end (the reader's, as the writer sees
        /// it; the writer's, as a reader sees it).
        peer: String,
        /// The reader's rank.
        rank: usize,
        /// What failed, and from which side.
        detail: String,
    },
    /// The operation does not fit this end of the queue.
    #[error("{0}")]
    WrongRole(&'static str),
    /// The rank is not a reader of this queue.
    #[error("rank {rank} is not a reader of this queue (local reader ranks: {local:?})")]
    BadRank {
        /// The rank asked for.
        rank: usize,
        /// The ranks that read from shared memory.
        local: Vec<usize>,
    },
    /// The rank has already attached.
    #[error("reader rank {rank} is already attached (by pid {pid}); each rank attaches once")]
    AlreadyAttached {
        /// The rank asked for.
        rank: usize,
        /// The process that holds it.
        pid: u32,
    },
    /// The handle asks for something this build cannot do.
    #[error("unsupported handle: {0}")]
    Unsupported(String),
    /// A message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// A frame could not be decoded (corrupted, truncated or of another type).
    #[error("cannot decode message frame of {len} bytes: {detail}")]
    Decode {
        /// The frame's length.
        len: usize,
        /// What the decoder found wrong.
        detail: String,
    },
}

impl QueueError {
    /// Whether the other end is gone for good: the queue was shut down, its
    /// writer's process died, or (a remote end) the connection was lost.
    /// A reader that sees this has read everything there will be.
    pub fn other_end_gone(&self) -> bool {
        matches!(
            self,
            QueueError::Shutdown
                | QueueError::WriterDead { .. }
                | QueueError::ConnectionLost { .. }
        )
    }
}
