//! The CUDA model runner (vLLM's `GPUModelRunner` and `GPUWorker`), behind
//! the `cuda` cargo feature. cudarc loads the driver, NVRTC and cuBLAS at
//! run time, so this builds without a CUDA toolkit.
//!
//! Verified without a GPU: [`nvrtc`] (every kernel compiles to sm_90 PTX),
//! [`memory`], [`graphs`], [`metadata`], [`philox`], [`sampler`]'s
//! packing and eligibility, and [`host_draw`]. See docs/cuda.md for what
//! still awaits a GPU.
//!
//! - [`nvrtc`]: the CUDA C kernels and their compilation to PTX, cached;
//! - [`libs`]: whether the driver, NVRTC and cuBLAS load here, as errors;
//! - [`memory`]: the KV-cache budget from the memory snapshots;
//! - [`graphs`]: the CUDA-graph capture sizes, batch padding and which
//!   batches replay a graph;
//! - [`attention`]: the split-K (flash-decoding) partition count;
//! - [`metadata`]: block tables and slot mappings in the kernels' layout;
//! - [`philox`]: the sampler's counter-based generator, host reference;
//! - [`sampler`]: device sampling driven from the host, and which requests
//!   may use it;
//! - [`host_draw`]: the device sampler's draw computed on the host;
//! - [`device_runner`]: [`GpuDevice`] and [`GpuRunner`], what the engine's
//!   `Worker` drives on a GPU (profile run, graphs, sleep, weight updates).

pub mod attention;
pub mod device;
pub mod device_runner;
pub mod forward;
pub mod graphs;
pub mod host_draw;
pub mod libs;
pub mod memory;
pub mod metadata;
pub mod nvrtc;
pub mod philox;
pub mod runner;
pub mod sampler;
pub mod weights;

/// The CUDA bindings the runner is built on, for the device checks
/// (tests/gpu_*.rs) to launch kernels directly.
pub use cudarc;

pub use device_runner::{GpuDevice, GpuRunner};
