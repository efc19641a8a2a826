//! A reader's side of the TCP transport: connecting to the writer, saying
//! hello, and reading frames, each checked against its kind's bounds.

use std::cell::{Cell, RefCell};
use std::io::{self, ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::{
    keep_alive, set_timeout, time_left, write_all_by, CONTROL_TIMEOUT, GROW_STEP, HEADER_LEN,
    HELLO_LEN, HELLO_MAGIC, KEEP_CAPACITY, KIND_MESSAGE, KIND_REJECT, KIND_SHUTDOWN, KIND_WELCOME,
    MAX_FRAME_BYTES, MAX_REASON_BYTES,
};
use crate::message_queue::error::QueueError;
use crate::message_queue::handle::HANDLE_VERSION;
use crate::message_queue::net::connect_retrying;

/// How long a reader keeps trying to connect: the writer may still be
/// binding, or its host still starting.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

/// A reader's side: one connection to the writer.
pub struct TcpReader {
    stream: TcpStream,
    writer: SocketAddr,
    rank: usize,
    /// The frame being read; kept across a timeout so that reading resumes.
    incoming: RefCell<Incoming>,
    /// From the writer's welcome; `None` until it arrived.
    writer_pid: Cell<Option<u32>>,
    /// The next message's number.
    next: Cell<u64>,
    /// Why the stream ended, once it did: every later dequeue says so again.
    ended: RefCell<Option<Ended>>,
    /// The read timeout the socket has (see `set_timeout`).
    read_timeout: Cell<Option<Option<Duration>>>,
}

/// A partly read frame.
#[derive(Default)]
struct Incoming {
    header: [u8; HEADER_LEN],
    /// Header bytes read.
    have: usize,
    /// The payload length, once the header is complete and checked.
    len: Option<usize>,
    /// Payload bytes read into `body`.
    filled: usize,
    /// The payload buffer, reused between frames; only `..len` is the frame.
    body: Vec<u8>,
}

impl Incoming {
    /// Forgets the frame just consumed.
    fn reset(&mut self) {
        self.have = 0;
        self.len = None;
        self.filled = 0;
        if self.body.capacity() > KEEP_CAPACITY {
            self.body = Vec::new();
        }
    }

    /// Where in the stream a connection ended, for the error message.
    fn position(&self) -> String {
        match self.len {
            _ if self.have == 0 => "between frames".into(),
            None => format!("mid-frame ({} of {HEADER_LEN} header bytes)", self.have),
            Some(len) => format!("mid-frame ({} of {len} payload bytes)", self.filled),
        }
    }
}

/// How a reader's stream ended.
#[derive(Clone)]
enum Ended {
    Shutdown,
    Lost(String),
    Corrupt(String),
}

/// Why a read stopped.
enum Stall {
    TimedOut,
    Closed,
    Failed(io::Error),
    Bad(String),
}

impl TcpReader {
    /// Connects reader `rank` to the writer at `remote_addr` (from a handle,
    /// so distrusted) and says hello, retrying refused or failed connects
    /// until [`CONNECT_DEADLINE`].
    pub fn connect(remote_addr: &str, rank: usize) -> Result<TcpReader, QueueError> {
        let writer = remote_addr
            .parse::<SocketAddr>()
            .ok()
            .filter(|a| a.port() != 0)
            .ok_or_else(|| QueueError::Corrupt {
                queue: format!("tcp://{remote_addr}"),
                what: format!(
                    "the handle's remote_addr {remote_addr:?} is not an ip:port address; the \
                     handle was damaged or made by another build"
                ),
            })?;
        let lost = |detail: String| QueueError::ConnectionLost {
            peer: writer.to_string(),
            rank,
            detail,
        };
        let stream = connect_retrying(writer, CONNECT_DEADLINE).map_err(|e| {
            lost(format!(
                "reader rank {rank} could not connect to the writer within \
                 {CONNECT_DEADLINE:?}: {e}; is the writer running, and reachable from \
                 this host?"
            ))
        })?;
        let mut hello = [0; HELLO_LEN];
        hello[..8].copy_from_slice(&HELLO_MAGIC);
        hello[8..12].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        hello[12..].copy_from_slice(&(rank as u64).to_le_bytes());
        let mut cache = None;
        stream
            .set_nodelay(true)
            .and_then(|()| {
                let deadline = Instant::now() + CONTROL_TIMEOUT;
                write_all_by(&stream, &hello, Some(deadline), &mut cache)
            })
            .map_err(|e| lost(format!("sending reader rank {rank}'s hello failed: {e}")))?;
        keep_alive(&stream);
        Ok(TcpReader {
            stream,
            writer,
            rank,
            incoming: RefCell::new(Incoming::default()),
            writer_pid: Cell::new(None),
            next: Cell::new(0),
            ended: RefCell::new(None),
            read_timeout: Cell::new(None),
        })
    }

    /// This reader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Receives the next message and passes its bytes (the reader's frame
    /// buffer) to `f`. Skips the writer's welcome; a timeout keeps a partly
    /// read frame, and the next call resumes it.
    pub fn dequeue_with<R>(
        &self,
        timeout: Option<Duration>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, QueueError> {
        if let Some(end) = self.ended.borrow().clone() {
            return Err(self.error(end));
        }
        let started = Instant::now();
        let deadline = timeout.and_then(|t| started.checked_add(t));
        let mut inc = self.incoming.borrow_mut();
        loop {
            let (kind, len) = match self.read_frame(&mut inc, deadline) {
                Ok(frame) => frame,
                Err(Stall::TimedOut) => {
                    return Err(QueueError::Timeout {
                        rank: self.rank,
                        seq: self.next.get(),
                        waited: started.elapsed(),
                        writer_pid: self.writer_pid.get().unwrap_or(0),
                    })
                }
                Err(Stall::Closed) => {
                    return Err(self.end(Ended::Lost(format!(
                        "the writer closed the connection {} without shutting the queue down: \
                         it died, or dropped the queue while panicking",
                        inc.position()
                    ))))
                }
                Err(Stall::Failed(e)) => {
                    return Err(self.end(Ended::Lost(format!(
                        "reading from the writer failed {}: {e}",
                        inc.position()
                    ))))
                }
                Err(Stall::Bad(what)) => return Err(self.end(Ended::Corrupt(what))),
            };
            let body = &inc.body[..len];
            let welcomed = self.writer_pid.get().is_some();
            match kind {
                KIND_MESSAGE if welcomed => {
                    let out = f(body);
                    inc.reset();
                    self.next.set(self.next.get() + 1);
                    return Ok(out);
                }
                KIND_SHUTDOWN if welcomed => return Err(self.end(Ended::Shutdown)),
                KIND_WELCOME if !welcomed => {
                    // The length was checked to be 4.
                    let pid = u32::from_le_bytes(body.try_into().unwrap_or_default());
                    if pid == 0 {
                        return Err(self.end(Ended::Corrupt(
                            "the writer's welcome names pid 0, which no process has".into(),
                        )));
                    }
                    self.writer_pid.set(Some(pid));
                    inc.reset();
                }
                KIND_REJECT => {
                    let reason = String::from_utf8_lossy(body).into_owned();
                    return Err(self.end(Ended::Lost(format!(
                        "the writer refused reader rank {}: {reason}",
                        self.rank
                    ))));
                }
                _ => {
                    let what = if welcomed {
                        format!("a second welcome frame (kind {kind}) arrived")
                    } else {
                        format!("a frame of kind {kind} arrived before the writer's welcome")
                    };
                    return Err(self.end(Ended::Corrupt(what)));
                }
            }
        }
    }

    /// Reads the rest of the current frame: its header, checked, then its
    /// payload into `inc.body`. Returns the kind and payload length.
    fn read_frame(
        &self,
        inc: &mut Incoming,
        deadline: Option<Instant>,
    ) -> Result<(u8, usize), Stall> {
        while inc.have < HEADER_LEN {
            let have = inc.have;
            inc.have += self.read_some(&mut inc.header[have..], deadline)?;
        }
        let kind = inc.header[0];
        let len = match inc.len {
            Some(len) => len,
            None => {
                let claimed = u64::from_le_bytes(inc.header[1..].try_into().expect("8 bytes"));
                let (fits, allowed) = match kind {
                    KIND_MESSAGE => (
                        claimed <= MAX_FRAME_BYTES,
                        format!("at most {MAX_FRAME_BYTES}"),
                    ),
                    KIND_SHUTDOWN => (claimed == 0, "0".to_string()),
                    KIND_WELCOME => (claimed == 4, "4".to_string()),
                    KIND_REJECT => (
                        claimed <= MAX_REASON_BYTES as u64,
                        format!("at most {MAX_REASON_BYTES}"),
                    ),
                    _ => {
                        return Err(Stall::Bad(format!(
                            "frame kind {kind} is none of message ({KIND_MESSAGE}), shutdown \
                             ({KIND_SHUTDOWN}), welcome ({KIND_WELCOME}) or reject ({KIND_REJECT})"
                        )))
                    }
                };
                let len = usize::try_from(claimed)
                    .ok()
                    .filter(|_| fits)
                    .ok_or_else(|| {
                        Stall::Bad(format!(
                        "frame length {claimed} for kind {kind}, where {allowed} bytes are allowed"
                    ))
                    })?;
                inc.len = Some(len);
                len
            }
        };
        while inc.filled < len {
            if inc.body.len() <= inc.filled {
                // At most double what arrived (or one step): the claimed
                // length is only trusted as far as the bytes bear it out.
                let grown = len.min(inc.filled + inc.filled.max(GROW_STEP));
                inc.body.reserve_exact(grown - inc.body.len());
                inc.body.resize(grown, 0);
            }
            let (from, to) = (inc.filled, inc.body.len().min(len));
            inc.filled += self.read_some(&mut inc.body[from..to], deadline)?;
        }
        Ok((kind, len))
    }

    /// Reads at least one byte into `buf` by `deadline` (`None`: blocks).
    fn read_some(&self, buf: &mut [u8], deadline: Option<Instant>) -> Result<usize, Stall> {
        loop {
            let left = time_left(deadline).map_err(|_| Stall::TimedOut)?;
            let mut cache = self.read_timeout.get();
            set_timeout(&mut cache, left, |t| self.stream.set_read_timeout(t))
                .map_err(Stall::Failed)?;
            self.read_timeout.set(cache);
            match (&self.stream).read(buf) {
                Ok(0) => return Err(Stall::Closed),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // The socket timeout expired; `time_left` ends the loop.
                Err(e)
                    if deadline.is_some()
                        && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => return Err(Stall::Failed(e)),
            }
        }
    }

    /// Stops this reader: later dequeues return [`QueueError::Shutdown`];
    /// the writer's next sends to it fail.
    pub fn shutdown(&self) {
        let mut ended = self.ended.borrow_mut();
        if ended.is_none() {
            *ended = Some(Ended::Shutdown);
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }

    /// Records how the stream ended (a broken stream is closed, so that
    /// the writer notices) and returns the error.
    fn end(&self, end: Ended) -> QueueError {
        if !matches!(end, Ended::Shutdown) {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        *self.ended.borrow_mut() = Some(end.clone());
        self.error(end)
    }

    /// The error that tells the caller how the stream ended.
    fn error(&self, end: Ended) -> QueueError {
        match end {
            Ended::Shutdown => QueueError::Shutdown,
            Ended::Lost(detail) => QueueError::ConnectionLost {
                peer: self.writer.to_string(),
                rank: self.rank,
                detail,
            },
            Ended::Corrupt(what) => QueueError::Corrupt {
                queue: format!("tcp://{}", self.writer),
                what: format!(
                    "{what}; the writer is broken or hostile, or another program listens at {}",
                    self.writer
                ),
            },
        }
    }
}
