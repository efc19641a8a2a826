//! A sum all-reduce over TCP, for ranks on several hosts: a star through a
//! hub that runs in the engine's executor process.
//!
//! Each rank ([`TcpAllReduceGroup`]) holds one connection to the hub
//! ([`TcpAllReduceHub`]). A call is cut into chunks of at most
//! [`TCP_CHUNK_FLOATS`] floats; for each chunk every rank sends a frame,
//! the hub waits for all of them, sums them **in rank order** (`out = r0;
//! out += r1; ...`, the same f32 operations as the shared-memory path, so
//! the results are bit-identical to it and on every rank) and sends the sum
//! back to every rank.
//!
//! Wire format (every integer u64 little-endian, every float f32
//! little-endian):
//! ```text
//! rank → hub  hello   "hosttcp1" world_size rank
//! hub → rank  ack     "hosttcp1" status world_size        status: 0 accepted, 1 wrong world size,
//!                                                                 2 rank out of range, 3 duplicate rank
//! rank → hub  frame   total chunk f32 × chunk             total: the call's length, chunk <= TCP_CHUNK_FLOATS
//!             abort   u64::MAX u64::MAX                   the rank gave up (timed out) and hangs up
//!             leave   u64::MAX u64::MAX-1                 the rank is dropped (shut down) and hangs up
//! hub → rank  0 f32 × chunk                               the sum
//!             1 (total, chunk) × world_size               ranks sent different lengths; hub hangs up
//!             2 rank detail_len detail (UTF-8)            a rank disconnected; hub hangs up
//!             3 rank                                      a rank gave up; hub hangs up
//! ```
//! An empty call still sends one (empty) frame, so a length mismatch with
//! it is caught too. Every length read off the wire is checked against a
//! bound (the caller's length, [`TCP_CHUNK_FLOATS`], the world size)
//! before anything is allocated.
//!
//! Failure: the hub reads every rank on its own thread, so it notices a
//! rank hanging up at any time, not only when that rank's frame is due;
//! any failure (a rank gone, a length mismatch, a rank giving up after its
//! timeout, a malformed frame) makes the hub tell every other rank why
//! (best effort) and close every connection, so all ranks fail at once
//! instead of waiting for their timeout. A rank that is dropped says it
//! leaves first: the others stop the same way, but the hub does not log
//! it as a failure (workers shutting down). A rank waits for each sum at most
//! the handle's timeout; an error leaves its group broken for good, as the
//! shared-memory group is.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::all_reduce::{AllReduceError, MAX_RANKS};

/// Floats per frame (1 MiB): larger all-reduces run in several rounds, so
/// the hub's and each rank's buffers stay bounded.
pub const TCP_CHUNK_FLOATS: usize = 1 << 18;

const MAGIC: [u8; 8] = *b"hosttcp1";
const HELLO_BYTES: usize = 24;
const FRAME_HEADER: usize = 16;
const ABORT: u64 = u64::MAX;
const LEAVE: u64 = u64::MAX - 1;

const ACK_OK: u64 = 0;
const ACK_WRONG_WORLD: u64 = 1;
const ACK_BAD_RANK: u64 = 2;
const ACK_DUPLICATE: u64 = 3;

const REPLY_SUM: u64 = 0;
const REPLY_MISMATCH: u64 = 1;
const REPLY_DISCONNECTED: u64 = 2;
const REPLY_ABORTED: u64 = 3;

/// Longest detail text a disconnect reply carries.
const MAX_DETAIL: usize = 1024;

/// How long the hub waits for a new connection's hello (a real rank sends
/// it right after connecting), and a rank for the hub's answer to it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rank keeps retrying to connect to the hub.
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);
const CONNECT_RETRY: Duration = Duration::from_millis(50);
/// How often the hub's accept loop checks whether the hub was dropped.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// How long a rank that failed to send still waits for the hub's reason.
const REASON_WAIT: Duration = Duration::from_millis(200);

/// What a rank needs to connect to a hub; travels in the worker bootstrap.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpAllReduceHandle {
    /// The hub's address, `host:port` (the address it is bound to).
    pub addr: String,
    /// Number of ranks.
    pub world_size: usize,
    /// How long a rank waits for each sum before failing the step.
    pub timeout: Duration,
}

fn hub_err(hub: &str, detail: impl ToString) -> AllReduceError {
    AllReduceError::Hub {
        hub: hub.to_string(),
        detail: detail.to_string(),
    }
}

