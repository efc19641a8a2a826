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
//!
//! `writer.rs` is the writer's side (listening, checking hellos, sending
//! frames), `reader.rs` a reader's (connecting, saying hello, reading
//! frames within their bounds); this module holds what both share.

mod reader;
mod writer;

pub use reader::TcpReader;
pub use writer::TcpWriter;

use std::io::{self, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::error::QueueError;

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
/// How long a welcome, a refusal or a shutdown frame may take to send.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(1);

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
    super::net::bind_addrs(bind).map_err(|e| {
        QueueError::InvalidConfig(format!(
            "bind address {bind:?} for remote readers: {e}; use \"host\" or \"host:port\""
        ))
    })
}
