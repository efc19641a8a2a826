//! The writer's side of the TCP transport: the listener, accepting and
//! checking each remote reader's hello, and sending frames to every
//! accepted reader.

use std::cell::{Cell, RefCell};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{
    header, keep_alive, resolve, write_all_by, CONTROL_TIMEOUT, HEADER_LEN, HELLO_LEN, HELLO_MAGIC,
    KEEP_CAPACITY, KIND_MESSAGE, KIND_REJECT, KIND_SHUTDOWN, KIND_WELCOME, MAX_FRAME_BYTES,
    MAX_REASON_BYTES,
};
use crate::message_queue::error::QueueError;
use crate::message_queue::handle::HANDLE_VERSION;
use crate::message_queue::layout::MAX_READERS;

/// Frames up to this size go out in one write (header and payload copied
/// together): with TCP_NODELAY two writes would cost two packets.
const COALESCE_BYTES: usize = 64 << 10;
/// How long an accepted connection may take to send its whole hello before
/// the writer drops it (a peer that sends nothing must not hold a slot).
const HELLO_DEADLINE: Duration = Duration::from_secs(2);
/// Connections waiting to say hello at once; more are refused, so a flood
/// cannot exhaust the writer's file descriptors.
const MAX_PENDING: usize = 2 * MAX_READERS;
/// Refused connections kept for [`QueueError::NotReady`]; the rest are counted.
const MAX_REJECTIONS: usize = 16;
/// The shortest time a send gets, even when the enqueue timeout was spent on
/// the shared-memory ring: a frame that fits the socket buffer then still goes.
const MIN_SEND_WAIT: Duration = Duration::from_millis(1);
/// How often the writer looks for new connections and hello bytes while it
/// waits (only during `wait_until_ready`, so a short poll costs nothing).
const ACCEPT_POLL: Duration = Duration::from_millis(1);

/// The writer's side: a listener until every remote reader has connected,
/// then one connection per remote rank.
pub struct TcpWriter {
    /// The listener's bound address, as exported in the handle.
    addr: SocketAddr,
    /// All readers, local and remote (ranks are below it).
    n_readers: usize,
    /// The ranks that connect over TCP, sorted.
    remote: Vec<usize>,
    /// Present until every remote rank has connected (or shutdown).
    acceptor: RefCell<Option<Acceptor>>,
    /// The accepted readers.
    conns: RefCell<Vec<Conn>>,
    /// The next message's number, for error messages.
    next: Cell<u64>,
    /// Set by `shutdown`.
    shut: Cell<bool>,
    /// Where small frames and `send_with` frames are assembled.
    scratch: RefCell<Vec<u8>>,
}

/// One accepted remote reader.
struct Conn {
    rank: usize,
    peer: SocketAddr,
    /// `None` once lost or shut down.
    stream: Option<TcpStream>,
    /// Why the connection was lost, once it was.
    lost: Option<String>,
    /// The write timeout the socket has (see `set_timeout`).
    write_timeout: Option<Option<Duration>>,
}

impl Conn {
    /// Records the loss and closes the socket, so that the reader sees the
    /// end at once instead of waiting on a cut frame.
    fn lose(&mut self, detail: String) -> QueueError {
        if let Some(stream) = self.stream.take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        self.lost = Some(detail.clone());
        self.lost_error(detail)
    }

    fn lost_error(&self, detail: String) -> QueueError {
        QueueError::ConnectionLost {
            peer: self.peer.to_string(),
            rank: self.rank,
            detail,
        }
    }
}

/// The listener and the connections that have not finished their hello.
struct Acceptor {
    listener: TcpListener,
    pending: Vec<Pending>,
    /// "peer: reason" for refused connections, at most `MAX_REJECTIONS`.
    rejected: Vec<String>,
    /// Refusals beyond `MAX_REJECTIONS`.
    more_rejected: usize,
}

/// An accepted connection whose hello is still arriving.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    hello: [u8; HELLO_LEN],
    have: usize,
}

/// What reading a pending hello found.
enum Hello {
    Waiting,
    Complete,
    Closed(String),
}

impl Pending {
    /// Reads what has arrived of the hello without blocking.
    fn read(&mut self) -> Hello {
        loop {
            if self.have == HELLO_LEN {
                return Hello::Complete;
            }
            match (&self.stream).read(&mut self.hello[self.have..]) {
                Ok(0) => {
                    return Hello::Closed(format!(
                        "closed the connection after {} of the {HELLO_LEN} hello bytes",
                        self.have
                    ))
                }
                Ok(n) => self.have += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Hello::Waiting,
                Err(e) => return Hello::Closed(format!("failed during its hello: {e}")),
            }
        }
    }
}

