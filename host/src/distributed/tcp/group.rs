//! One rank's end of a TCP all-reduce group: connecting to the hub, the
//! all-reduce itself, and the errors a rank reports.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{
    check_params, hub_err, lock, read_u64, u64_at, TcpAllReduceHandle, ABORT, ACK_BAD_RANK,
    ACK_DUPLICATE, ACK_OK, ACK_TIMEOUT, ACK_WRONG_WORLD, FRAME_HEADER, HELLO_BYTES, LEAVE, MAGIC,
    MAX_DETAIL, REASON_WAIT, REPLY_ABORTED, REPLY_DISCONNECTED, REPLY_MISMATCH, REPLY_SUM,
    TCP_CHUNK_FLOATS,
};
use crate::distributed::all_reduce::AllReduceError;
use crate::message_queue::net::connect_retrying;

/// How long a rank keeps retrying to connect to the hub.
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

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
        if addrs.is_empty() {
            return Err(hub_err(
                hub,
                format!("rank {rank}: the hub address resolves to nothing"),
            ));
        }
        let stream = connect_retrying(&addrs[..], CONNECT_DEADLINE).map_err(|e| {
            hub_err(
                hub,
                format!(
                    "rank {rank} cannot connect to the tensor-parallel all-reduce hub (tried for \
                     {CONNECT_DEADLINE:?}): {e}; check that the engine is running and this host \
                     can reach that address"
                ),
            )
        })?;
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