fn check_params(world_size: usize, timeout: Duration) -> Result<(), AllReduceError> {
    if world_size == 0 || world_size > MAX_RANKS {
        return Err(AllReduceError::Config(format!(
            "world_size = {world_size}; use 1..={MAX_RANKS} ranks"
        )));
    }
    if timeout.is_zero() {
        return Err(AllReduceError::Config(
            "the all-reduce timeout must be longer than zero".into(),
        ));
    }
    Ok(())
}

/// The addresses `bind` names: `host`, `host:port`, `[v6]` or `[v6]:port`;
/// no port (or port 0) lets the OS pick one.
fn bind_addrs(bind: &str) -> io::Result<Vec<SocketAddr>> {
    if let Ok(addr) = bind.parse::<SocketAddr>() {
        return Ok(vec![addr]);
    }
    let bare = bind
        .strip_prefix('[')
        .and_then(|b| b.strip_suffix(']'))
        .unwrap_or(bind);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, 0)]);
    }
    let (host, port) = match bind.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u16>() {
            Ok(port) => (host, port),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("`{port}` is not a port number"),
                ))
            }
        },
        None => (bind, 0),
    };
    Ok((host, port).to_socket_addrs()?.collect())
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

fn read_u64(stream: &mut TcpStream) -> io::Result<u64> {
    let mut b = [0u8; 8];
    stream.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------- hub ----

/// What the hub's threads share with its owner.
struct Shared {
    state: Mutex<HubState>,
    addr: String,
}

struct HubState {
    /// Set once the hub stops (dropped, or a failure): every stream below
    /// is shut down, and none is added after.
    closed: bool,
    /// The first failure, for [`TcpAllReduceHub::failure`].
    failure: Option<String>,
    /// A clone of every open stream (accepted ranks and a connection still
    /// in its hello), so closing can unblock any thread reading or writing;
    /// each with the id [`Shared::register`] gave it.
    streams: Vec<(u64, TcpStream)>,
    /// The next registration's id.
    next_id: u64,
}

impl Shared {
    /// Keeps a clone of `stream` for [`Shared::close`], under the id it
    /// returns; `None` (and the stream shut down) if the hub is already
    /// closed or the stream cannot be cloned.
    fn register(&self, stream: &TcpStream) -> Option<u64> {
        let mut st = lock(&self.state);
        let clone = match stream.try_clone() {
            Ok(c) if !st.closed => c,
            _ => {
                let _ = stream.shutdown(Shutdown::Both);
                return None;
            }
        };
        let id = st.next_id;
        st.next_id += 1;
        st.streams.push((id, clone));
        Some(id)
    }

    /// Forgets a refused connection's clone, so its socket is closed.
    fn forget(&self, id: u64) {
        lock(&self.state).streams.retain(|(i, _)| *i != id);
    }

    fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// Records `failure` unless the hub already closed or failed.
    fn record(&self, failure: String) {
        let mut st = lock(&self.state);
        if !st.closed && st.failure.is_none() {
            tracing::error!(hub = %self.addr, "tensor-parallel all-reduce hub: {failure}");
            st.failure = Some(failure);
        }
    }

    /// Records `failure` (the first one wins), then shuts every stream down.
    fn close(&self, failure: Option<String>) {
        if let Some(f) = failure {
            self.record(f);
        }
        let mut st = lock(&self.state);
        st.closed = true;
        for (_, s) in &st.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// The hub of a TCP all-reduce group; runs in the engine's executor
/// process. Dropping it stops its threads and closes every connection.
pub struct TcpAllReduceHub {
    shared: Arc<Shared>,
    handle: TcpAllReduceHandle,
    thread: Option<JoinHandle<()>>,
}

impl TcpAllReduceHub {
    /// Binds `bind` (`host` or `host:port`; no port or port 0 lets the OS
    /// pick) and starts accepting the `world_size` ranks. Ranks wait for
    /// each sum at most `timeout`. The handle carries the bound address: bind
    /// an address the ranks can reach (a wildcard such as `0.0.0.0` is only
    /// reachable from this host under that name).
    pub fn start(
        world_size: usize,
        bind: &str,
        timeout: Duration,
    ) -> Result<TcpAllReduceHub, AllReduceError> {
        check_params(world_size, timeout)?;
        let addrs = bind_addrs(bind).map_err(|e| hub_err(bind, format!("bad address: {e}")))?;
        let listener = TcpListener::bind(&addrs[..])
            .map_err(|e| hub_err(bind, format!("cannot listen: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| hub_err(bind, format!("cannot listen: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| hub_err(bind, format!("cannot listen: {e}")))?;
        let addr = local.to_string();
        let shared = Arc::new(Shared {
            state: Mutex::new(HubState {
                closed: false,
                failure: None,
                streams: Vec::new(),
                next_id: 0,
            }),
            addr: addr.clone(),
        });
        let hub_shared = shared.clone();
        let thread = thread::Builder::new()
            .name("tp-allreduce-hub".into())
            .spawn(move || run_hub(&hub_shared, listener, world_size, timeout))
            .map_err(|e| hub_err(&addr, format!("cannot start the hub thread: {e}")))?;
        Ok(TcpAllReduceHub {
            shared,
            handle: TcpAllReduceHandle {
                addr,
                world_size,
                timeout,
            },
            thread: Some(thread),
        })
    }

    /// The handle to send each rank.
    pub fn handle(&self) -> TcpAllReduceHandle {
        self.handle.clone()
    }

    /// Why the hub stopped serving its ranks, if it failed (a rank gone
    /// without leaving, a length mismatch, a rank timing out, a malformed
    /// frame); a rank leaving cleanly (dropped) is not a failure.
    pub fn failure(&self) -> Option<String> {
        lock(&self.shared.state).failure.clone()
    }
}

impl Drop for TcpAllReduceHub {
    fn drop(&mut self) {
        self.shared.close(None);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The hub thread: accept the ranks, then sum their frames until closed.
fn run_hub(shared: &Arc<Shared>, listener: TcpListener, world_size: usize, timeout: Duration) {
    let Some(ranks) = accept_ranks(shared, listener, world_size, timeout) else {
        return;
    };
    serve(shared, ranks);
}

/// Accepts connections until every rank said hello; refuses (and survives)
/// anything else. `None` when the hub closed first.
fn accept_ranks(
    shared: &Shared,
    listener: TcpListener,
    world_size: usize,
    timeout: Duration,
) -> Option<Vec<TcpStream>> {
    let mut ranks: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
    let mut joined = 0;
    while joined < world_size {
        if shared.is_closed() {
            return None;
        }
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                tracing::warn!(hub = %shared.addr, "all-reduce hub: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let Some(id) = shared.register(&stream) else {
            if shared.is_closed() {
                return None;
            }
            continue;
        };
        match handshake(&stream, &ranks, world_size, timeout) {
            Ok(rank) => {
                ranks[rank] = Some(stream);
                joined += 1;
                tracing::debug!(hub = %shared.addr, rank, %peer, "all-reduce rank connected");
            }
            Err(why) => {
                tracing::warn!(
                    hub = %shared.addr,
                    "all-reduce hub: refused the connection from {peer}: {why}"
                );
                let _ = stream.shutdown(Shutdown::Both);
                shared.forget(id);
            }
        }
    }
    drop(listener);
    Some(ranks.into_iter().flatten().collect())
}

/// Reads a connection's hello and answers it; the rank, if accepted.
fn handshake(
    stream: &TcpStream,
    ranks: &[Option<TcpStream>],
    world_size: usize,
    timeout: Duration,
) -> Result<usize, String> {
    let mut s = stream;
    let setup = |e: io::Error| format!("socket setup: {e}");
    s.set_nonblocking(false).map_err(setup)?;
    s.set_nodelay(true).map_err(setup)?;
    s.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(setup)?;
    s.set_write_timeout(Some(HELLO_TIMEOUT)).map_err(setup)?;
    let mut hello = [0u8; HELLO_BYTES];
    s.read_exact(&mut hello)
        .map_err(|e| format!("no hello within {HELLO_TIMEOUT:?}: {e}"))?;
    if hello[..8] != MAGIC {
        return Err("not a tensor-parallel rank (bad hello)".into());
    }
    let (their_world, rank) = (u64_at(&hello, 8), u64_at(&hello, 16));
    let (status, why) = if their_world != world_size as u64 {
        (
            ACK_WRONG_WORLD,
            format!("it expects {their_world} ranks, the hub has {world_size}"),
        )
    } else if rank >= world_size as u64 {
        (
            ACK_BAD_RANK,
            format!("rank {rank} does not exist; the ranks are 0..{world_size}"),
        )
    } else if ranks[rank as usize].is_some() {
        (ACK_DUPLICATE, format!("rank {rank} is already connected"))
    } else {
        (ACK_OK, String::new())
    };
    let mut ack = [0u8; 24];
    ack[..8].copy_from_slice(&MAGIC);
    ack[8..16].copy_from_slice(&status.to_le_bytes());
    ack[16..].copy_from_slice(&(world_size as u64).to_le_bytes());
    s.write_all(&ack)
        .map_err(|e| format!("cannot answer the hello: {e}"))?;
    if status != ACK_OK {
        return Err(why);
    }
    s.set_read_timeout(None).map_err(setup)?;
    s.set_write_timeout(Some(timeout)).map_err(setup)?;
    Ok(rank as usize)
}

/// What a rank's reader thread tells the summing thread.
enum Event {
    /// A whole frame; its payload is `buf` (`chunk` floats).
    Frame {
        rank: usize,
        total: u64,
        chunk: u64,
        buf: Vec<u8>,
    },
    /// The rank's connection ended or broke.
    Gone { rank: usize, detail: String },
    /// The rank gave up (timed out) and hung up.
    Aborted { rank: usize },
    /// The rank was dropped (its worker shut down) and hung up.
    Left { rank: usize },
    /// The rank sent something that is not a frame.
    Malformed { rank: usize, detail: String },
}

/// Reads rank `rank`'s frames. It reads the next header as soon as the
/// previous frame is handed over, so a hang-up is seen at once even while
/// the hub waits for other ranks; it waits for its buffer to come back
/// before reading a payload.
fn read_rank(
    rank: usize,
    mut stream: TcpStream,
    events: Sender<Event>,
    buffers: Receiver<Vec<u8>>,
) {
    loop {
        let mut header = [0u8; FRAME_HEADER];
        if let Err(e) = stream.read_exact(&mut header) {
            let detail = if e.kind() == io::ErrorKind::UnexpectedEof {
                "it closed its connection".to_string()
            } else {
                format!("reading from it failed: {e}")
            };
            let _ = events.send(Event::Gone { rank, detail });
            return;
        }
        let (total, chunk) = (u64_at(&header, 0), u64_at(&header, 8));
        if (total, chunk) == (ABORT, ABORT) {
            let _ = events.send(Event::Aborted { rank });
            return;
        }
        if (total, chunk) == (ABORT, LEAVE) {
            let _ = events.send(Event::Left { rank });
            return;
        }
        if chunk > TCP_CHUNK_FLOATS as u64 || chunk > total {
            let detail = format!(
                "it sent a malformed frame of {chunk} floats (call of {total}; at most \
                 {TCP_CHUNK_FLOATS} and the call's length)"
            );
            let _ = events.send(Event::Malformed { rank, detail });
            return;
        }
        let Ok(mut buf) = buffers.recv() else { return };
        buf.resize(chunk as usize * 4, 0);
        if let Err(e) = stream.read_exact(&mut buf) {
            let detail = format!("its frame ended early: {e}");
            let _ = events.send(Event::Gone { rank, detail });
            return;
        }
        let frame = Event::Frame {
            rank,
            total,
            chunk,
            buf,
        };
        if events.send(frame).is_err() {
            return;
        }
    }
}

/// Sums the ranks' frames until a failure or the hub closes.
fn serve(shared: &Shared, ranks: Vec<TcpStream>) {
    let n = ranks.len();
    let (event_tx, events) = mpsc::channel();
    let mut buffer_txs = Vec::with_capacity(n);
    let mut readers = Vec::with_capacity(n);
    let mut writers = Vec::with_capacity(n);
    for (rank, stream) in ranks.into_iter().enumerate() {
        let writer = match stream.try_clone() {
            Ok(w) => w,
            Err(e) => {
                shared.close(Some(format!("cannot use rank {rank}'s connection: {e}")));
                return;
            }
        };
        writers.push(writer);
        let (buf_tx, buf_rx) = mpsc::channel();
        let _ = buf_tx.send(Vec::new());
        buffer_txs.push(buf_tx);
        let tx = event_tx.clone();
        let spawned = thread::Builder::new()
            .name(format!("tp-allreduce-rank{rank}"))
            .spawn(move || read_rank(rank, stream, tx, buf_rx));
        match spawned {
            Ok(t) => readers.push(t),
            Err(e) => {
                shared.close(Some(format!("cannot start a reader thread: {e}")));
                break;
            }
        }
    }
    drop(event_tx);
    if readers.len() == n {
        sum_frames(shared, &events, &mut writers, &buffer_txs);
    }
    // Unblock and collect the readers: their streams are shut down and
    // their buffer channels closed.
    shared.close(None);
    drop(buffer_txs);
    drop(events);
    for t in readers {
        let _ = t.join();
    }
}

fn sum_frames(
    shared: &Shared,
    events: &Receiver<Event>,
    writers: &mut [TcpStream],
    buffer_txs: &[Sender<Vec<u8>>],
) {
    let n = writers.len();
    let mut frames: Vec<Option<(u64, u64, Vec<u8>)>> = (0..n).map(|_| None).collect();
    let mut have = 0;
    // The reply: status word, then the sum (rank 0's payload, then += the others).
    let mut out: Vec<u8> = Vec::new();
    loop {
        let Ok(event) = events.recv() else { return };
        if shared.is_closed() {
            return;
        }
        match event {
            Event::Frame {
                rank,
                total,
                chunk,
                buf,
            } => {
                if frames[rank].replace((total, chunk, buf)).is_none() {
                    have += 1;
                }
            }
            Event::Gone { rank, detail } | Event::Malformed { rank, detail } => {
                shared.record(format!(
                    "tensor-parallel rank {rank} disconnected: {detail}"
                ));
                tell_all_but(writers, rank, &disconnected_reply(rank, &detail));
                shared.close(None);
                return;
            }
            Event::Left { rank } => {
                let detail = "it left the group (its worker shut down)";
                tell_all_but(writers, rank, &disconnected_reply(rank, detail));
                tracing::info!(
                    hub = %shared.addr,
                    rank,
                    "tensor-parallel rank left; the all-reduce hub stops"
                );
                shared.close(None);
                return;
            }
            Event::Aborted { rank } => {
                let mut reply = Vec::with_capacity(16);
                reply.extend_from_slice(&REPLY_ABORTED.to_le_bytes());
                reply.extend_from_slice(&(rank as u64).to_le_bytes());
                shared.record(format!(
                    "tensor-parallel rank {rank} gave up waiting for a sum (timed out)"
                ));
                tell_all_but(writers, rank, &reply);
                shared.close(None);
                return;
            }
        }
        if have < n {
            continue;
        }
        have = 0;
        let shape = |f: &Option<(u64, u64, Vec<u8>)>| f.as_ref().map(|(t, c, _)| (*t, *c));
        let first = shape(&frames[0]);
        if frames.iter().any(|f| shape(f) != first) {
            out.clear();
            out.extend_from_slice(&REPLY_MISMATCH.to_le_bytes());
            for (total, chunk) in frames.iter().map(|f| shape(f).unwrap_or_default()) {
                out.extend_from_slice(&total.to_le_bytes());
                out.extend_from_slice(&chunk.to_le_bytes());
            }
            let lengths: Vec<u64> = frames
                .iter()
                .map(|f| shape(f).unwrap_or_default().0)
                .collect();
            shared.record(format!(
                "the ranks contributed different lengths {lengths:?} (they ran different steps)"
            ));
            tell_all_but(writers, usize::MAX, &out);
            shared.close(None);
            return;
        }
        out.clear();
        out.extend_from_slice(&REPLY_SUM.to_le_bytes());
        for (q, frame) in frames.iter().enumerate() {
            let Some((_, _, buf)) = frame else { return };
            if q == 0 {
                out.extend_from_slice(buf);
            } else {
                for (o, v) in out[8..].chunks_exact_mut(4).zip(buf.chunks_exact(4)) {
                    let sum = f32::from_le_bytes([o[0], o[1], o[2], o[3]])
                        + f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                    o.copy_from_slice(&sum.to_le_bytes());
                }
            }
        }
        for (rank, w) in writers.iter_mut().enumerate() {
            if let Err(e) = w.write_all(&out) {
                if shared.is_closed() {
                    return;
                }
                let detail = format!("sending it the sum failed: {e}");
                shared.record(format!(
                    "tensor-parallel rank {rank} disconnected: {detail}"
                ));
                tell_all_but(writers, rank, &disconnected_reply(rank, &detail));
                shared.close(None);
                return;
            }
        }
        for (frame, tx) in frames.iter_mut().zip(buffer_txs) {
            if let Some((_, _, buf)) = frame.take() {
                let _ = tx.send(buf);
            }
        }
    }
}

/// The reply telling the ranks that `rank` went away, and why.
fn disconnected_reply(rank: usize, detail: &str) -> Vec<u8> {
    let detail = &detail.as_bytes()[..detail.len().min(MAX_DETAIL)];
    let mut reply = Vec::with_capacity(24 + detail.len());
    reply.extend_from_slice(&REPLY_DISCONNECTED.to_le_bytes());
    reply.extend_from_slice(&(rank as u64).to_le_bytes());
    reply.extend_from_slice(&(detail.len() as u64).to_le_bytes());
    reply.extend_from_slice(detail);
    reply
}

/// Best effort: sends `reply` to every rank but `skip`.
fn tell_all_but(writers: &mut [TcpStream], skip: usize, reply: &[u8]) {
    for (rank, w) in writers.iter_mut().enumerate() {
        if rank != skip {
            let _ = w.set_write_timeout(Some(REASON_WAIT));
            let _ = w.write_all(reply);
        }
    }
}

// --------------------------------------------------------------- rank ----

/// One rank's end of a TCP group. `Sync`: calls are serialised internally,
/// so a rank's frames go out in call order.
pub struct TcpAllReduceGroup {
    rank: usize,
    world_size: usize,
    hub: String,
    conn: Mutex<Conn>,
}

struct Conn {
    stream: TcpStream,
    /// Frame scratch, reused across calls.
    buf: Vec<u8>,
    /// Set by the first failure: the rank blamed for it.
    broken: Option<usize>,
}

impl TcpAllReduceGroup {
    /// Connects to the hub as `rank`, retrying for a few seconds while the
    /// hub is not yet listening.
    pub fn connect(
        handle: &TcpAllReduceHandle,
        rank: usize,
    ) -> Result<TcpAllReduceGroup, AllReduceError> {
        check_params(handle.world_size, handle.timeout)?;
        if rank >= handle.world_size {
            return Err(AllReduceError::Config(format!(
                "rank {rank} does not exist; the ranks are 0..{}",
                handle.world_size
            )));
        }
        let hub = handle.addr.as_str();
        let addrs: Vec<SocketAddr> = handle
            .addr
            .to_socket_addrs()
            .map_err(|e| hub_err(hub, format!("rank {rank}: bad hub address: {e}")))?
            .collect();
        let stream = connect_retrying(&addrs, hub, rank)?;
        let setup = |e: io::Error| hub_err(hub, format!("rank {rank}: socket setup: {e}"));
        stream.set_nodelay(true).map_err(setup)?;
        stream.set_read_timeout(Some(ACK_TIMEOUT)).map_err(setup)?;
        stream.set_write_timeout(Some(ACK_TIMEOUT)).map_err(setup)?;
        let mut hello = [0u8; HELLO_BYTES];
        hello[..8].copy_from_slice(&MAGIC);
        hello[8..16].copy_from_slice(&(handle.world_size as u64).to_le_bytes());
        hello[16..].copy_from_slice(&(rank as u64).to_le_bytes());
        let mut s = &stream;
        s.write_all(&hello)
            .map_err(|e| hub_err(hub, format!("rank {rank}: sending the hello failed: {e}")))?;
        let mut ack = [0u8; 24];
        s.read_exact(&mut ack).map_err(|e| {
            hub_err(
                hub,
                format!("rank {rank}: no answer to the hello within {ACK_TIMEOUT:?}: {e}"),
            )
        })?;
        if ack[..8] != MAGIC {
            return Err(hub_err(
                hub,
                format!("rank {rank}: the answer to the hello is not from an all-reduce hub"),
            ));
        }
        let (status, hub_world) = (u64_at(&ack, 8), u64_at(&ack, 16));
        let refused = |why: String| {
            Err(AllReduceError::Config(format!(
                "the all-reduce hub at {hub} refused rank {rank}: {why}"
            )))
        };
        match status {
            ACK_OK => {}
            ACK_WRONG_WORLD => {
                return refused(format!(
                    "the hub has {hub_world} ranks, this rank's handle says {}",
                    handle.world_size
                ))
            }
            ACK_BAD_RANK => {
                return refused(format!("the ranks are 0..{hub_world}"));
            }
            ACK_DUPLICATE => {
                return refused(format!(
                    "rank {rank} is already connected (two workers given the same rank?)"
                ))
            }
            other => return refused(format!("unknown status {other}")),
        }
        stream
            .set_read_timeout(Some(handle.timeout))
            .map_err(setup)?;
        stream
            .set_write_timeout(Some(handle.timeout))
            .map_err(setup)?;
        Ok(TcpAllReduceGroup {
            rank,
            world_size: handle.world_size,
            hub: handle.addr.clone(),
            conn: Mutex::new(Conn {
                stream,
                buf: Vec::new(),
                broken: None,
            }),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The hub's address.
    pub fn hub(&self) -> &str {
        &self.hub
    }

    /// Replaces `data` with the element-wise sum of every rank's `data`
    /// (summed by the hub in rank order, so bit-identical on every rank and
    /// to the shared-memory group). Every rank must call it with the same
    /// length, in the same order.
    pub fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), AllReduceError> {
        let mut conn = lock(&self.conn);
        if let Some(rank) = conn.broken {
            return Err(AllReduceError::Broken { rank });
        }
        let total = data.len() as u64;
        let result = if data.is_empty() {
            self.round(&mut conn, total, &mut [])
        } else {
            data.chunks_mut(TCP_CHUNK_FLOATS)
                .try_for_each(|chunk| self.round(&mut conn, total, chunk))
        };
        if let Err(e) = &result {
            conn.broken = Some(match e {
                AllReduceError::Mismatch { rank, .. } | AllReduceError::Broken { rank } => *rank,
                AllReduceError::PeerDead { rank, .. } => *rank,
                _ => self.rank,
            });
            if matches!(e, AllReduceError::HubTimeout { .. }) {
                // Tell the hub this rank gives up, so it stops the others now.
                hang_up(&mut conn.stream, ABORT);
            }
            let _ = conn.stream.shutdown(Shutdown::Both);
        }
        result
    }

    /// One frame out, its sum back into `chunk`.
    fn round(&self, conn: &mut Conn, total: u64, chunk: &mut [f32]) -> Result<(), AllReduceError> {
        let Conn { stream, buf, .. } = conn;
        buf.resize(FRAME_HEADER + chunk.len() * 4, 0);
        buf[..8].copy_from_slice(&total.to_le_bytes());
        buf[8..16].copy_from_slice(&(chunk.len() as u64).to_le_bytes());
        for (b, v) in buf[FRAME_HEADER..].chunks_exact_mut(4).zip(chunk.iter()) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        let start = Instant::now();
        if let Err(e) = stream.write_all(buf) {
            // The hub may have said why it hung up before this rank wrote.
            let _ = stream.set_read_timeout(Some(REASON_WAIT));
            return Err(match self.read_status(stream, start) {
                Ok(REPLY_SUM) | Err(_) => self.disconnected(format!("sending a frame failed: {e}")),
                Ok(status) => self.read_failure(stream, status, total, chunk.len()),
            });
        }
        let status = self.read_status(stream, start)?;
        if status != REPLY_SUM {
            return Err(self.read_failure(stream, status, total, chunk.len()));
        }
        buf.resize(chunk.len() * 4, 0);
        stream
            .read_exact(buf)
            .map_err(|e| self.read_error(e, start))?;
        for (v, b) in chunk.iter_mut().zip(buf.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// The reply's status word.
    fn read_status(&self, stream: &mut TcpStream, start: Instant) -> Result<u64, AllReduceError> {
        read_u64(stream).map_err(|e| self.read_error(e, start))
    }

    /// The error a failure reply (`status` != sum) describes (or the error
    /// reading it).
    fn read_failure(
        &self,
        stream: &mut TcpStream,
        status: u64,
        total: u64,
        chunk: usize,
    ) -> AllReduceError {
        self.try_read_failure(stream, status, total, chunk)
            .unwrap_or_else(|e| e)
    }

    fn try_read_failure(
        &self,
        stream: &mut TcpStream,
        status: u64,
        total: u64,
        chunk: usize,
    ) -> Result<AllReduceError, AllReduceError> {
        let start = Instant::now();
        let io = |e| self.read_error(e, start);
        match status {
            REPLY_MISMATCH => {
                let mut shapes = vec![0u8; 16 * self.world_size];
                stream.read_exact(&mut shapes).map_err(io)?;
                let mine = (total, chunk as u64);
                let theirs = (0..self.world_size)
                    .map(|q| (q, (u64_at(&shapes, 16 * q), u64_at(&shapes, 16 * q + 8))))
                    .find(|&(_, shape)| shape != mine);
                Ok(match theirs {
                    Some((rank, (their_total, their_chunk))) => {
                        let (theirs, mine) = if their_total != total {
                            (their_total, total)
                        } else {
                            (their_chunk, chunk as u64)
                        };
                        AllReduceError::Mismatch {
                            rank,
                            theirs: theirs as usize,
                            me: self.rank,
                            mine: mine as usize,
                        }
                    }
                    None => self.protocol(
                        "a length mismatch, but every rank's length agrees with this one's".into(),
                    ),
                })
            }
            REPLY_DISCONNECTED => {
                let rank = read_u64(stream).map_err(io)?;
                let len = read_u64(stream).map_err(io)?;
                if len > MAX_DETAIL as u64 {
                    return Err(self.protocol(format!("a disconnect reason of {len} bytes")));
                }
                let mut detail = vec![0u8; len as usize];
                stream.read_exact(&mut detail).map_err(io)?;
                Ok(AllReduceError::Disconnected {
                    peer: format!(
                        "tensor-parallel rank {rank} (seen by the all-reduce hub at {})",
                        self.hub
                    ),
                    detail: format!(
                        "{}; rank {} cannot complete the step",
                        String::from_utf8_lossy(&detail),
                        self.rank
                    ),
                })
            }
            REPLY_ABORTED => {
                let rank = read_u64(stream).map_err(io)?;
                Ok(AllReduceError::Broken {
                    rank: rank as usize,
                })
            }
            other => Err(self.protocol(format!("unknown reply status {other}"))),
        }
    }

    fn read_error(&self, e: io::Error, start: Instant) -> AllReduceError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => AllReduceError::HubTimeout {
                me: self.rank,
                hub: self.hub.clone(),
                waited: start.elapsed(),
            },
            io::ErrorKind::UnexpectedEof => {
                self.disconnected("the hub closed the connection".into())
            }
            _ => self.disconnected(format!("reading from the hub failed: {e}")),
        }
    }

    fn disconnected(&self, detail: String) -> AllReduceError {
        AllReduceError::Disconnected {
            peer: format!("the all-reduce hub at {} or a peer rank", self.hub),
            detail: format!("{detail} (rank {}); the step cannot complete", self.rank),
        }
    }

    fn protocol(&self, detail: String) -> AllReduceError {
        hub_err(
            &self.hub,
            format!("rank {}: malformed reply: {detail}", self.rank),
        )
    }
}

impl Drop for TcpAllReduceGroup {
    /// Tells the hub this rank leaves (so the hub stops the other ranks
    /// without calling it a failure) and hangs up.
    fn drop(&mut self) {
        let conn = self.conn.get_mut().unwrap_or_else(|e| e.into_inner());
        if conn.broken.is_none() {
            hang_up(&mut conn.stream, LEAVE);
        }
        let _ = conn.stream.shutdown(Shutdown::Both);
    }
}

/// Best effort: sends the hang-up header `why` (abort or leave).
fn hang_up(stream: &mut TcpStream, why: u64) {
    let mut header = [0u8; FRAME_HEADER];
    header[..8].copy_from_slice(&ABORT.to_le_bytes());
    header[8..].copy_from_slice(&why.to_le_bytes());
    let _ = stream.set_write_timeout(Some(REASON_WAIT));
    let _ = stream.write_all(&header);
}

/// Connects to one of `addrs`, retrying until [`CONNECT_DEADLINE`].
fn connect_retrying(
    addrs: &[SocketAddr],
    hub: &str,
    rank: usize,
) -> Result<TcpStream, AllReduceError> {
    if addrs.is_empty() {
        return Err(hub_err(
            hub,
            format!("rank {rank}: the hub address resolves to nothing"),
        ));
    }
    let start = Instant::now();
    loop {
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(1)) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        if start.elapsed() >= CONNECT_DEADLINE {
            let e = last.map(|e| e.to_string()).unwrap_or_default();
            return Err(hub_err(
                hub,
                format!(
                    "rank {rank} cannot connect to the tensor-parallel all-reduce hub (tried for {:?}): {e}; \
                     check that the engine is running and this host can reach that address",
                    start.elapsed()
                ),
            ));
        }
        thread::sleep(CONNECT_RETRY);
    }
}
