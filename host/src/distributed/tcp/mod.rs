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
//!
//! The hub lives in `hub.rs`, a rank's end in `group.rs`; this module holds
//! the wire constants, the handle and the helpers both sides share.

mod group;
mod hub;

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::all_reduce::{AllReduceError, MAX_RANKS};

pub use group::TcpAllReduceGroup;
pub use hub::TcpAllReduceHub;

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
