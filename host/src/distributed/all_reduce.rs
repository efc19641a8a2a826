//! A sum all-reduce over one POSIX shared-memory segment, for ranks that
//! are processes (or threads) on one machine.
//!
//! ```text
//! [ Header | arrival 0 .. MAX_RANKS-1 | pad to page | buffer 0: slot per rank | buffer 1: slot per rank ]
//! ```
//! Round `g` (numbered from 1 on every rank, in the same order): rank `r`
//! copies its values into its slot of buffer `g % 2`, publishes `g` in its
//! arrival counter (Release), waits until every counter reaches `g`
//! (Acquire), then sums the slots **in rank order** into its own buffer, so
//! every rank gets bit-identical results whatever the timing. Two buffers
//! are enough: a rank writes buffer `g % 2` in round `g` only after seeing
//! every rank arrive at `g - 1`, and each rank finished reading round `g - 2`
//! (the buffer's previous use) before it arrived at `g - 1`.
//!
//! Waiting reuses the message queue's strategy (`message_queue::wait`):
//! spin with `sched_yield` briefly, then sleep on a futex in the segment,
//! which is what keeps TP = 3 usable on two cores. A wait ends with an error
//! when a peer process dies (its pid is probed every
//! [`RECHECK_INTERVAL`]), when the handle's timeout passes, or when another
//! rank failed: the first failure marks the group broken in the segment so
//! every rank stops instead of waiting for a round that will never come.
//!
//! Lifetime follows the message queue: the segment's name carries its
//! owner's pid and start time (swept if the owner dies), and the last rank
//! to attach unlinks it, so the kernel frees it with the last process.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shared_memory::{Shmem, ShmemConf};
use thiserror::Error;

use crate::message_queue::process::{self, ProcessId};
use crate::message_queue::wait::{wait_until, Doorbell, WaitEnd, RECHECK_INTERVAL};

/// The most ranks one group supports.
pub const MAX_RANKS: usize = 64;

/// Floats per rank slot (1 MiB): larger all-reduces run in several rounds.
/// A decode step of SmolLM2 reduces 576 floats per token, a 2048-token
/// prefill 1.2 M (five rounds); /dev/shm pages are only used once written.
pub const DEFAULT_SLOT_FLOATS: usize = 1 << 18;

/// How long a waiting rank spins (yielding) before it sleeps on the futex.
/// Shorter than the message queue's window: ranks arrive within the time
/// of one matmul of each other when the cores are free, and when they are
/// not (three ranks on two cores), spinning only steals the core from the
/// rank being waited for.
const SPIN_WINDOW: Duration = Duration::from_micros(50);

const MAGIC: u64 = u64::from_le_bytes(*b"hostar01");
const PAGE: usize = 4096;

/// Why an all-reduce (or setting up its group) failed.
#[derive(Debug, Error, PartialEq)]
pub enum AllReduceError {
    /// A peer process exited while the others waited for it.
    #[error("all-reduce: tensor-parallel rank {rank} (pid {pid}) died; the step cannot complete")]
    PeerDead {
        /// The dead rank.
        rank: usize,
        /// Its process id.
        pid: u32,
    },
    /// Peers did not arrive within the group's timeout.
    #[error(
        "all-reduce: rank {me} waited {waited:?} for tensor-parallel rank(s) {missing:?}, which never \
         arrived (stalled or still running another step); raise parallel.execute_model_timeout_s if \
         steps are legitimately this slow"
    )]
    Timeout {
        /// The waiting rank.
        me: usize,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// How long it waited.
        waited: Duration,
    },
    /// An earlier all-reduce failed; the ranks are out of step for good.
    #[error("all-reduce group is broken since rank {rank} failed an earlier all-reduce; restart the engine")]
    Broken {
        /// The rank blamed for the first failure.
        rank: usize,
    },
    /// Ranks contributed different lengths: they ran different steps.
    #[error("all-reduce: rank {rank} contributed {theirs} values but rank {me} {mine}; the ranks ran different steps")]
    Mismatch {
        /// The rank whose length differs.
        rank: usize,
        /// Its length.
        theirs: usize,
        /// The checking rank.
        me: usize,
        /// The checking rank's length.
        mine: usize,
    },
    /// The shared segment cannot be created, opened or trusted.
    #[error("all-reduce segment `{name}`: {detail}")]
    Segment {
        /// The segment's name.
        name: String,
        /// What went wrong.
        detail: String,
    },
    /// A TCP rank's sum did not come back from the hub within the timeout.
    #[error(
        "all-reduce: rank {me} waited {waited:?} for the sum from the all-reduce hub at {hub}; a peer \
         rank stalled or is still running another step, or the network is down; raise \
         parallel.execute_model_timeout_s if steps are legitimately this slow"
    )]
    HubTimeout {
        /// The waiting rank.
        me: usize,
        /// The hub's `host:port`.
        hub: String,
        /// How long it waited.
        waited: Duration,
    },
    /// A TCP connection of the group closed or broke.
    #[error("all-reduce over TCP: {peer} disconnected: {detail}")]
    Disconnected {
        /// Who went away: a rank (as the hub saw it) or the hub itself,
        /// with the hub's `host:port`.
        peer: String,
        /// What happened.
        detail: String,
    },
    /// The TCP hub cannot be started or reached, refused this rank, or
    /// spoke a protocol this rank does not understand.
    #[error("all-reduce hub at {hub}: {detail}")]
    Hub {
        /// The hub's address.
        hub: String,
        /// What went wrong.
        detail: String,
    },
    /// Bad group parameters (world size, rank, slot size).
    #[error("invalid all-reduce group: {0}")]
    Config(String),
}

