//! [`Pages`]: zeroed memory mapped straight from the kernel, on 2 MiB pages
//! where the system allows; the home of the weights and of the KV cache.
//!
//! Why huge pages: a decode reads every weight (~100 MB for SmolLM2) and,
//! at a long context, as much KV cache again, while the TLB reaches about
//! 12 MiB of 4 KiB pages, so nearly every page read is a page walk; the KV
//! tiles of one head even lie a block apart, a walk per 4 KiB tile. On
//! 2 MiB pages a few hundred entries cover it all.
//!
//! Why not the allocator: `alloc_zeroed` of a type aligned past 16 bytes
//! (a cache line) zero-fills the memory itself, which faults every page in
//! as a 4 KiB page before any advice can be given, and makes all of it
//! resident at once. A fresh anonymous mapping is zero by definition, is
//! backed only where written, and takes the advice before its first touch.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A transparent huge page of x86-64 (and of ARM64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// `len` values of `T` in a private anonymous mapping, zero until written.
/// Mappings of a huge page or more start on a huge-page boundary and, on
/// Linux, are marked for transparent huge pages (`madvise(MADV_HUGEPAGE)`,
/// which systems in THP mode `madvise`, the usual default, need); where
/// THP is off the advice is ignored and the pages stay 4 KiB.
pub(crate) struct Pages<T: Copy> {
    /// The first value (page-aligned, so aligned for any `T` up to 4 KiB).
    data: NonNull<T>,
    /// Values.
    len: usize,
    /// The whole mapping, for `munmap`.
    map: *mut libc::c_void,
    /// Its bytes.
    map_len: usize,
}

// SAFETY: `Pages` owns its mapping exclusively, like a `Vec`.
unsafe impl<T: Copy + Send> Send for Pages<T> {}
// SAFETY: shared access only reads, like a `Vec`'s.
unsafe impl<T: Copy + Sync> Sync for Pages<T> {}

impl<T: Copy> Pages<T> {
    /// Maps `len` zeroed values. Fails, saying why, when the size is zero
    /// or overflows, or the system refuses the mapping.
    ///
    /// # Safety
    /// All-zero bits must be a valid `T`.
    pub(crate) unsafe fn zeroed(len: usize) -> Result<Pages<T>, &'static str> {
        assert!(std::mem::align_of::<T>() <= 4096, "Pages aligns to 4 KiB");
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize - HUGE_PAGE)
            .ok_or("the size overflows the address space")?;
        if bytes == 0 {
            return Err("nothing to allocate: the size is zero");
        }
        // Room to slide the start to a huge-page boundary.
        let slack = if bytes >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let map_len = bytes + slack;
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err("the system cannot allocate that much memory");
        }
        let start = if slack == 0 {
            map as usize
        } else {
            (map as usize).next_multiple_of(HUGE_PAGE)
        };
        #[cfg(target_os = "linux")]
        if slack != 0 {
            // SAFETY: the range lies inside the mapping; the advice changes
            // how its pages are backed, never their contents. A failure
            // only costs speed.
            unsafe {
                libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
            }
        }
        Ok(Pages {
            // SAFETY: `mmap` succeeded, so the address is not null.
            data: unsafe { NonNull::new_unchecked(start as *mut T) },
            len,
            map,
            map_len,
        })
    }
}

impl<T: Copy> Deref for Pages<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` values, zero-initialised (valid, the creator
        // promised) or written since, inside the live mapping.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for Pages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }
}

impl<T: Copy> Drop for Pages<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing borrows it any more; the
        // values are `Copy`, so nothing needs dropping first.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_aligned() {
        for len in [1, 1000, HUGE_PAGE / 4 + 3] {
            // SAFETY: zero bits are a valid f32 (0.0).
            let mut p = unsafe { Pages::<f32>::zeroed(len) }.unwrap();
            assert_eq!(p.len(), len);
            assert!(p.iter().all(|&x| x == 0.0));
            p[len - 1] = 7.0;
            assert_eq!(p[len - 1], 7.0);
            let huge = len * 4 >= HUGE_PAGE;
            let align = if huge { HUGE_PAGE } else { 4096 };
            assert_eq!(p.as_ptr() as usize % align, 0, "len {len}");
        }
    }

    #[test]
    fn refuses_zero_and_overflowing_sizes() {
        // SAFETY: zero bits are a valid u64.
        let zero = unsafe { Pages::<u64>::zeroed(0) };
        assert!(zero.err().unwrap().contains("zero"));
        // SAFETY: as above.
        let huge = unsafe { Pages::<u64>::zeroed(usize::MAX / 4) };
        assert!(huge.err().unwrap().contains("overflows"));
    }
}
