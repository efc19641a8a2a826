//! Heap buffers aligned to cache lines, so SIMD loads of repacked weights
//! and quantized activations never straddle two lines.

/// One cache line; the unit of allocation of [`AlignedBytes`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A byte buffer whose start is 64-byte aligned.
#[derive(Clone, Default)]
pub(crate) struct AlignedBytes {
    /// Backing storage, rounded up to whole lines.
    lines: Vec<Line>,
    /// Bytes in use.
    len: usize,
}

impl AlignedBytes {
    /// A zero-filled buffer of `len` bytes.
    pub(crate) fn zeroed(len: usize) -> AlignedBytes {
        let mut b = AlignedBytes::default();
        b.resize(len);
        b
    }

    /// Makes the buffer `len` bytes long; it reallocates only when it grows
    /// past its capacity, so a reused scratch buffer stops allocating.
    pub(crate) fn resize(&mut self, len: usize) {
        let lines = len.div_ceil(64);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
    }

    /// The bytes in use.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialised bytes; `Line` is plain bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    /// The bytes in use, mutably.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
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
}
