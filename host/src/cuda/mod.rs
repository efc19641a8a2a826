//! The CUDA model runner (vLLM's `GPUModelRunner` and `GPUWorker`), behind
//! the `cuda` cargo feature. cudarc loads the driver, NVRTC and cuBLAS at
//! run time, so this builds without a CUDA toolkit.
//!
//! - [`nvrtc`]: the CUDA C kernels and their compilation to PTX, cached.

pub mod nvrtc;
