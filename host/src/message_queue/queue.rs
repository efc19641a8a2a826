//! The ring protocol: one writer, N readers, one written flag (a sequence
//! number) and one read flag per reader in every chunk.
//!
//! Writer, message `seq` into chunk `seq % n_chunks`:
//! 1. wait until every read flag of the chunk is 1 (Acquire): all readers
//!    are done with the previous message there, so the chunk is ours;
//! 2. write the payload (or an overflow segment), its length and kind;
//! 3. clear the read flags (Relaxed), then store `written = seq + 1`
//!    (Release), which publishes steps 2–3 to any reader that sees it;
//! 4. ring the data doorbell (a syscall only if a reader sleeps).
//!
//! Reader, message `seq`: wait until `written == seq + 1` (Acquire), read the
//! payload, store its read flag = 1 (Release), ring the space doorbell.
//! Because `written` is a sequence number, a reader never mistakes the
//! previous lap's message for its own. `model.rs` checks these steps over
//! every interleaving.
//!
//! Another process can write anything into the segment, so every value read
//! from it is checked before use, at the cost of a compare each: a length
//! against the chunk or the overflow mapping, a kind against the two kinds,
//! a sequence number against the only two values the protocol allows, a
//! pid against the range of pids. A bad one is [`QueueError::Corrupt`].
//!
//! This is the shared-memory half of a queue; `endpoint.rs` pairs it with
//! the TCP transport for remote readers behind [`super::MessageQueue`].

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::codec;
use super::error::{QueueError, ReaderLag};
use super::handle::{Handle, ShmHandle};
use super::layout::{Blob, Geometry, Segment, KIND_INLINE, KIND_OVERFLOW, MAGIC, MAX_READERS};
use super::process::{self, ProcessId};
use super::wait::{wait_until, WaitEnd};
use super::QueueConfig;

/// Which end of the queue this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Writer,
    /// A reader; `slot` indexes its read flags.
    Reader {
        rank: usize,
        slot: usize,
    },
}

/// One end of a shared-memory broadcast ring: the single writer, or one of
/// its local readers. Every message the writer enqueues reaches every reader
/// once, in order. `Send` but not `Sync`: each end belongs to one thread at
/// a time.
pub struct ShmQueue {
    seg: Segment,
    role: Role,
    /// The number of readers of the ring (the local ones).
    n_readers: usize,
    /// The rank of each read-flag slot, so that errors name ranks, not slots.
    ranks: Vec<usize>,
    owner: ProcessId,
    spin_window: Duration,
    /// The next message to write (writer) or read (reader).
    next: Cell<u64>,
}

impl ShmQueue {
    /// Creates a ring read by `ranks` (slot `i` belongs to `ranks[i]`) and
    /// returns its writer end. Also unlinks segments left in `/dev/shm` by
    /// queue owners that died.
    pub fn new_writer(ranks: Vec<usize>, config: QueueConfig) -> Result<ShmQueue, QueueError> {
        let n_readers = ranks.len();
        config.validate()?;
        if n_readers == 0 || n_readers > MAX_READERS {
            return Err(QueueError::InvalidConfig(format!(
                "n_readers = {n_readers}; use 1..={MAX_READERS}"
            )));
        }
        process::sweep_dead_owners();
        let owner = ProcessId::current();
        let geometry = Geometry {
            n_chunks: config.n_chunks,
            max_chunk_bytes: config.max_chunk_bytes,
        };
        let seg = Segment::create(&process::fresh_name(owner), geometry)?;
        let h = seg.header();
        h.n_readers.store(n_readers as u32, Ordering::Relaxed);
        h.n_chunks.store(config.n_chunks as u32, Ordering::Relaxed);
        h.max_chunk_bytes
            .store(config.max_chunk_bytes as u64, Ordering::Relaxed);
        h.owner_pid.store(owner.pid, Ordering::Relaxed);
        h.owner_start.store(owner.start_time, Ordering::Relaxed);
        for i in 0..config.n_chunks {
            // A never-written chunk counts as read by everyone, so it is free.
            seg.meta(i).read.0[..n_readers]
                .iter()
                .for_each(|f| f.store(1, Ordering::Relaxed));
        }
        h.magic.store(MAGIC, Ordering::Release);
        Ok(ShmQueue {
            seg,
            role: Role::Writer,
            n_readers,
            ranks,
            owner,
            spin_window: config.spin_window,
            next: Cell::new(0),
        })
    }

