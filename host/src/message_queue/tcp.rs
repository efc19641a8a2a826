//! The TCP transport for readers on other hosts, as vLLM's shm_broadcast
//! `MessageQueue` serves its remote subscribers: the writer listens, each
//! remote reader connects and says hello, and every message travels to it
//! as one length-prefixed frame on that reader's own connection.
//!
//! Wire format, integers little-endian:
//! - **hello**, reader → writer, once, 20 bytes: [`HELLO_MAGIC`] (8), the
//!   handle version (u32), the reader's rank (u64).
//! - **frames**, writer → reader: kind (u8), payload length (u64), payload.
//!   `WELCOME` (payload: the writer's pid, u32) answers a valid hello and
//!   precedes everything else; `REJECT` (a UTF-8 reason, at most 1 KiB)
//!   answers a bad one, after which the writer closes; `MESSAGE` carries one
//!   message; `SHUTDOWN` (empty) ends the stream.
//!
//! One connection per reader, not a pub/sub socket, so that the writer knows
//! which rank a failed send belongs to. A reader's kernel socket buffers play
//! the ring's part; a send that cannot finish within the enqueue timeout
//! cuts that connection, because a half-sent frame cannot be resumed without
//! buffering it, and the reader would otherwise read garbage.
//!
//! Distrust: every value read off the wire is checked before use. The
//! writer validates each hello's magic, version and rank, and refuses
//! connections that send garbage, too little, or a rank that is not theirs,
//! without panicking or waiting past the caller's deadline. A reader checks
//! each frame's kind, and its length against that kind's limit, before it
//! allocates anything, and then grows its buffer only as bytes arrive, so a
//! claimed length costs memory only once the writer actually sends it.

use std::cell::{Cell, RefCell};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::error::QueueError;
use super::handle::HANDLE_VERSION;
use super::layout::MAX_READERS;

/// The first bytes of a hello: "a reader of a host message queue, TCP protocol 1".
pub const HELLO_MAGIC: [u8; 8] = *b"hostmqT1";
/// Magic, version, rank.
const HELLO_LEN: usize = 8 + 4 + 8;
/// Kind, payload length.
const HEADER_LEN: usize = 1 + 8;

/// A frame carrying one message.
const KIND_MESSAGE: u8 = 0;
/// The writer shut the queue down; nothing follows.
const KIND_SHUTDOWN: u8 = 1;
/// The writer accepted this reader; the payload is its pid.
const KIND_WELCOME: u8 = 2;
/// The writer refused this reader; the payload says why.
const KIND_REJECT: u8 = 3;

/// The longest message frame. Messages that overflow a chunk have no limit
/// in shared memory, so this is set far beyond any message a host holds in
/// memory: the writer never reaches it in practice, and a longer claim is
/// corruption. (A claim below it is still safe: see [`GROW_STEP`].)
pub const MAX_FRAME_BYTES: u64 = 1 << 40;
/// The longest reason a `REJECT` frame carries.
const MAX_REASON_BYTES: usize = 1024;
/// A reader's buffer grows to at most twice the bytes received so far, or
/// by this much, so a claimed length is only paid for as data arrives.
const GROW_STEP: usize = 16 << 20;
/// A reader keeps a buffer up to this size between frames (one huge message
/// should not pin its memory for the life of the queue).
const KEEP_CAPACITY: usize = 64 << 20;
/// Frames up to this size go out in one write (header and payload copied
/// together): with TCP_NODELAY two writes would cost two packets.
const COALESCE_BYTES: usize = 64 << 10;

/// How long a reader keeps trying to connect: the writer may still be
/// binding, or its host still starting.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(5);
/// The longest single connect attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
/// The pause between connect attempts.
const CONNECT_RETRY: Duration = Duration::from_millis(50);
/// How long an accepted connection may take to send its whole hello before
/// the writer drops it (a peer that sends nothing must not hold a slot).
const HELLO_DEADLINE: Duration = Duration::from_secs(2);
/// Connections waiting to say hello at once; more are refused, so a flood
/// cannot exhaust the writer's file descriptors.
const MAX_PENDING: usize = 2 * MAX_READERS;
/// Refused connections kept for [`QueueError::NotReady`]; the rest are counted.
const MAX_REJECTIONS: usize = 16;
/// How long a welcome, a refusal or a shutdown frame may take to send.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(1);
/// The shortest time a send gets, even when the enqueue timeout was spent on
/// the shared-memory ring: a frame that fits the socket buffer then still goes.
const MIN_SEND_WAIT: Duration = Duration::from_millis(1);
/// How often the writer looks for new connections and hello bytes while it
/// waits (only during `wait_until_ready`, so a short poll costs nothing).
const ACCEPT_POLL: Duration = Duration::from_millis(1);