/// What a rank needs to attach to a group; travels in the worker bootstrap.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllReduceHandle {
    /// POSIX shared-memory name (starts with `/`).
    pub name: String,
    /// Number of ranks.
    pub world_size: usize,
    /// Floats per rank slot.
    pub slot_floats: usize,
    /// How long a rank waits for its peers before failing the step.
    pub timeout: Duration,
}

/// The segment's header: written by the creator before `magic` (Release).
#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    world_size: AtomicU32,
    /// 0 while healthy; then `rank + 1` of the rank blamed for the first failure.
    failed: AtomicU32,
    slot_floats: AtomicU64,
    /// Bit r is set once rank r attached (after its pid is stored).
    attached: AtomicU64,
    pids: [AtomicU32; MAX_RANKS],
    start_times: [AtomicU64; MAX_RANKS],
    /// Rung after every arrival and on failure; waiting ranks sleep on it.
    bell: Doorbell,
}

/// A rank's arrival counter and the length it contributed to each buffer
/// (per buffer because a rank may start the next round while slower ranks
/// still check this one), on its own cache line.
#[repr(C, align(64))]
struct Arrival {
    round: AtomicU64,
    len: [AtomicU64; 2],
}

fn data_offset() -> usize {
    (std::mem::size_of::<Header>() + MAX_RANKS * std::mem::size_of::<Arrival>())
        .next_multiple_of(PAGE)
}

fn total_bytes(world_size: usize, slot_floats: usize) -> Option<usize> {
    (2 * world_size)
        .checked_mul(slot_floats)?
        .checked_mul(std::mem::size_of::<f32>())?
        .checked_add(data_offset())
}

/// A mapped segment.
struct Mapping {
    shm: Shmem,
    world_size: usize,
    slot_floats: usize,
}

// SAFETY: `Shmem` is a mapping address, a length and an fd, not tied to a
// thread; every shared field is atomic, and slot contents are only accessed
// as the round protocol grants (one writer per slot, readers after Acquire).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn header(&self) -> &Header {
        // SAFETY: the mapping is page aligned, at least `total_bytes` long
        // (checked on create and attach), and every field is an atomic, valid
        // for any bit pattern (the segment starts zero-filled).
        unsafe { &*(self.shm.as_ptr() as *const Header) }
    }

    fn arrival(&self, rank: usize) -> &Arrival {
        assert!(rank < MAX_RANKS);
        // SAFETY: as for `header`; the arrivals follow the header, whose size
        // is a multiple of `Arrival`'s alignment.
        unsafe {
            &*(self.shm.as_ptr().add(std::mem::size_of::<Header>()) as *const Arrival).add(rank)
        }
    }

    /// Rank `rank`'s slot in buffer `buf` (0 or 1), `slot_floats` long.
    fn slot(&self, buf: usize, rank: usize) -> *mut f32 {
        assert!(buf < 2 && rank < self.world_size);
        let index = buf * self.world_size + rank;
        // SAFETY: in bounds by `total_bytes`; the data area is page aligned.
        unsafe { (self.shm.as_ptr().add(data_offset()) as *mut f32).add(index * self.slot_floats) }
    }
}

fn segment_err(name: &str, detail: impl ToString) -> AllReduceError {
    AllReduceError::Segment {
        name: name.to_string(),
        detail: detail.to_string(),
    }
}

fn check_shape(world_size: usize, slot_floats: usize) -> Result<usize, AllReduceError> {
    if world_size == 0 || world_size > MAX_RANKS || slot_floats == 0 {
        return Err(AllReduceError::Config(format!(
            "world_size = {world_size}, slot_floats = {slot_floats}; use 1..={MAX_RANKS} ranks and at least one float"
        )));
    }
    total_bytes(world_size, slot_floats).ok_or_else(|| {
        AllReduceError::Config(format!(
            "{world_size} slots of {slot_floats} floats do not fit in the address space"
        ))
    })
}