    /// The segment's part of the handle that readers attach with.
    pub fn shm_handle(&self) -> ShmHandle {
        let g = self.seg.geometry();
        ShmHandle {
            name: self.seg.name().to_string(),
            n_chunks: g.n_chunks,
            max_chunk_bytes: g.max_chunk_bytes,
            owner_pid: self.owner.pid,
            owner_start_time: self.owner.start_time,
        }
    }

    /// The ranks that read the ring, in slot order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Attaches reader `rank` to the ring that `handle` describes (the
    /// caller checked the handle's version). Each rank attaches once; the
    /// last one to attach unlinks the segment's name, so the kernel frees it
    /// when the last process exits, even on a crash.
    pub fn create_from_handle(handle: &Handle, rank: usize) -> Result<ShmQueue, QueueError> {
        let Some(slot) = handle.local_reader_ranks.iter().position(|&r| r == rank) else {
            return Err(QueueError::BadRank {
                rank,
                local: handle.local_reader_ranks.clone(),
            });
        };
        let shm = handle.shm.as_ref().ok_or_else(|| {
            QueueError::Unsupported("handle has local ranks but no segment".into())
        })?;
        let corrupt = |what: String| QueueError::Corrupt {
            queue: shm.name.clone(),
            what: format!("{what}; the handle was damaged or made by another build"),
        };
        let n_local = handle.local_reader_ranks.len();
        // `slot` indexes arrays of MAX_READERS and bits of a u64.
        if n_local > MAX_READERS {
            return Err(corrupt(format!(
                "the handle lists {n_local} local reader ranks, a queue has at most {MAX_READERS}"
            )));
        }
        let owner = ProcessId {
            pid: shm.owner_pid,
            start_time: shm.owner_start_time,
        };
        let geometry = Geometry {
            n_chunks: shm.n_chunks,
            max_chunk_bytes: shm.max_chunk_bytes,
        };
        geometry.check_limits().map_err(corrupt)?;
        let seg = match Segment::open(&shm.name, geometry, n_local) {
            Err(QueueError::Shm { .. }) if !owner.is_alive() => {
                process::unlink_with_prefix(&shm.name);
                return Err(QueueError::WriterDead { pid: owner.pid });
            }
            r => r?,
        };
        if !owner.is_alive() {
            process::unlink_with_prefix(&shm.name);
            return Err(QueueError::WriterDead { pid: owner.pid });
        }
        let h = seg.header();
        let bit = 1u64 << slot;
        let all = all_bits(n_local);
        let me = ProcessId::current();
        let before = h.attached.fetch_or(bit, Ordering::AcqRel);
        if before & bit != 0 {
            return Err(QueueError::AlreadyAttached {
                rank,
                pid: h.reader_pids[slot].load(Ordering::Relaxed),
            });
        }
        // The pid goes last (Release): whoever sees it sees the start time.
        h.reader_starts[slot].store(me.start_time, Ordering::Relaxed);
        h.reader_pids[slot].store(me.pid, Ordering::Release);
        // Bits beyond the readers mean nothing (a peer may have set them).
        if (before | bit) & all == all {
            process::unlink(&shm.name);
        }
        h.space_bell.ring();
        let role = Role::Reader { rank, slot };
        Ok(ShmQueue {
            seg,
            role,
            n_readers: n_local,
            ranks: handle.local_reader_ranks.clone(),
            owner,
            spin_window: QueueConfig::default().spin_window,
            next: Cell::new(0),
        })
    }

    /// Sets how long a wait spins (yielding) before it sleeps on the futex.
    pub fn set_spin_window(&mut self, window: Duration) {
        self.spin_window = window;
    }

    /// The reader's rank, or `None` for the writer.
    pub fn rank(&self) -> Option<usize> {
        match self.role {
            Role::Writer => None,
            Role::Reader { rank, .. } => Some(rank),
        }
    }

    /// Writer: waits until every reader has attached (then the segment's name
    /// is gone from `/dev/shm`). Readers return at once.
    pub fn wait_until_ready(&self, timeout: Duration) -> Result<(), QueueError> {
        if self.role != Role::Writer {
            return Ok(());
        }
        let h = self.seg.header();
        let all = all_bits(self.n_readers);
        let attached = || h.attached.load(Ordering::Acquire) & all == all;
        match wait_until(
            &h.space_bell,
            self.spin_window,
            Some(timeout),
            attached,
            || !self.is_shut_down(),
        ) {
            Ok(()) => {
                process::unlink(self.seg.name());
                Ok(())
            }
            Err(_) if self.is_shut_down() => Err(QueueError::Shutdown),
            Err(_) => {
                let mask = h.attached.load(Ordering::Acquire);
                let missing = (0..self.n_readers)
                    .filter(|slot| mask & (1 << slot) == 0)
                    .map(|slot| self.ranks[slot])
                    .collect();
                Err(QueueError::NotReady {
                    missing,
                    waited: timeout,
                    rejected: Vec::new(),
                })
            }
        }
    }