impl Acceptor {
    /// Accepts every connection the kernel has queued. Returns whether there was any.
    fn accept_queued(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    any = true;
                    // Non-blocking: one silent peer must not stall the others.
                    if let Err(e) = stream.set_nonblocking(true) {
                        self.note(peer, format!("could not be set up: {e}"));
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        refuse(
                            &stream,
                            &format!("{MAX_PENDING} other connections are still saying hello"),
                        );
                        self.note(peer, "too many connections at once".into());
                        continue;
                    }
                    self.pending.push(Pending {
                        stream,
                        peer,
                        since: Instant::now(),
                        hello: [0; HELLO_LEN],
                        have: 0,
                    });
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // WouldBlock: nothing queued. Anything else (a connection
                // aborted before accept, no file descriptors left) concerns
                // one connection or passes; the next round tries again.
                Err(_) => return any,
            }
        }
    }

    /// Records a refused or failed connection for the error message.
    fn note(&mut self, peer: SocketAddr, reason: String) {
        tracing::warn!(%peer, %reason, "message queue: dropped a TCP connection");
        if self.rejected.len() < MAX_REJECTIONS {
            self.rejected.push(format!("{peer}: {reason}"));
        } else {
            self.more_rejected += 1;
        }
    }

    fn rejected(&self) -> Vec<String> {
        let mut list = self.rejected.clone();
        if self.more_rejected > 0 {
            list.push(format!("{} more", self.more_rejected));
        }
        list
    }
}

/// Tells a refused peer why, best effort (a short frame fits any empty
/// socket buffer; the socket is non-blocking, so this never waits).
fn refuse(stream: &TcpStream, reason: &str) {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut frame = header(KIND_REJECT, end as u64).to_vec();
    frame.extend_from_slice(&reason.as_bytes()[..end]);
    let _ = (&*stream).write(&frame);
}

impl TcpWriter {
    /// Listens at `bind` for the readers of ranks `remote` (sorted, unique,
    /// below `n_readers`).
    pub fn bind(bind: &str, n_readers: usize, remote: Vec<usize>) -> Result<TcpWriter, QueueError> {
        let addrs = resolve(bind)?;
        let listen_err = |e: io::Error| {
            QueueError::InvalidConfig(format!("cannot listen on {bind:?} for remote readers: {e}"))
        };
        let listener = TcpListener::bind(&addrs[..]).map_err(listen_err)?;
        // Non-blocking, so that waiting for readers keeps its deadline.
        listener.set_nonblocking(true).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        Ok(TcpWriter {
            addr,
            n_readers,
            remote,
            acceptor: RefCell::new(Some(Acceptor {
                listener,
                pending: Vec::new(),
                rejected: Vec::new(),
                more_rejected: 0,
            })),
            conns: RefCell::new(Vec::new()),
            next: Cell::new(0),
            shut: Cell::new(false),
            scratch: RefCell::new(Vec::new()),
        })
    }

    /// The address remote readers connect to. An unspecified bind address
    /// (`0.0.0.0`) is exported as it is, which only readers on this host can
    /// use: bind to the address the other hosts reach.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The remote ranks that have not connected yet.
    fn missing(&self) -> Vec<usize> {
        let conns = self.conns.borrow();
        self.remote
            .iter()
            .copied()
            .filter(|r| conns.iter().all(|c| c.rank != *r))
            .collect()
    }