/// The creator's end: makes the segment the ranks attach to, and unlinks
/// its name when dropped (if the last rank has not already).
pub struct AllReduceOwner {
    _map: Mapping,
    handle: AllReduceHandle,
}

impl AllReduceOwner {
    /// Creates a group of `world_size` ranks with slots of `slot_floats`
    /// floats; each wait for peers gives up after `timeout`.
    pub fn create(
        world_size: usize,
        slot_floats: usize,
        timeout: Duration,
    ) -> Result<AllReduceOwner, AllReduceError> {
        let size = check_shape(world_size, slot_floats)?;
        let owner = ProcessId::current();
        let name = process::fresh_name(owner);
        let mut shm = ShmemConf::new()
            .os_id(&name)
            .size(size)
            .create()
            .map_err(|e| segment_err(&name, format!("create: {e}")))?;
        shm.set_owner(false);
        let map = Mapping {
            shm,
            world_size,
            slot_floats,
        };
        let h = map.header();
        h.world_size.store(world_size as u32, Ordering::Relaxed);
        h.slot_floats.store(slot_floats as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(AllReduceOwner {
            _map: map,
            handle: AllReduceHandle {
                name,
                world_size,
                slot_floats,
                timeout,
            },
        })
    }

    /// The handle to send each rank.
    pub fn handle(&self) -> &AllReduceHandle {
        &self.handle
    }
}

impl Drop for AllReduceOwner {
    fn drop(&mut self) {
        process::unlink(&self.handle.name);
    }
}

/// One rank's end of a group. `Sync`: calls are serialised internally, so
/// a rank's rounds stay numbered in call order.
pub struct AllReduceGroup {
    map: Mapping,
    rank: usize,
    timeout: Duration,
    /// The last round this rank started.
    round: Mutex<u64>,
}

impl AllReduceGroup {
    /// Attaches as `rank`. Each rank attaches once; the last one unlinks the
    /// segment's name.
    pub fn attach(handle: &AllReduceHandle, rank: usize) -> Result<AllReduceGroup, AllReduceError> {
        let need = check_shape(handle.world_size, handle.slot_floats)?;
        if rank >= handle.world_size {
            return Err(AllReduceError::Config(format!(
                "rank {rank} does not exist; the ranks are 0..{}",
                handle.world_size
            )));
        }
        let name = &handle.name;
        let mut shm = ShmemConf::new()
            .os_id(name)
            .open()
            .map_err(|e| segment_err(name, format!("open: {e}")))?;
        shm.set_owner(false);
        if shm.len() < need {
            return Err(segment_err(
                name,
                format!("{} bytes, the handle needs {need}", shm.len()),
            ));
        }
        let map = Mapping {
            shm,
            world_size: handle.world_size,
            slot_floats: handle.slot_floats,
        };
        let h = map.header();
        let found = (
            h.magic.load(Ordering::Acquire),
            h.world_size.load(Ordering::Relaxed) as usize,
            h.slot_floats.load(Ordering::Relaxed) as usize,
        );
        if found != (MAGIC, handle.world_size, handle.slot_floats) {
            return Err(segment_err(
                name,
                format!(
                    "header (magic, world size, slot floats) = {found:?} disagrees with the handle"
                ),
            ));
        }
        let me = ProcessId::current();
        h.pids[rank].store(me.pid, Ordering::Relaxed);
        h.start_times[rank].store(me.start_time, Ordering::Relaxed);
        let bit = 1u64 << rank;
        let before = h.attached.fetch_or(bit, Ordering::AcqRel);
        if before & bit != 0 {
            return Err(AllReduceError::Config(format!(
                "rank {rank} attached twice to `{name}`"
            )));
        }
        let all = if handle.world_size == 64 {
            u64::MAX
        } else {
            (1u64 << handle.world_size) - 1
        };
        if before | bit == all {
            process::unlink(name);
        }
        Ok(AllReduceGroup {
            map,
            rank,
            timeout: handle.timeout,
            round: Mutex::new(0),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.map.world_size
    }

    /// Replaces `data` with the element-wise sum of every rank's `data`
    /// (summed in rank order, so bit-identical on every rank). Every rank
    /// must call it with the same length, in the same order.
    pub fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), AllReduceError> {
        let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
        let h = self.map.header();
        if let Some(rank) = self.failed_rank() {
            return Err(AllReduceError::Broken { rank });
        }
        for chunk in data.chunks_mut(self.map.slot_floats) {
            *round += 1;
            let g = *round;
            let buf = (g % 2) as usize;
            // SAFETY: this rank alone writes its slot, and no rank still reads
            // it (see the module docs); `chunk.len() <= slot_floats`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    self.map.slot(buf, self.rank),
                    chunk.len(),
                )
            };
            let mine = self.map.arrival(self.rank);
            mine.len[buf].store(chunk.len() as u64, Ordering::Relaxed);
            mine.round.store(g, Ordering::Release);
            h.bell.ring();
            if let Err(e) = self.wait_round(g) {
                if !matches!(e, AllReduceError::Broken { .. }) {
                    self.mark_failed(&e);
                }
                return Err(e);
            }
            self.sum_slots(buf, chunk)?;
        }
        Ok(())
    }