    /// Sends a message of `len` bytes that `fill` writes in place (into the
    /// ring, or into an overflow segment if `len` exceeds a chunk): the
    /// payload is written exactly once. `timeout = None` waits for space
    /// for as long as the readers live. Once the message is published,
    /// `forward` gets its bytes (to send them on to TCP readers without a copy).
    pub fn enqueue_with(
        &self,
        len: usize,
        timeout: Option<Duration>,
        fill: impl FnOnce(&mut [u8]),
        forward: impl FnOnce(&[u8]) -> Result<(), QueueError>,
    ) -> Result<(), QueueError> {
        let chunk = self.acquire_write(timeout)?;
        if len <= self.seg.geometry().max_chunk_bytes {
            // SAFETY: `acquire_write` saw every read flag of the chunk set
            // (Acquire), so no reader uses it until `commit` publishes it, and
            // this is the only writer (the writer end is unique and !Sync).
            fill(unsafe { std::slice::from_raw_parts_mut(self.seg.chunk_ptr(chunk), len) });
            self.commit(chunk, len, KIND_INLINE);
            // SAFETY: after `commit` readers only read the chunk, and only this
            // writer rewrites it, in a later enqueue.
            forward(unsafe { std::slice::from_raw_parts(self.seg.chunk_ptr(chunk), len) })
        } else {
            let blob = Blob::create(
                &process::overflow_name(self.seg.name(), self.next.get()),
                len,
            )?;
            // SAFETY: the blob was just created by us and is unknown to readers
            // until `commit` publishes its message.
            fill(unsafe { std::slice::from_raw_parts_mut(blob.payload_ptr(), len) });
            self.commit(chunk, len, KIND_OVERFLOW);
            // SAFETY: a published blob is never written again.
            forward(unsafe { std::slice::from_raw_parts(blob.payload_ptr(), len) })
        }
    }

    /// Sends a serde value, encoded straight into the ring (one pass) or,
    /// when it does not fit a chunk, sized and encoded into an overflow
    /// segment; then hands the published bytes to `forward`, as `enqueue_with`.
    pub fn enqueue<T: Serialize + ?Sized>(
        &self,
        msg: &T,
        timeout: Option<Duration>,
        forward: impl FnOnce(&[u8]) -> Result<(), QueueError>,
    ) -> Result<(), QueueError> {
        let chunk = self.acquire_write(timeout)?;
        let cap = self.seg.geometry().max_chunk_bytes;
        // SAFETY: as in `enqueue_with`; the whole chunk is ours until `commit`.
        let buf = unsafe { std::slice::from_raw_parts_mut(self.seg.chunk_ptr(chunk), cap) };
        if let Some(len) = codec::encode_into(msg, buf)? {
            self.commit(chunk, len, KIND_INLINE);
            // SAFETY: as in `enqueue_with`, after `commit`.
            return forward(unsafe { std::slice::from_raw_parts(self.seg.chunk_ptr(chunk), len) });
        }
        let len = codec::encoded_len(msg)?;
        let name = process::overflow_name(self.seg.name(), self.next.get());
        let blob = Blob::create(&name, len)?;
        // SAFETY: as in `enqueue_with`.
        let buf = unsafe { std::slice::from_raw_parts_mut(blob.payload_ptr(), len) };
        if codec::encode_into(msg, buf)? != Some(len) {
            process::unlink(&name);
            return Err(QueueError::Encode(
                "the value serialised to a different length on the second pass".into(),
            ));
        }
        self.commit(chunk, len, KIND_OVERFLOW);
        // SAFETY: as in `enqueue_with`, after `commit`.
        forward(unsafe { std::slice::from_raw_parts(blob.payload_ptr(), len) })
    }

