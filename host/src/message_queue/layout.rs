//! The byte layout of a queue segment and safe views of its parts.
//!
//! ```text
//! [ Header | ChunkMeta 0 .. n-1 | pad to page | chunk 0 | chunk 1 | ... ]
//! ```
//! Every shared field is an atomic, so concurrent access from several
//! processes is never a data race; the chunk payloads are plain bytes whose
//! exclusive or shared use is granted by the flag protocol in `queue.rs`.
//! Nothing read from a segment is trusted: geometry is checked once on
//! attach against the mapping's real size, and every later read of a
//! length, kind or sequence number is checked before use (`queue.rs`).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

use shared_memory::{Shmem, ShmemConf};

use super::error::QueueError;
use super::wait::Doorbell;

/// Identifies a queue segment and its layout version (02: readers' start times).
pub const MAGIC: u64 = u64::from_le_bytes(*b"hostmq02");
/// The most readers one queue supports (one read flag per reader per chunk).
pub const MAX_READERS: usize = 64;
/// The most chunks one ring has.
pub const MAX_CHUNKS: usize = 1 << 16;
/// The largest chunk payload; larger messages overflow.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;
const PAGE: usize = 4096;

/// The segment's header. Geometry fields are written by the creator before
/// `magic` is stored with Release; an attacher checks `magic` with Acquire.
#[repr(C, align(64))]
pub struct Header {
    /// [`MAGIC`] once the header is initialised.
    pub magic: AtomicU64,
    /// Number of readers.
    pub n_readers: AtomicU32,
    /// Number of chunks in the ring.
    pub n_chunks: AtomicU32,
    /// Payload capacity of each chunk.
    pub max_chunk_bytes: AtomicU64,
    /// Writer pid and start time (see `process.rs`).
    pub owner_pid: AtomicU32,
    /// Writer start time.
    pub owner_start: AtomicU64,
    /// Non-zero once any party called `shutdown`.
    pub shutdown: AtomicU32,
    /// Bit r is set once reader r attached.
    pub attached: AtomicU64,
    /// Reader r's pid, stored (Release) after its start time; 0 until then.
    pub reader_pids: [AtomicU32; MAX_READERS],
    /// Reader r's start time, so that a reused pid does not pass for the reader.
    pub reader_starts: [AtomicU64; MAX_READERS],
    /// Rung by the writer after each message (and on shutdown); readers sleep on it.
    pub data_bell: Doorbell,
    /// Rung by readers after each read (and on attach/shutdown); the writer sleeps on it.
    pub space_bell: Doorbell,
}

/// Message payload lives in the chunk.
pub const KIND_INLINE: u32 = 0;
/// Message payload lives in its own overflow segment.
pub const KIND_OVERFLOW: u32 = 1;

/// Metadata of one chunk: its message on one cache line, the readers' flags
/// on the next, so readers polling for data and readers marking a chunk
/// read do not bounce the same line.
#[repr(C, align(64))]
pub struct ChunkMeta {
    /// The "written" flag, as a sequence number: `seq + 1` of the message
    /// in the chunk once it is published, 0 before the first message. A
    /// number instead of a bit means a reader can never mistake last lap's
    /// message for the one it waits for.
    pub written: AtomicU64,
    /// Payload length.
    pub len: AtomicU64,
    /// [`KIND_INLINE`] or [`KIND_OVERFLOW`].
    pub kind: AtomicU32,
    /// One read flag per reader: 1 once that reader is done with the chunk.
    pub read: ReadFlags,
}

/// The read flags, on their own cache line.
#[repr(C, align(64))]
pub struct ReadFlags(pub [AtomicU8; MAX_READERS]);

/// Byte offsets of the parts of a segment with a given geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Number of chunks.
    pub n_chunks: usize,
    /// Payload capacity of a chunk.
    pub max_chunk_bytes: usize,
}

