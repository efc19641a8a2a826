//! One GPU as the runner uses it: a context and stream, the kernels loaded
//! from (cached) PTX, cuBLAS, and bf16 GEMMs with f32 accumulation.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};
use thiserror::Error;

use super::libs::{self, CudaLib, LibError};
use super::memory::MemorySnapshot;
use super::nvrtc::{self, NvrtcError, MODULES};

/// Why the GPU cannot be used.
#[derive(Debug, Error)]
pub enum GpuError {
    /// No CUDA driver, or no device.
    #[error("no CUDA GPU: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0:?}")]
    Blas(cudarc::cublas::result::CublasError),
    /// A kernel could not be compiled.
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    /// The model or the request does not fit what the kernels support.
    #[error("{0}")]
    Unsupported(String),
    /// The cuBLAS library cannot be loaded.
    #[error(transparent)]
    Library(#[from] LibError),
}

/// How many CUDA devices this machine has; 0 when the driver library is
/// absent (a CPU-only machine), so callers can choose the CPU worker.
pub fn device_count() -> usize {
    // Through `libs::check`, which catches cudarc's panic on a driver that
    // lacks a symbol of the bindings: such a driver counts as no GPU here,
    // and `Gpu::new` says why.
    if super::libs::check(super::libs::CudaLib::Driver).is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// cuBLAS's fixed workspace: with one set, a GEMM never allocates, which
/// CUDA-graph capture requires (32 MiB, what PyTorch gives Hopper).
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A GPU with the runner's kernels loaded.
pub struct Gpu {
    /// The device's context.
    pub ctx: Arc<CudaContext>,
    /// The stream every kernel and copy of the runner is ordered on: a
    /// created (non-blocking) stream, because the legacy default stream
    /// cannot be captured into a CUDA graph. cudarc's cross-stream event
    /// tracking is off (everything is on this one stream, and an event
    /// recorded outside a capture cannot be waited on inside it); code that
    /// adds a second stream must order it with events itself.
    pub stream: Arc<CudaStream>,
    /// cuBLAS on `stream`.
    blas: CudaBlas,
    /// The workspace `blas` is given ([`BLAS_WORKSPACE_BYTES`]); kept alive
    /// as long as the handle.
    _blas_workspace: CudaSlice<u8>,
    /// Every kernel of [`MODULES`], by name.
    funcs: HashMap<&'static str, CudaFunction>,
}

impl Gpu {
    /// Opens device `ordinal` and loads every kernel module, compiling it
    /// for the device's architecture unless `cache_dir` holds it already.
    pub fn new(ordinal: usize, cache_dir: &Path) -> Result<Gpu, GpuError> {
        // The driver and cuBLAS as cudarc will load them, so a missing or
        // mismatched library is an error naming it, not cudarc's panic
        // (libs.rs). NVRTC is checked where the kernels are compiled, since
        // prebuilt PTX ($HOST_PTX_DIR) may stand in for it. No usable driver
        // means no GPU to this process.
        libs::check(CudaLib::Driver).map_err(|e| GpuError::NoDevice(e.to_string()))?;
        libs::check(CudaLib::Cublas)?;
        let count = device_count();
        if ordinal >= count {
            return Err(GpuError::NoDevice(format!(
                "device {ordinal} requested, {count} present (libcuda loadable: {})",
                // SAFETY: as in device_count.
                unsafe { cudarc::driver::sys::is_culib_present() }
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch: &'static str = match (major, minor) {
            (9, 0) => "sm_90",
            (8, 0) => "sm_80",
            (8, 6) => "sm_86",
            (8, 9) => "sm_89",
            (10, 0) => "sm_100",
            other => {
                return Err(GpuError::Unsupported(format!(
                    "compute capability {}.{} has no kernel build here (sm_80, 86, 89, 90, 100)",
                    other.0, other.1
                )))
            }
        };
        // SAFETY: before any allocation; the runner uses only `stream`, so
        // no slice is shared between streams (see the field's comment).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let mut funcs = HashMap::new();
        for module in MODULES {
            let ptx = nvrtc::load_or_compile(module, arch, cache_dir)?;
            let loaded = ctx.load_module(ptx.into())?;
            for &name in module.kernels {
                funcs.insert(name, loaded.load_function(name)?);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(GpuError::Blas)?;
        let mut workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _guard) = workspace.device_ptr_mut(&stream);
            // SAFETY: the handle is live and the workspace outlives it (both
            // are fields of the returned `Gpu`).
            unsafe {
                blas::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, BLAS_WORKSPACE_BYTES)
            }
            .result()
            .map_err(GpuError::Blas)?;
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            _blas_workspace: workspace,
            funcs,
        })
    }

    /// The kernel called `name` (one of [`MODULES`]' kernels).
    ///
    /// # Panics
    /// On a name no module defines (a runner bug; the PTX test checks them).
    pub fn func(&self, name: &str) -> &CudaFunction {
        self.funcs
            .get(name)
            .unwrap_or_else(|| panic!("kernel `{name}` is not in any module"))
    }

    /// Free and total device memory now.
    pub fn memory(&self) -> Result<MemorySnapshot, GpuError> {
        self.ctx.bind_to_thread()?;
        let (free, total) = cudarc::driver::result::mem_get_info()?;
        Ok(MemorySnapshot {
            free: free as u64,
            total: total as u64,
        })
    }

    /// `y[n, m] = x[n, k] · w[m, k]ᵀ`, all row-major; `x` and `w` bf16,
    /// `y` bf16 or f32 (`Y` = u16 or f32), accumulated in f32 on tensor cores.
    pub fn gemm<Y: GemmOut>(
        &self,
        y: &mut impl DevicePtrMut<Y>,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        n: usize,
        m: usize,
        k: usize,
    ) -> Result<(), GpuError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        // Row-major y[n, m] is column-major yᵀ[m, n] = wᵀ-as-stored · x.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                blas::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                xp as *const _,
                blas::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                yp as *mut _,
                Y::DATA_TYPE,
                m as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(GpuError::Blas)
    }
}

/// Element types a GEMM may write.
pub trait GemmOut {
    /// cuBLAS's name for it.
    const DATA_TYPE: blas::cudaDataType_t;
}

impl GemmOut for u16 {
    const DATA_TYPE: blas::cudaDataType_t = blas::cudaDataType_t::CUDA_R_16BF;
}

impl GemmOut for f32 {
    const DATA_TYPE: blas::cudaDataType_t = blas::cudaDataType_t::CUDA_R_32F;
}

/// A launch of `blocks` blocks of `threads` threads, no dynamic shared memory.
pub fn grid(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
