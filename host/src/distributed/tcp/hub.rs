//! The hub of a TCP all-reduce group: the listener, the hello check, a
//! reader thread per rank, the sum in rank order and the replies.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::{
    check_params, hub_err, lock, u64_at, TcpAllReduceHandle, ABORT, ACK_BAD_RANK, ACK_DUPLICATE,
    ACK_OK, ACK_WRONG_WORLD, FRAME_HEADER, HELLO_BYTES, HELLO_TIMEOUT, LEAVE, MAGIC, MAX_DETAIL,
    REASON_WAIT, REPLY_ABORTED, REPLY_DISCONNECTED, REPLY_MISMATCH, REPLY_SUM, TCP_CHUNK_FLOATS,
};
use crate::distributed::all_reduce::AllReduceError;

/// How often the hub's accept loop checks whether the hub was dropped.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

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
        let addrs = crate::message_queue::net::bind_addrs(bind)
            .map_err(|e| hub_err(bind, format!("bad address: {e}")))?;
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