    /// Sums every rank's slot of `buf`, in rank order, into `out`.
    fn sum_slots(&self, buf: usize, out: &mut [f32]) -> Result<(), AllReduceError> {
        for q in 0..self.world_size() {
            let theirs = self.map.arrival(q).len[buf].load(Ordering::Relaxed) as usize;
            if theirs != out.len() {
                let e = AllReduceError::Mismatch {
                    rank: q,
                    theirs,
                    me: self.rank,
                    mine: out.len(),
                };
                self.mark_failed(&e);
                return Err(e);
            }
        }
        // SAFETY: every rank published this round (Acquire in `wait_round`)
        // and none writes its slot again before this rank arrives next round.
        let len = out.len();
        let slot = |q| unsafe { std::slice::from_raw_parts(self.map.slot(buf, q), len) };
        out.copy_from_slice(slot(0));
        for q in 1..self.world_size() {
            for (o, v) in out.iter_mut().zip(slot(q)) {
                *o += v;
            }
        }
        Ok(())
    }

    /// Waits until every rank has published round `g`.
    fn wait_round(&self, g: u64) -> Result<(), AllReduceError> {
        let h = self.map.header();
        let n = self.world_size();
        let arrived = |q: usize| self.map.arrival(q).round.load(Ordering::Acquire) >= g;
        let start = Instant::now();
        let mut last_probe = start;
        let mut dead = None;
        let waited = wait_until(
            &h.bell,
            SPIN_WINDOW,
            Some(self.timeout),
            || (0..n).all(arrived),
            || {
                if h.failed.load(Ordering::Acquire) != 0 {
                    return false;
                }
                // Probing /proc costs microseconds: only every recheck interval.
                if last_probe.elapsed() >= RECHECK_INTERVAL {
                    last_probe = Instant::now();
                    dead = (0..n)
                        .filter(|&q| !arrived(q))
                        .find_map(|q| self.dead_pid(q).map(|pid| (q, pid)));
                }
                dead.is_none()
            },
        );
        match waited {
            Ok(()) => Ok(()),
            Err(WaitEnd::Stopped) => match (dead, self.failed_rank()) {
                (Some((rank, pid)), _) => Err(AllReduceError::PeerDead { rank, pid }),
                // Stopped without a dead peer: another rank marked the failure.
                (None, failed) => Err(AllReduceError::Broken {
                    rank: failed.unwrap_or(self.rank),
                }),
            },
            Err(WaitEnd::TimedOut) => Err(AllReduceError::Timeout {
                me: self.rank,
                missing: (0..n).filter(|&q| !arrived(q)).collect(),
                waited: start.elapsed(),
            }),
        }
    }

    /// Rank `q`'s pid if it attached and its process is gone.
    fn dead_pid(&self, q: usize) -> Option<u32> {
        let h = self.map.header();
        let pid = h.pids[q].load(Ordering::Relaxed);
        let start_time = h.start_times[q].load(Ordering::Relaxed);
        (pid != 0 && !(ProcessId { pid, start_time }).is_alive()).then_some(pid)
    }

    /// The rank blamed for the group's first failure, if any.
    fn failed_rank(&self) -> Option<usize> {
        match self.map.header().failed.load(Ordering::Acquire) {
            0 => None,
            r => Some(r as usize - 1),
        }
    }

    /// Marks the group broken (first failure wins) and wakes every waiter.
    fn mark_failed(&self, e: &AllReduceError) {
        let blamed = match e {
            AllReduceError::PeerDead { rank, .. } | AllReduceError::Mismatch { rank, .. } => *rank,
            AllReduceError::Timeout { missing, .. } => {
                missing.first().copied().unwrap_or(self.rank)
            }
            _ => self.rank,
        };
        let h = self.map.header();
        let _ =
            h.failed
                .compare_exchange(0, blamed as u32 + 1, Ordering::AcqRel, Ordering::Acquire);
        h.bell.ring();
    }
}
