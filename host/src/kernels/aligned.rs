//! Heap buffers aligned to cache lines, so SIMD loads of repacked weights
//! and quantized activations never straddle two lines; the weights of a
//! model are then packed together onto huge pages ([`pack`]).

use std::sync::Arc;

use super::pages::Pages;
use crate::model::release_freed_heap;

/// One cache line; the unit of allocation of [`AlignedBytes`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A byte buffer whose start is 64-byte aligned.
#[derive(Clone, Default)]
pub(crate) struct AlignedBytes {
    /// Backing storage, rounded up to whole lines.
    lines: Lines,
    /// Bytes in use.
    len: usize,
}

/// Where the lines of an [`AlignedBytes`] live.
#[derive(Clone)]
enum Lines {
    /// In an allocation of its own.
    Own(Vec<Line>),
    /// `count` lines from `start` of an arena shared, read-only, with other
    /// buffers (see [`pack`]).
    Packed {
        arena: Arc<Pages<Line>>,
        start: usize,
        count: usize,
    },
}

impl Default for Lines {
    fn default() -> Lines {
        Lines::Own(Vec::new())
    }
}

impl AlignedBytes {
    /// A zero-filled buffer of `len` bytes.
    pub(crate) fn zeroed(len: usize) -> AlignedBytes {
        let mut b = AlignedBytes::default();
        b.resize(len);
        b
    }

    /// The lines it may use.
    fn lines(&self) -> &[Line] {
        match &self.lines {
            Lines::Own(lines) => lines,
            Lines::Packed {
                arena,
                start,
                count,
            } => &arena[*start..*start + *count],
        }
    }

    /// Its lines in an allocation of its own, copied out of its arena
    /// first if it was packed (the arena is shared).
    fn own_lines(&mut self) -> &mut Vec<Line> {
        if let Lines::Packed { .. } = self.lines {
            self.lines = Lines::Own(self.lines().to_vec());
        }
        match &mut self.lines {
            Lines::Own(lines) => lines,
            Lines::Packed { .. } => unreachable!("a packed buffer was just given its own lines"),
        }
    }

    /// Makes the buffer `len` bytes long; it reallocates only when it grows
    /// past its capacity, so a reused scratch buffer stops allocating.
    pub(crate) fn resize(&mut self, len: usize) {
        let lines = len.div_ceil(64);
        if lines > self.lines().len() {
            self.own_lines().resize(lines, Line([0; 64]));
        }
        self.len = len;
    }

    /// The bytes in use.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines()` holds at least `len` initialised bytes; `Line`
        // is plain bytes.
        unsafe { std::slice::from_raw_parts(self.lines().as_ptr().cast::<u8>(), self.len) }
    }

    /// The bytes in use, mutably.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        let lines = self.own_lines();
        // SAFETY: as in `as_slice`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// Bytes [`pack`] frees between two calls of [`release_freed_heap`]: each
/// call walks the heap, and a few dozen over a model are nothing beside its
/// load, while the peak stays within this of the weights' size.
const RELEASE_EVERY: usize = 4 << 20;

/// Moves `buffers` into one mapping of their total size on huge pages
/// ([`Pages`]), contents unchanged. For the weights of a model, read in
/// full for every decoded token: each matrix alone is too small for a
/// 2 MiB page, all of them together take a few dozen. Each buffer's own
/// allocation is freed as soon as it is copied, and the freed heap given
/// back every [`RELEASE_EVERY`] bytes, so the weights are held about once
/// meanwhile, not twice. Where the mapping is refused the buffers stay
/// where they are (only speed is lost).
pub(crate) fn pack(buffers: &mut [&mut AlignedBytes]) {
    let count = |b: &AlignedBytes| b.len.div_ceil(64);
    let total = buffers.iter().map(|b| count(b)).sum();
    // SAFETY: a `Line` is plain bytes, so all-zero bits are valid.
    let Ok(mut arena) = (unsafe { Pages::<Line>::zeroed(total) }) else {
        return;
    };
    let (mut at, mut freed) = (0, 0);
    for b in buffers.iter_mut() {
        arena[at..at + count(b)].copy_from_slice(&b.lines()[..count(b)]);
        at += count(b);
        b.lines = Lines::default();
        freed += b.len;
        if freed >= RELEASE_EVERY {
            release_freed_heap();
            freed = 0;
        }
    }
    release_freed_heap();
    let arena = Arc::new(arena);
    let mut start = 0;
    for b in buffers.iter_mut() {
        let count = count(b);
        b.lines = Lines::Packed {
            arena: Arc::clone(&arena),
            start,
            count,
        };
        start += count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_is_aligned_and_contents_survive_growth() {
        let mut b = AlignedBytes::zeroed(10);
        assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
        b.as_mut_slice().copy_from_slice(&[7; 10]);
        b.resize(1000);
        assert_eq!(b.as_slice().len(), 1000);
        assert_eq!(&b.as_slice()[..10], &[7; 10]);
        assert!(b.as_slice()[10..].iter().all(|&x| x == 0));
        assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
    }

    #[test]
    fn packing_keeps_contents_and_writes_stay_private() {
        let mut bufs: Vec<AlignedBytes> = [10, 64, 0, 1000]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let mut b = AlignedBytes::zeroed(len);
                for (j, x) in b.as_mut_slice().iter_mut().enumerate() {
                    *x = (i * 31 + j) as u8;
                }
                b
            })
            .collect();
        let before: Vec<Vec<u8>> = bufs.iter().map(|b| b.as_slice().to_vec()).collect();
        pack(&mut bufs.iter_mut().collect::<Vec<_>>());
        for (b, want) in bufs.iter().zip(&before) {
            assert!(matches!(b.lines, Lines::Packed { .. }));
            assert_eq!(b.as_slice(), &want[..]);
            assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
        }
        // A write copies the buffer out; its neighbours in the arena keep
        // their bytes.
        bufs[1].as_mut_slice().fill(0xEE);
        assert!(matches!(bufs[1].lines, Lines::Own(_)));
        assert_eq!(bufs[1].as_slice(), &[0xEE; 64]);
        for i in [0, 3] {
            assert_eq!(bufs[i].as_slice(), &before[i][..]);
        }
        bufs[3].resize(2000);
        assert_eq!(&bufs[3].as_slice()[..1000], &before[3][..]);
        assert!(bufs[3].as_slice()[1000..].iter().all(|&x| x == 0));
    }
}
