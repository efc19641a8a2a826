//! Run-time CPU feature detection: which kernel family to use.

/// True when the AVX2 + FMA + F16C kernels can run on this CPU.
///
/// `is_x86_feature_detected!` caches its answer, so this is a relaxed load.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Other architectures use the portable scalar kernels.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub(crate) fn has_avx2() -> bool {
    false
}
