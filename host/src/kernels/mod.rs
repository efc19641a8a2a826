//! CPU compute kernels and the thread pool they run on: the performance
//! core of the CPU model runner.
//!
//! - [`matmul`] multiplies a [`WeightMatrix`] (repacked at load time) by a
//!   batch of activation rows. Quantized weights use fused integer
//!   dequantize-dot kernels at every batch size, which keeps each token's
//!   result independent of its batch (see [`MatmulPath::Auto`]); float
//!   weights, kept from load in 16-row panels of their own type, run a
//!   register-blocked FMA microkernel over the whole batch, one fused
//!   chain per output whatever the batch or the family.
//! - [`rms_norm`], [`silu_mul`], [`softmax_parts`], [`dot`], [`axpy`] and
//!   [`RopeTable`] are the per-row pieces of a llama block; [`swiglu`]
//!   runs the MLP's activation over a batch of rows on the pool.
//! - [`ThreadPool`] runs a parallel section on all cores with ~0.25 µs
//!   overhead while busy (two vCPUs) and 0% CPU while idle.
//! - [`pack_weights`] moves a model's repacked matrices onto huge pages,
//!   where the KV cache lives too (`Pages`): a decode reads both in full.
//!
//! x86-64 CPUs with AVX2 + FMA + F16C get SIMD versions, and those with
//! AVX-512 VNNI (or AVX-VNNI) too get `vpdpbusd` versions of the quantized
//! matmuls, and those with AMX int8 tiles an AMX version for batches of 16
//! tokens or more, chosen at run time ([`CpuKernels`]; `HOST_CPU_KERNELS`
//! forces a family); every
//! other CPU runs the portable scalar versions, which are also the
//! references the SIMD versions are tested against. The quantized matmuls
//! give bit-identical results on every family.

mod aligned;
mod cpu;
mod float_panels;
mod gemm;
#[cfg(target_arch = "x86_64")]
mod gemm_amx;
mod gemv;
#[cfg(target_arch = "x86_64")]
mod gemv_avx2;
#[cfg(target_arch = "x86_64")]
mod gemv_simd;
#[cfg(target_arch = "x86_64")]
mod gemv_x16_avx512;
#[cfg(target_arch = "x86_64")]
mod gemv_x8_avx2;
#[cfg(target_arch = "x86_64")]
mod group_tiles;
mod interleaved;
mod kv_elem;
mod matmul;
mod pages;
mod pool;
mod quant;
mod rope;
mod swiglu;
#[cfg(test)]
mod testutil;
mod tiles;
mod vector;
#[cfg(target_arch = "x86_64")]
mod vector_avx512;
mod weights;

pub use cpu::{cpu_description, CpuKernels, KERNELS_ENV};
pub use kv_elem::KvElem;
pub use matmul::{matmul, matmul_on, matmul_with, MatmulPath};
pub(crate) use pages::Pages;
pub use pool::{ThreadPool, SPIN_WINDOW};
pub use rope::RopeTable;
pub use swiglu::swiglu;
pub use tiles::{axpy_rows, dot_rows_scaled, prefetch, HeadsLayout};
pub use vector::{axpy, dot, rms_norm, silu_mul, softmax_parts};
pub use weights::{pack_weights, WeightMatrix};

pub use crate::model::DType;

/// Why a tensor cannot be used as a weight matrix.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The tensor is not two-dimensional (or has an empty dimension).
    #[error("tensor {name:?} has shape {shape:?}, but a weight matrix must be 2-D [rows, cols] with no empty dimension; check that the right tensor was passed")]
    NotAMatrix {
        /// Tensor name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A quantized row does not hold a whole number of blocks.
    #[error("tensor {name:?} has {cols} columns, which is not a multiple of the {dtype:?} block size (32); the file is malformed or was converted with another block size")]
    RaggedBlocks {
        /// Tensor name.
        name: String,
        /// Its columns.
        cols: usize,
        /// Its type.
        dtype: DType,
    },
    /// The data does not have the size the shape and type imply.
    #[error("tensor {name:?} ({dtype:?}, shape {shape:?}) needs {expected:?} bytes but has {actual}; the file is truncated or its header is wrong")]
    WrongByteLength {
        /// Tensor name.
        name: String,
        /// Its type.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes the shape requires (`None` on overflow).
        expected: Option<usize>,
        /// Bytes present.
        actual: usize,
    },
}

/// A raw output pointer shared by the threads of one parallel section, each
/// of which writes a disjoint set of elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    /// Start of the output.
    ptr: *mut f32,
    /// Its length, for debug checks.
    len: usize,
}

// SAFETY: `OutPtr` is only used inside `ThreadPool::run`, where every thread
// writes a disjoint range and `run` outlives all of them.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Wraps `out` for the duration of a parallel section.
    pub(crate) fn new(out: &mut [f32]) -> OutPtr {
        OutPtr {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// The start pointer.
    pub(crate) fn ptr(self) -> *mut f32 {
        self.ptr
    }

    /// Writes element `i`.
    ///
    /// # Safety
    /// `i < len`, and no other thread accesses element `i` meanwhile.
    #[inline(always)]
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        debug_assert!(i < self.len);
        *self.ptr.add(i) = v;
    }

    /// Reads element `i`.
    ///
    /// # Safety
    /// As for [`OutPtr::write`].
    #[inline(always)]
    pub(crate) unsafe fn read(self, i: usize) -> f32 {
        debug_assert!(i < self.len);
        *self.ptr.add(i)
    }
}