    /// Receives the next message and passes its bytes to `f` without copying
    /// them; the chunk is released when `f` returns.
    pub fn dequeue_with<R>(
        &self,
        timeout: Option<Duration>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, QueueError> {
        let Role::Reader { slot, rank } = self.role else {
            return Err(QueueError::WrongRole(
                "dequeue called on the writer end of a message queue",
            ));
        };
        let seq = self.next.get();
        let chunk = self.chunk_of(seq);
        let meta = self.seg.meta(chunk);
        let h = self.seg.header();
        let n_chunks = self.seg.geometry().n_chunks as u64;
        // Until message `seq` is published the chunk holds the previous
        // lap's (or nothing, 0); any change means ours arrived, or the
        // number went backwards or skipped ahead, which is caught below
        // instead of waited on.
        let previous = (seq + 1).saturating_sub(n_chunks);
        let ready = || meta.written.load(Ordering::Acquire) != previous;
        let live = || !self.is_shut_down() && self.owner.is_alive();
        let started = Instant::now();
        if wait_until(&h.data_bell, self.spin_window, timeout, ready, live).is_err() && !ready() {
            if self.is_shut_down() {
                return Err(QueueError::Shutdown);
            }
            if !self.owner.is_alive() {
                process::unlink_with_prefix(self.seg.name());
                return Err(QueueError::WriterDead {
                    pid: self.owner.pid,
                });
            }
            return Err(QueueError::Timeout {
                rank,
                seq,
                waited: started.elapsed(),
                writer_pid: self.owner.pid,
            });
        }
        let written = meta.written.load(Ordering::Acquire);
        if written != seq + 1 {
            return Err(self.corrupt(format!(
                "chunk {chunk}'s sequence number is {written} where reader {rank} expects \
                 {} (message {seq}) or, until it is sent, {previous}: it went backwards or \
                 skipped ahead further than a ring of {n_chunks} chunks allows; {WRITER_AT_FAULT}",
                seq + 1
            )));
        }
        let claimed = meta.len.load(Ordering::Relaxed);
        let cap = self.seg.geometry().max_chunk_bytes;
        let out = match meta.kind.load(Ordering::Relaxed) {
            KIND_INLINE => {
                let len = usize::try_from(claimed)
                    .ok()
                    .filter(|&len| len <= cap)
                    .ok_or_else(|| {
                        self.corrupt(format!(
                            "chunk {chunk} claims {claimed} bytes but a chunk holds {cap}; {WRITER_AT_FAULT}"
                        ))
                    })?;
                // SAFETY: `written == seq + 1` was read with Acquire, so the
                // payload is complete; `len` is within the chunk; the writer
                // does not touch the chunk until our read flag is set below.
                f(unsafe { std::slice::from_raw_parts(self.seg.chunk_ptr(chunk), len) })
            }
            KIND_OVERFLOW => {
                let len = usize::try_from(claimed).map_err(|_| {
                    self.corrupt(format!(
                        "chunk {chunk} claims a {claimed}-byte overflow message, more than \
                         this machine addresses; {WRITER_AT_FAULT}"
                    ))
                })?;
                let name = process::overflow_name(self.seg.name(), seq);
                let blob = Blob::open(self.seg.name(), &name, len).map_err(|e| {
                    if self.is_shut_down() {
                        QueueError::Shutdown
                    } else {
                        e
                    }
                })?;
                // Compared before the increment, so a garbage count cannot overflow.
                let last = (self.n_readers - 1) as u32;
                if blob.opened().fetch_add(1, Ordering::AcqRel) == last {
                    process::unlink(&name);
                }
                // SAFETY: `Blob::open` checked that the mapping holds `len`
                // payload bytes; the writer finished the blob before
                // publishing it and never writes it again.
                f(unsafe { std::slice::from_raw_parts(blob.payload_ptr(), len) })
            }
            kind => {
                return Err(self.corrupt(format!(
                    "chunk {chunk} has kind {kind}, neither inline ({KIND_INLINE}) nor \
                     overflow ({KIND_OVERFLOW}); {WRITER_AT_FAULT}"
                )))
            }
        };
        meta.read.0[slot].store(1, Ordering::Release);
        self.next.set(seq + 1);
        h.space_bell.ring();
        Ok(out)
    }

    /// Shuts the queue down for every party and wakes all of them. Readers
    /// still receive the messages already in the ring, then
    /// [`QueueError::Shutdown`]; the writer's enqueues fail.
    pub fn shutdown(&self) {
        let h = self.seg.header();
        h.shutdown.store(1, Ordering::SeqCst);
        h.data_bell.ring();
        h.space_bell.ring();
    }

    /// The error for a value in the segment that the protocol forbids.
    fn corrupt(&self, what: String) -> QueueError {
        QueueError::Corrupt {
            queue: self.seg.name().to_string(),
            what,
        }
    }

    fn is_shut_down(&self) -> bool {
        self.seg.header().shutdown.load(Ordering::SeqCst) != 0
    }

    fn chunk_of(&self, seq: u64) -> usize {
        (seq % self.seg.geometry().n_chunks as u64) as usize
    }

    /// Waits until the chunk for the next message is free, and frees the
    /// overflow segment of the message it held.
    fn acquire_write(&self, timeout: Option<Duration>) -> Result<usize, QueueError> {
        if self.role != Role::Writer {
            return Err(QueueError::WrongRole(
                "enqueue called on a reader end of a message queue",
            ));
        }
        if self.is_shut_down() {
            return Err(QueueError::Shutdown);
        }
        let seq = self.next.get();
        let chunk = self.chunk_of(seq);
        let chunks = self.seg.geometry().n_chunks;
        let meta = self.seg.meta(chunk);
        let flags = &meta.read.0[..self.n_readers];
        let free = || flags.iter().all(|f| f.load(Ordering::Acquire) == 1);
        let lagging = || -> Vec<ReaderLag> {
            let h = self.seg.header();
            let attached = h.attached.load(Ordering::Acquire);
            (0..self.n_readers)
                .filter(|&r| flags[r].load(Ordering::Acquire) != 1)
                .map(|r| {
                    // A pid of 0: attached, but its pid is not stored yet.
                    let pid = h.reader_pids[r].load(Ordering::Acquire);
                    let pid = (attached & (1 << r) != 0 && pid != 0).then_some(pid);
                    let alive = pid.is_none_or(|pid| {
                        let start_time = h.reader_starts[r].load(Ordering::Relaxed);
                        ProcessId { pid, start_time }.is_alive()
                    });
                    ReaderLag {
                        rank: self.ranks[r],
                        pid,
                        alive,
                    }
                })
                .collect()
        };
        let live = || !self.is_shut_down() && lagging().iter().all(|l| l.alive);
        let started = Instant::now();
        match wait_until(
            &self.seg.header().space_bell,
            self.spin_window,
            timeout,
            free,
            live,
        ) {
            Ok(()) => {}
            Err(_) if free() => {}
            Err(end) => {
                if self.is_shut_down() {
                    return Err(QueueError::Shutdown);
                }
                debug_assert!(matches!(end, WaitEnd::TimedOut | WaitEnd::Stopped));
                let behind = lagging();
                let Some(oldest) = seq.checked_sub(chunks as u64) else {
                    return Err(self.corrupt(format!(
                        "the read flags of chunk {chunk} say {} still read a message there, \
                         but none was ever written to it; those reader processes are broken or hostile",
                        behind.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
                    )));
                };
                return Err(QueueError::Full {
                    seq,
                    waited: started.elapsed(),
                    chunks,
                    oldest,
                    behind,
                });
            }
        }
        // The chunk's last message is known here, not read from the segment.
        if let Some(previous) = seq.checked_sub(chunks as u64) {
            if meta.kind.load(Ordering::Relaxed) == KIND_OVERFLOW {
                process::unlink(&process::overflow_name(self.seg.name(), previous));
            }
        }
        Ok(chunk)
    }

    /// Publishes the next message, written into `chunk`.
    fn commit(&self, chunk: usize, len: usize, kind: u32) {
        let seq = self.next.get();
        let meta = self.seg.meta(chunk);
        meta.len.store(len as u64, Ordering::Relaxed);
        meta.kind.store(kind, Ordering::Relaxed);
        meta.read.0[..self.n_readers]
            .iter()
            .for_each(|f| f.store(0, Ordering::Relaxed));
        meta.written.store(seq + 1, Ordering::Release);
        self.next.set(seq + 1);
        self.seg.header().data_bell.ring();
    }
}

impl Drop for ShmQueue {
    /// The writer shuts the queue down and unlinks its names (the main
    /// segment, if a reader never attached, and unread overflow segments).
    /// A reader that finds the writer dead unlinks whatever it left.
    fn drop(&mut self) {
        if self.role == Role::Writer {
            self.shutdown();
            process::unlink_with_prefix(self.seg.name());
        } else if !self.owner.is_alive() {
            process::unlink_with_prefix(self.seg.name());
        }
    }
}

#[cfg(test)]
impl ShmQueue {
    /// The mapped segment, for tests that write into it as a hostile peer would.
    pub(super) fn segment(&self) -> &Segment {
        &self.seg
    }
}

/// The end of a [`QueueError::Corrupt`] message about a value only the writer writes.
const WRITER_AT_FAULT: &str = "the writer process is broken or hostile";

fn all_bits(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}
