//! [`MessageQueue`], one end of a broadcast queue: it routes each message
//! to the shared-memory ring for the readers on this host (`queue.rs`) and
//! as a TCP frame to the readers on other hosts (`tcp/`), as vLLM's
//! shm_broadcast `MessageQueue` does with its local and remote readers.
//!
//! The writer publishes to the ring first, then sends to the TCP readers:
//! a full ring fails the enqueue before any reader sees the message, and
//! the local readers never wait on the network.

use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::codec;
use super::error::QueueError;
use super::handle::{Handle, HANDLE_VERSION};
use super::layout::MAX_READERS;
use super::queue::ShmQueue;
use super::tcp::{TcpReader, TcpWriter};
use super::QueueConfig;

/// One end of a broadcast queue: the single writer, or one of its readers.
/// Every message the writer enqueues reaches every reader once, in order;
/// readers on this host read it from shared memory, remote readers over
/// TCP. `Send` but not `Sync`: each end belongs to one thread at a time.
pub struct MessageQueue {
    end: End,
}

/// What this end is, with the transports it uses.
enum End {
    Writer {
        n_readers: usize,
        /// The ring, if any reader is local.
        shm: Option<ShmQueue>,
        /// The listener and connections, if any reader is remote.
        tcp: Option<TcpWriter>,
    },
    ShmReader {
        shm: ShmQueue,
        handle: Handle,
    },
    TcpReader {
        tcp: TcpReader,
        handle: Handle,
    },
}