impl Geometry {
    fn meta_offset() -> usize {
        std::mem::size_of::<Header>()
    }
    fn stride(&self) -> usize {
        self.max_chunk_bytes.next_multiple_of(64)
    }
    fn data_offset(&self) -> usize {
        (Self::meta_offset() + self.n_chunks * std::mem::size_of::<ChunkMeta>())
            .next_multiple_of(PAGE)
    }
    /// Total segment size, or `None` on overflow. Every arithmetic step is
    /// checked here, so `stride` and `data_offset` cannot overflow for a
    /// geometry that passed (every `Segment` holds one).
    pub fn total_bytes(&self) -> Option<usize> {
        let metas = self
            .n_chunks
            .checked_mul(std::mem::size_of::<ChunkMeta>())?
            .checked_add(Self::meta_offset())?
            .checked_next_multiple_of(PAGE)?;
        self.max_chunk_bytes
            .checked_next_multiple_of(64)?
            .checked_mul(self.n_chunks)?
            .checked_add(metas)
    }

    /// Checks a geometry that came from another process (a handle) against
    /// the limits every writer obeys; the error names the bad field.
    pub fn check_limits(&self) -> Result<(), String> {
        if !(1..=MAX_CHUNKS).contains(&self.n_chunks) {
            return Err(format!(
                "the handle says n_chunks = {}, a queue has 1..={MAX_CHUNKS}",
                self.n_chunks
            ));
        }
        if !(1..=MAX_CHUNK_BYTES).contains(&self.max_chunk_bytes) {
            return Err(format!(
                "the handle says max_chunk_bytes = {}, a chunk holds 1..={MAX_CHUNK_BYTES}",
                self.max_chunk_bytes
            ));
        }
        Ok(())
    }
}

/// A mapped queue segment.
pub struct Segment {
    shm: Shmem,
    geometry: Geometry,
}

// SAFETY: `Shmem` is only a mapping address, a length and an fd; nothing in it
// is tied to the creating thread, and all shared state behind it is atomic or
// guarded by the ring protocol.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates and maps a new zero-filled segment named `name`. The caller
    /// is responsible for unlinking the name (the crate's owner flag is off).
    pub fn create(name: &str, geometry: Geometry) -> Result<Segment, QueueError> {
        let size = geometry.total_bytes().ok_or_else(|| {
            QueueError::InvalidConfig(format!("{geometry:?} does not fit in the address space"))
        })?;
        let mut shm = ShmemConf::new()
            .os_id(name)
            .size(size)
            .create()
            .map_err(|e| shm_err(name, "create", e))?;
        shm.set_owner(false);
        Ok(Segment { shm, geometry })
    }

    /// Maps an existing segment and checks, before anything else reads it,
    /// that the mapping is large enough for `geometry` (from the handle) and
    /// that the header, once initialised, agrees with it and `n_readers`.
    /// Afterwards only the checked `geometry` is used, never the header's.
    pub fn open(name: &str, geometry: Geometry, n_readers: usize) -> Result<Segment, QueueError> {
        let corrupt = |what: String| QueueError::Corrupt {
            queue: name.to_string(),
            what,
        };
        let need = geometry.total_bytes().ok_or_else(|| {
            corrupt(format!(
                "the handle's geometry {geometry:?} does not fit in the address space; the handle is damaged"
            ))
        })?;
        let mut shm = ShmemConf::new()
            .os_id(name)
            .open()
            .map_err(|e| shm_err(name, "open", e))?;
        shm.set_owner(false);
        if shm.len() < need {
            return Err(corrupt(format!(
                "the segment has {} bytes but {} chunks of {} bytes need {need}; \
                 the handle does not describe this segment, or the writer is broken",
                shm.len(),
                geometry.n_chunks,
                geometry.max_chunk_bytes
            )));
        }
        let seg = Segment { shm, geometry };
        let h = seg.header();
        let magic = h.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(corrupt(format!(
                "the header's magic is {magic:#018x}, not {MAGIC:#018x}: the segment is not \
                 initialised or was made by a build with another layout; run the same build everywhere"
            )));
        }
        let fields = [
            (
                "n_readers",
                u64::from(h.n_readers.load(Ordering::Relaxed)),
                n_readers,
            ),
            (
                "n_chunks",
                u64::from(h.n_chunks.load(Ordering::Relaxed)),
                geometry.n_chunks,
            ),
            (
                "max_chunk_bytes",
                h.max_chunk_bytes.load(Ordering::Relaxed),
                geometry.max_chunk_bytes,
            ),
        ];
        for (field, found, want) in fields {
            if found != want as u64 {
                return Err(corrupt(format!(
                    "the header says {field} = {found} but the handle says {want}; \
                     the handle belongs to another queue, or the writer is broken or hostile"
                )));
            }
        }
        Ok(seg)
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        self.shm.get_os_id()
    }

    /// The geometry the segment was created or opened with.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The header.
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping is page aligned and at least `total_bytes` long
        // (checked at create / open), it is zero-filled or initialised, and
        // every field of `Header` is an atomic, valid for any bit pattern.
        unsafe { &*(self.shm.as_ptr() as *const Header) }
    }

    /// The metadata of chunk `i` (`i < n_chunks`).
    pub fn meta(&self, i: usize) -> &ChunkMeta {
        assert!(i < self.geometry.n_chunks);
        // SAFETY: as for `header`; the metadata array follows the header and
        // `ChunkMeta`'s alignment divides the header's size.
        unsafe { &*(self.shm.as_ptr().add(Geometry::meta_offset()) as *const ChunkMeta).add(i) }
    }

    /// A raw pointer to the payload area of chunk `i`, `max_chunk_bytes` long.
    /// Callers may only form slices over it as the ring protocol allows.
    pub fn chunk_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.geometry.n_chunks);
        // SAFETY: in bounds of the mapping by the geometry's arithmetic.
        unsafe {
            self.shm
                .as_ptr()
                .add(self.geometry.data_offset() + i * self.geometry.stride())
        }
    }
}