/// A frame header.
fn header(kind: u8, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    h[0] = kind;
    h[1..].copy_from_slice(&len.to_le_bytes());
    h
}

/// Sets a socket timeout unless `cache` says it already has that value
/// (`setsockopt` is a system call; a blocking queue never changes it).
fn set_timeout(
    cache: &mut Option<Option<Duration>>,
    want: Option<Duration>,
    set: impl FnOnce(Option<Duration>) -> io::Result<()>,
) -> io::Result<()> {
    if *cache != Some(want) {
        set(want)?;
        *cache = Some(want);
    }
    Ok(())
}

/// The time left until `deadline`, `Ok(None)` for no deadline, or a
/// `TimedOut` error once it has passed.
fn time_left(deadline: Option<Instant>) -> io::Result<Option<Duration>> {
    match deadline {
        None => Ok(None),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                Err(ErrorKind::TimedOut.into())
            } else {
                Ok(Some(left))
            }
        }
    }
}

/// Writes all of `bytes` by `deadline` (`None`: blocks). A timeout after a
/// partial write leaves the stream mid-frame; the caller must then drop it.
fn write_all_by(
    stream: &TcpStream,
    mut bytes: &[u8],
    deadline: Option<Instant>,
    cache: &mut Option<Option<Duration>>,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = time_left(deadline)?;
        set_timeout(cache, left, |t| stream.set_write_timeout(t))?;
        // `write` on a TcpStream is `send(MSG_NOSIGNAL)`: a closed peer is
        // EPIPE, never a SIGPIPE that kills the process.
        match (&*stream).write(bytes) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // The socket timeout expired; the deadline check above ends the loop.
            Err(e)
                if deadline.is_some()
                    && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Turns on TCP keepalive with short timers, so that an idle connection to
/// a peer whose host died or fell off the network breaks within about 25 s
/// (the kernel's default is two hours): a reader blocked in `dequeue(None)`
/// then gets [`QueueError::ConnectionLost`]. No `TCP_USER_TIMEOUT`: it would
/// also cut a live reader that is merely slow to drain a full buffer.
/// Best effort.
#[cfg(target_os = "linux")]
fn keep_alive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let options = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ];
    for (level, name, value) in options {
        let value: libc::c_int = value;
        // SAFETY: the fd is a live socket owned by `stream`; `value` outlives
        // the call and its size is passed with it.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                level,
                name,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

#[cfg(not(target_os = "linux"))]
fn keep_alive(_stream: &TcpStream) {}

/// Resolves a bind address: `"host"` or `"host:port"` (an IPv6 address
/// with a port in brackets); without a port the OS picks one.
fn resolve(bind: &str) -> Result<Vec<SocketAddr>, QueueError> {
    let bad = |detail: String| {
        QueueError::InvalidConfig(format!(
            "bind address {bind:?} for remote readers: {detail}; use \"host\" or \"host:port\""
        ))
    };
    if let Ok(addr) = bind.parse::<SocketAddr>() {
        return Ok(vec![addr]);
    }
    let bare = bind.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, 0)]);
    }
    let found = match bind.rsplit_once(':') {
        Some((host, port)) => {
            let port: u16 = port
                .parse()
                .map_err(|_| bad(format!("port {port:?} is not in 0..=65535")))?;
            (host, port).to_socket_addrs()
        }
        None => (bind, 0).to_socket_addrs(),
    };
    let addrs: Vec<_> = found.map_err(|e| bad(e.to_string()))?.collect();
    if addrs.is_empty() {
        return Err(bad("it resolves to no address".into()));
    }
    Ok(addrs)
}

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
        let started = Instant::now();
        let stream = loop {
            let left = CONNECT_DEADLINE.saturating_sub(started.elapsed());
            let attempt = left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
            match TcpStream::connect_timeout(&writer, attempt) {
                Ok(stream) => break stream,
                Err(_) if started.elapsed() + CONNECT_RETRY < CONNECT_DEADLINE => {
                    std::thread::sleep(CONNECT_RETRY)
                }
                Err(e) => {
                    return Err(lost(format!(
                        "reader rank {rank} could not connect to the writer within \
                         {CONNECT_DEADLINE:?}: {e}; is the writer running, and reachable from \
                         this host?"
                    )))
                }
            }
        };
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