/// `timeout` from now, or `None` for no deadline (also when it overflows).
fn deadline_after(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

impl MessageQueue {
    /// Creates a queue whose `n_readers` readers all attach through shared
    /// memory, and returns its writer end. Also unlinks segments left in
    /// `/dev/shm` by queue owners that died.
    pub fn new_writer(n_readers: usize, config: QueueConfig) -> Result<MessageQueue, QueueError> {
        Self::new_writer_with_remote(n_readers, &[], "", config)
    }

    /// A writer whose readers are ranks `0..n_readers`; the ranks in
    /// `remote_ranks` attach over TCP to a listener bound at `bind` (`"host"`
    /// or `"host:port"`; without a port, or port 0, the OS picks one), the
    /// others through shared memory. With `remote_ranks` empty this is
    /// [`MessageQueue::new_writer`] (and `bind` is ignored); with every rank
    /// remote there is no shared segment at all (`handle.shm == None`).
    /// Bind to an address the remote hosts reach: the handle carries the
    /// listener's bound address as it is.
    pub fn new_writer_with_remote(
        n_readers: usize,
        remote_ranks: &[usize],
        bind: &str,
        config: QueueConfig,
    ) -> Result<MessageQueue, QueueError> {
        config.validate()?;
        if n_readers == 0 || n_readers > MAX_READERS {
            return Err(QueueError::InvalidConfig(format!(
                "n_readers = {n_readers}; use 1..={MAX_READERS}"
            )));
        }
        let mut remote = remote_ranks.to_vec();
        remote.sort_unstable();
        if let Some(&rank) = remote.iter().find(|&&r| r >= n_readers) {
            return Err(QueueError::InvalidConfig(format!(
                "remote rank {rank} is not a reader rank (0..{n_readers})"
            )));
        }
        if let Some(pair) = remote.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(QueueError::InvalidConfig(format!(
                "remote rank {} is listed twice",
                pair[0]
            )));
        }
        let local: Vec<usize> = (0..n_readers)
            .filter(|r| remote.binary_search(r).is_err())
            .collect();
        let tcp = if remote.is_empty() {
            None
        } else {
            Some(TcpWriter::bind(bind, n_readers, remote)?)
        };
        let shm = if local.is_empty() {
            None
        } else {
            Some(ShmQueue::new_writer(local, config)?)
        };
        Ok(MessageQueue {
            end: End::Writer {
                n_readers,
                shm,
                tcp,
            },
        })
    }

    /// The handle that readers pass to [`MessageQueue::create_from_handle`]
    /// (a reader returns the handle it attached with).
    pub fn export_handle(&self) -> Handle {
        match &self.end {
            End::Writer {
                n_readers,
                shm,
                tcp,
            } => Handle {
                version: HANDLE_VERSION,
                n_readers: *n_readers,
                local_reader_ranks: shm.as_ref().map_or(Vec::new(), |s| s.ranks().to_vec()),
                shm: shm.as_ref().map(ShmQueue::shm_handle),
                remote_addr: tcp.as_ref().map(|t| t.addr().to_string()),
            },
            End::ShmReader { handle, .. } | End::TcpReader { handle, .. } => handle.clone(),
        }
    }

    /// Attaches reader `rank` to the queue that `handle` describes: a rank
    /// in `local_reader_ranks` maps the shared segment (each attaches once;
    /// the last one unlinks the segment's name, so the kernel frees it when
    /// the last process exits, even on a crash); any other rank below
    /// `n_readers` connects to `remote_addr` and says hello, retrying for
    /// a few seconds while the writer is not listening yet.
    pub fn create_from_handle(handle: &Handle, rank: usize) -> Result<MessageQueue, QueueError> {
        if handle.version != HANDLE_VERSION {
            return Err(QueueError::Unsupported(format!(
                "handle version {} (this build reads version {HANDLE_VERSION})",
                handle.version
            )));
        }
        let end = if handle.local_reader_ranks.contains(&rank) {
            End::ShmReader {
                shm: ShmQueue::create_from_handle(handle, rank)?,
                handle: handle.clone(),
            }
        } else {
            match &handle.remote_addr {
                Some(addr) if rank < handle.n_readers => End::TcpReader {
                    tcp: TcpReader::connect(addr, rank)?,
                    handle: handle.clone(),
                },
                _ => {
                    return Err(QueueError::BadRank {
                        rank,
                        local: handle.local_reader_ranks.clone(),
                    })
                }
            }
        };
        Ok(MessageQueue { end })
    }

    /// Sets how long a shared-memory wait spins (yielding) before it sleeps
    /// on the futex. A TCP reader blocks in the kernel instead; for it this
    /// does nothing.
    pub fn set_spin_window(&mut self, window: Duration) {
        match &mut self.end {
            End::Writer { shm: Some(shm), .. } | End::ShmReader { shm, .. } => {
                shm.set_spin_window(window)
            }
            End::Writer { shm: None, .. } | End::TcpReader { .. } => {}
        }
    }

    /// The reader's rank, or `None` for the writer.
    pub fn rank(&self) -> Option<usize> {
        match &self.end {
            End::Writer { .. } => None,
            End::ShmReader { shm, .. } => shm.rank(),
            End::TcpReader { tcp, .. } => Some(tcp.rank()),
        }
    }

    /// Writer: waits until every reader has attached: the local ones to the
    /// segment (whose name then leaves `/dev/shm`), the remote ones by
    /// connecting with a valid hello. A connection with a bad hello (wrong
    /// magic, version or rank, a rank already connected, or no hello in
    /// time) is told why, dropped and named in the [`QueueError::NotReady`]
    /// that follows if a reader is still missing at the timeout. Readers
    /// return at once.
    pub fn wait_until_ready(&self, timeout: Duration) -> Result<(), QueueError> {
        let End::Writer { shm, tcp, .. } = &self.end else {
            return Ok(());
        };
        let started = Instant::now();
        if let Some(tcp) = tcp {
            match tcp.accept(timeout) {
                Ok(()) => {}
                Err(QueueError::NotReady {
                    mut missing,
                    rejected,
                    ..
                }) => {
                    // Name the local readers that are missing too.
                    if let Some(Err(QueueError::NotReady { missing: m, .. })) =
                        shm.as_ref().map(|s| s.wait_until_ready(Duration::ZERO))
                    {
                        missing.extend(m);
                    }
                    missing.sort_unstable();
                    return Err(QueueError::NotReady {
                        missing,
                        waited: started.elapsed(),
                        rejected,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        match shm {
            Some(shm) => shm
                .wait_until_ready(timeout.saturating_sub(started.elapsed()))
                .map_err(|e| match e {
                    QueueError::NotReady {
                        missing, rejected, ..
                    } => QueueError::NotReady {
                        missing,
                        waited: started.elapsed(),
                        rejected,
                    },
                    e => e,
                }),
            None => Ok(()),
        }
    }

    /// The writer's parts, or `WrongRole` on a reader.
    fn writer(&self) -> Result<(Option<&ShmQueue>, Option<&TcpWriter>), QueueError> {
        match &self.end {
            End::Writer { shm, tcp, .. } => Ok((shm.as_ref(), tcp.as_ref())),
            _ => Err(QueueError::WrongRole(
                "enqueue called on a reader end of a message queue",
            )),
        }
    }

    /// Sends a message of `len` bytes that `fill` writes in place: into the
    /// ring, or into an overflow segment if `len` exceeds a chunk, and from
    /// there to the TCP readers; with no local reader, into the TCP frame.
    /// The payload is written exactly once. `timeout = None` waits for space
    /// (and for the TCP sends) for as long as the readers live; a TCP reader
    /// that cannot take the message within the timeout is cut off
    /// ([`QueueError::ConnectionLost`], after the others got the message).
    pub fn enqueue_with(
        &self,
        len: usize,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), QueueError> {
        let deadline = deadline_after(timeout);
        match self.writer()? {
            (Some(shm), None) => shm.enqueue_with(len, timeout, fill, |_| Ok(())),
            (Some(shm), Some(tcp)) => {
                tcp.check(Some(len))?;
                shm.enqueue_with(len, timeout, fill, |bytes| tcp.send(bytes, deadline))
            }
            (None, Some(tcp)) => {
                tcp.check(Some(len))?;
                tcp.send_with(len, deadline, |buf| {
                    fill(buf);
                    Ok(())
                })
            }
            (None, None) => Err(QueueError::WrongRole("a message queue without readers")),
        }
    }

    /// Sends raw bytes.
    pub fn enqueue_bytes(&self, msg: &[u8], timeout: Option<Duration>) -> Result<(), QueueError> {
        self.enqueue_with(msg.len(), timeout, |buf| buf.copy_from_slice(msg))
    }

    /// Sends a serde value, encoded straight into the ring (one pass) or,
    /// when it does not fit a chunk, sized and encoded into an overflow
    /// segment (with no local reader: into the TCP frame); TCP readers get
    /// the same bytes. Timeouts as in [`MessageQueue::enqueue_with`].
    pub fn enqueue<T: Serialize + ?Sized>(
        &self,
        msg: &T,
        timeout: Option<Duration>,
    ) -> Result<(), QueueError> {
        let deadline = deadline_after(timeout);
        match self.writer()? {
            (Some(shm), None) => shm.enqueue(msg, timeout, |_| Ok(())),
            (Some(shm), Some(tcp)) => {
                tcp.check(None)?;
                shm.enqueue(msg, timeout, |bytes| tcp.send(bytes, deadline))
            }
            (None, Some(tcp)) => {
                tcp.check(None)?;
                let len = codec::encoded_len(msg)?;
                tcp.send_with(len, deadline, |buf| match codec::encode_into(msg, buf)? {
                    Some(n) if n == len => Ok(()),
                    _ => Err(QueueError::Encode(
                        "the value serialised to a different length on the second pass".into(),
                    )),
                })
            }
            (None, None) => Err(QueueError::WrongRole("a message queue without readers")),
        }
    }

    /// Receives the next message and passes its bytes to `f`: in place in
    /// shared memory (the chunk is released when `f` returns), or the TCP
    /// frame as received.
    pub fn dequeue_with<R>(
        &self,
        timeout: Option<Duration>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, QueueError> {
        match &self.end {
            End::ShmReader { shm, .. } => shm.dequeue_with(timeout, f),
            End::TcpReader { tcp, .. } => tcp.dequeue_with(timeout, f),
            End::Writer { .. } => Err(QueueError::WrongRole(
                "dequeue called on the writer end of a message queue",
            )),
        }
    }

    /// Receives the next message as bytes.
    pub fn dequeue_bytes(&self, timeout: Option<Duration>) -> Result<Vec<u8>, QueueError> {
        self.dequeue_with(timeout, <[u8]>::to_vec)
    }

    /// Receives and decodes the next message. A frame that does not decode
    /// is consumed and reported as [`QueueError::Decode`].
    pub fn dequeue<T: DeserializeOwned>(&self, timeout: Option<Duration>) -> Result<T, QueueError> {
        self.dequeue_with(timeout, codec::decode)?
    }

    /// Shuts the queue down. The writer (also when dropped) ends it for
    /// every reader: they still receive the messages already sent, then
    /// [`QueueError::Shutdown`]; its enqueues fail. A local reader's shutdown
    /// stops the whole shared ring, as it always did; a TCP reader's only
    /// stops that reader (the writer's next sends to it fail).
    pub fn shutdown(&self) {
        match &self.end {
            End::Writer { shm, tcp, .. } => {
                if let Some(shm) = shm {
                    shm.shutdown();
                }
                if let Some(tcp) = tcp {
                    tcp.shutdown();
                }
            }
            End::ShmReader { shm, .. } => shm.shutdown(),
            End::TcpReader { tcp, .. } => tcp.shutdown(),
        }
    }
}

#[cfg(test)]
impl MessageQueue {
    /// The mapped segment, for tests that write into it as a hostile peer would.
    pub(super) fn segment(&self) -> &super::layout::Segment {
        match &self.end {
            End::Writer { shm: Some(s), .. } | End::ShmReader { shm: s, .. } => s.segment(),
            _ => panic!("this end has no shared segment"),
        }
    }
}