/// A plain mapping of an overflow segment (one large message).
pub struct Blob {
    shm: Shmem,
}

// SAFETY: as for `Segment`.
unsafe impl Send for Blob {}

/// Bytes before an overflow payload: a counter of readers that opened it.
pub const BLOB_HEADER: usize = 64;

impl Blob {
    /// Creates an overflow segment with room for `len` payload bytes.
    pub fn create(name: &str, len: usize) -> Result<Blob, QueueError> {
        let mut shm = ShmemConf::new()
            .os_id(name)
            .size(BLOB_HEADER + len)
            .create()
            .map_err(|e| shm_err(name, "create", e))?;
        shm.set_owner(false);
        Ok(Blob { shm })
    }

    /// Opens overflow segment `name` of queue `queue` and checks, against
    /// the mapping's real size, that it holds the `len` payload bytes the
    /// chunk claims.
    pub fn open(queue: &str, name: &str, len: usize) -> Result<Blob, QueueError> {
        let mut shm = ShmemConf::new()
            .os_id(name)
            .open()
            .map_err(|e| shm_err(name, "open", e))?;
        shm.set_owner(false);
        if BLOB_HEADER
            .checked_add(len)
            .is_none_or(|need| shm.len() < need)
        {
            return Err(QueueError::Corrupt {
                queue: queue.to_string(),
                what: format!(
                    "its chunk claims a {len}-byte overflow message but segment `{name}` \
                     holds {} bytes; the writer process is broken or hostile",
                    shm.len().saturating_sub(BLOB_HEADER)
                ),
            });
        }
        Ok(Blob { shm })
    }

    /// The number of readers that have opened this blob.
    pub fn opened(&self) -> &AtomicU32 {
        // SAFETY: the mapping is page aligned and at least BLOB_HEADER long.
        unsafe { &*(self.shm.as_ptr() as *const AtomicU32) }
    }

    /// A raw pointer to the payload (`len` bytes as created).
    pub fn payload_ptr(&self) -> *mut u8 {
        // SAFETY: in bounds, BLOB_HEADER < mapping length.
        unsafe { self.shm.as_ptr().add(BLOB_HEADER) }
    }
}

fn shm_err(name: &str, what: &'static str, e: shared_memory::ShmemError) -> QueueError {
    QueueError::Shm {
        name: name.to_string(),
        what,
        detail: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_do_not_overlap_and_are_aligned() {
        let g = Geometry {
            n_chunks: 3,
            max_chunk_bytes: 100,
        };
        assert_eq!(Geometry::meta_offset() % 64, 0);
        assert!(g.data_offset() >= Geometry::meta_offset() + 3 * std::mem::size_of::<ChunkMeta>());
        assert_eq!(g.data_offset() % PAGE, 0);
        assert_eq!(g.stride(), 128);
        assert_eq!(g.total_bytes(), Some(g.data_offset() + 3 * 128));
        assert_eq!(std::mem::size_of::<ChunkMeta>(), 128);
        assert_eq!(
            Geometry {
                n_chunks: usize::MAX,
                max_chunk_bytes: 1 << 20
            }
            .total_bytes(),
            None
        );
    }
}