    /// Accepts remote readers until every remote rank has connected or
    /// `timeout` passes ([`QueueError::NotReady`] with the missing ranks and
    /// the refused connections). A connection with a bad hello is refused
    /// (told why, dropped and recorded) and waiting goes on: a stray or
    /// hostile peer must not keep the real readers out.
    pub fn accept(&self, timeout: Duration) -> Result<(), QueueError> {
        if self.shut.get() {
            return Err(QueueError::Shutdown);
        }
        let started = Instant::now();
        let deadline = started.checked_add(timeout);
        let mut slot = self.acceptor.borrow_mut();
        loop {
            let missing = self.missing();
            if missing.is_empty() {
                // Closes the port and drops stray connections.
                *slot = None;
                return Ok(());
            }
            let Some(acc) = slot.as_mut() else {
                // Unreachable: the acceptor lives until everyone connected.
                return Err(QueueError::Shutdown);
            };
            let mut busy = acc.accept_queued();
            let mut i = 0;
            while i < acc.pending.len() {
                match acc.pending[i].read() {
                    Hello::Waiting if acc.pending[i].since.elapsed() < HELLO_DEADLINE => i += 1,
                    Hello::Waiting => {
                        let p = acc.pending.swap_remove(i);
                        let reason = format!(
                            "sent {} of the {HELLO_LEN} hello bytes within {HELLO_DEADLINE:?}",
                            p.have
                        );
                        refuse(&p.stream, &reason);
                        acc.note(p.peer, reason);
                    }
                    Hello::Closed(reason) => {
                        let p = acc.pending.swap_remove(i);
                        acc.note(p.peer, reason);
                    }
                    Hello::Complete => {
                        busy = true;
                        let p = acc.pending.swap_remove(i);
                        self.admit(p, acc);
                    }
                }
            }
            if !self.missing().is_empty() && deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(QueueError::NotReady {
                    missing: self.missing(),
                    waited: started.elapsed(),
                    rejected: acc.rejected(),
                });
            }
            if !busy {
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }

    /// Checks a complete hello and registers the reader, or refuses it.
    fn admit(&self, p: Pending, acc: &mut Acceptor) {
        let magic = &p.hello[..8];
        let version = u32::from_le_bytes(p.hello[8..12].try_into().expect("4 bytes"));
        let claimed = u64::from_le_bytes(p.hello[12..20].try_into().expect("8 bytes"));
        let rank = usize::try_from(claimed)
            .ok()
            .filter(|r| self.remote.binary_search(r).is_ok());
        let taken_by = rank.and_then(|r| {
            let conns = self.conns.borrow();
            conns.iter().find(|c| c.rank == r).map(|c| c.peer)
        });
        let reason = if magic != HELLO_MAGIC {
            Some(format!(
                "its hello starts with {magic:02x?}, not the reader magic {:?}: it is not a \
                 reader of this queue",
                String::from_utf8_lossy(&HELLO_MAGIC)
            ))
        } else if version != HANDLE_VERSION {
            Some(format!(
                "it speaks handle version {version}, this writer {HANDLE_VERSION}: run the \
                 same build on every host"
            ))
        } else if rank.is_none() && claimed < self.n_readers as u64 {
            Some(format!(
                "it claims rank {claimed}, which reads through shared memory (remote ranks: {:?})",
                self.remote
            ))
        } else if rank.is_none() {
            Some(format!(
                "it claims rank {claimed}, but this queue's readers are ranks 0..{} (remote: {:?})",
                self.n_readers, self.remote
            ))
        } else {
            taken_by.map(|peer| {
                format!(
                    "it claims rank {claimed}, which is already connected from {peer}; each rank \
                     connects once"
                )
            })
        };
        if let Some(reason) = reason {
            refuse(&p.stream, &reason);
            acc.note(p.peer, reason);
            return;
        }
        let rank = rank.expect("checked above");
        let mut conn = Conn {
            rank,
            peer: p.peer,
            stream: None,
            lost: None,
            write_timeout: None,
        };
        let welcome = {
            let mut frame = header(KIND_WELCOME, 4).to_vec();
            frame.extend_from_slice(&std::process::id().to_le_bytes());
            frame
        };
        let setup = p
            .stream
            .set_nonblocking(false)
            .and_then(|()| p.stream.set_nodelay(true))
            .and_then(|()| {
                let deadline = Instant::now() + CONTROL_TIMEOUT;
                write_all_by(&p.stream, &welcome, Some(deadline), &mut conn.write_timeout)
            });
        if let Err(e) = setup {
            acc.note(
                p.peer,
                format!("reader rank {rank} vanished before its welcome: {e}"),
            );
            return;
        }
        keep_alive(&p.stream);
        conn.stream = Some(p.stream);
        self.conns.borrow_mut().push(conn);
    }

    /// Checks, before a message is written anywhere, that it can go to every
    /// remote reader: the queue is up, every remote reader connected and
    /// none was lost (a lost reader fails every later enqueue, as a dead
    /// shared-memory reader does), and `len` (if known) fits a frame.
    pub fn check(&self, len: Option<usize>) -> Result<(), QueueError> {
        if self.shut.get() {
            return Err(QueueError::Shutdown);
        }
        if let Some(c) = self.conns.borrow().iter().find(|c| c.lost.is_some()) {
            let detail = format!("earlier, {}", c.lost.clone().unwrap_or_default());
            return Err(c.lost_error(detail));
        }
        if !self.missing().is_empty() {
            return Err(QueueError::WrongRole(
                "enqueue before wait_until_ready accepted every remote reader (remote readers \
                 connect there; call it first)",
            ));
        }
        match len {
            Some(len) => check_len(len),
            None => Ok(()),
        }
    }

    /// Sends `payload` as one message to every remote reader by `deadline`
    /// (`None`: blocks). A reader whose send fails is lost; the others still
    /// get the message, and the first failure is returned.
    pub fn send(&self, payload: &[u8], deadline: Option<Instant>) -> Result<(), QueueError> {
        check_len(payload.len())?;
        let head = header(KIND_MESSAGE, payload.len() as u64);
        if payload.len() <= COALESCE_BYTES {
            let mut scratch = self.scratch.borrow_mut();
            scratch.clear();
            scratch.extend_from_slice(&head);
            scratch.extend_from_slice(payload);
            self.send_parts(&[&scratch], deadline)
        } else {
            self.send_parts(&[&head, payload], deadline)
        }
    }

    /// Sends a message of `len` bytes that `fill` writes in place, as
    /// [`TcpWriter::send`]. If `fill` fails, nothing is sent.
    pub fn send_with(
        &self,
        len: usize,
        deadline: Option<Instant>,
        fill: impl FnOnce(&mut [u8]) -> Result<(), QueueError>,
    ) -> Result<(), QueueError> {
        check_len(len)?;
        let mut scratch = self.scratch.borrow_mut();
        scratch.clear();
        scratch.extend_from_slice(&header(KIND_MESSAGE, len as u64));
        scratch.resize(HEADER_LEN + len, 0);
        fill(&mut scratch[HEADER_LEN..])?;
        let sent = self.send_parts(&[&scratch], deadline);
        if scratch.capacity() > KEEP_CAPACITY {
            *scratch = Vec::new();
        }
        sent
    }

    /// Writes one frame, given in parts, to every live connection.
    fn send_parts(&self, parts: &[&[u8]], deadline: Option<Instant>) -> Result<(), QueueError> {
        let seq = self.next.get();
        self.next.set(seq + 1);
        let started = Instant::now();
        let deadline = deadline.map(|d| d.max(started + MIN_SEND_WAIT));
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut first = None;
        for conn in self.conns.borrow_mut().iter_mut() {
            let Some(stream) = &conn.stream else { continue };
            let cache = &mut conn.write_timeout;
            let Err(e) = parts
                .iter()
                .try_for_each(|part| write_all_by(stream, part, deadline, cache))
            else {
                continue;
            };
            let detail = if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) {
                format!(
                    "sending message {seq} ({total} bytes) to the reader did not finish within \
                     the enqueue timeout ({:?}): the reader is not reading; the writer closed \
                     the connection, since a cut frame cannot be resumed",
                    started.elapsed()
                )
            } else {
                format!("sending message {seq} to the reader failed: {e}")
            };
            let err = conn.lose(detail);
            first.get_or_insert(err);
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends every reader a shutdown frame (best effort, within
    /// `CONTROL_TIMEOUT` in all), closes the connections and the listener.
    pub fn shutdown(&self) {
        if self.shut.replace(true) {
            return;
        }
        *self.acceptor.borrow_mut() = None;
        let frame = header(KIND_SHUTDOWN, 0);
        let deadline = Some(Instant::now() + CONTROL_TIMEOUT);
        for conn in self.conns.borrow_mut().iter_mut() {
            if let Some(stream) = conn.stream.take() {
                let _ = write_all_by(&stream, &frame, deadline, &mut conn.write_timeout);
                let _ = stream.shutdown(Shutdown::Write);
            }
        }
    }
}

impl Drop for TcpWriter {
    /// Shuts down as the shared-memory writer does, so that dropping the
    /// queue is an orderly end for every reader. Not while panicking: a
    /// writer that did not finish its work then just closes the sockets,
    /// and its readers see [`QueueError::ConnectionLost`], as after a crash.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.shutdown();
        }
    }
}

/// Refuses a message longer than a frame may be.
fn check_len(len: usize) -> Result<(), QueueError> {
    if len as u64 > MAX_FRAME_BYTES {
        return Err(QueueError::Encode(format!(
            "a {len}-byte message exceeds the {MAX_FRAME_BYTES}-byte limit of a TCP frame"
        )));
    }
    Ok(())
}
