//! The CUDA C kernels and their compilation to PTX with NVRTC at start-up,
//! cached on disk.
//!
//! Every kernel module is `kernels/common.cuh` followed by its own `.cu`
//! file, compiled for one architecture (`sm_90` on H100 / H200). The cache
//! key is the SHA-256 of the source, the architecture and the NVRTC version,
//! so an edited kernel, another GPU or another NVRTC never reuses stale PTX.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use thiserror::Error;

/// The code every module starts with (bf16 conversion, reductions).
const COMMON: &str = include_str!("kernels/common.cuh");

/// A kernel module: its name and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelModule {
    /// Module name (its file stem under `kernels/`).
    pub name: &'static str,
    /// The module's own source, without the common prelude.
    pub source: &'static str,
    /// The kernels the runner launches from it.
    pub kernels: &'static [&'static str],
}

impl KernelModule {
    /// The full NVRTC input: the prelude, then the module.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu ----\n{}", self.name, self.source)
    }
}

/// Every kernel module the CUDA runner uses.
pub const MODULES: &[KernelModule] = &[
    KernelModule {
        name: "norm",
        source: include_str!("kernels/norm.cu"),
        kernels: &["fused_add_rms_norm"],
    },
    KernelModule {
        name: "rope",
        source: include_str!("kernels/rope.cu"),
        kernels: &["rope_qk"],
    },
    KernelModule {
        name: "activation",
        source: include_str!("kernels/activation.cu"),
        kernels: &["silu_and_mul", "gather_rows", "fill_random_bf16"],
    },
    KernelModule {
        name: "attention",
        source: include_str!("kernels/attention.cu"),
        kernels: &[
            "reshape_and_cache",
            "paged_attention",
            "paged_attention_split",
            "paged_attention_reduce",
        ],
    },
    KernelModule {
        name: "sampling",
        source: include_str!("kernels/sampling.cu"),
        kernels: &["sample_rows", "apply_sparse_bias", "philox_test"],
    },
];

/// The architecture the runner compiles for (Hopper: H100, H200).
pub const DEFAULT_ARCH: &str = "sm_90";

/// Why a kernel could not be compiled or cached.
#[derive(Debug, Error)]
pub enum NvrtcError {
    /// libnvrtc cannot be loaded (absent, or another CUDA major version
    /// than the bindings'), and no prebuilt PTX stands in for it.
    #[error("{0}{hint}", hint = prebuilt_hint())]
    Missing(super::libs::LibError),
    /// NVRTC refused the source.
    #[error("NVRTC cannot compile kernel module `{module}` for {arch}: {log}")]
    Compile {
        /// The module.
        module: String,
        /// The target architecture.
        arch: String,
        /// NVRTC's log (error lines with positions) or its status.
        log: String,
    },
    /// The disk cache cannot be written.
    #[error("PTX cache {}: {source}", path.display())]
    Cache {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// NVRTC's `(major, minor)` version, or [`NvrtcError::Missing`].
pub fn version() -> Result<(i32, i32), NvrtcError> {
    super::libs::check(super::libs::CudaLib::Nvrtc).map_err(NvrtcError::Missing)?;
    // SAFETY: the library loads (checked above); the call writes two ints.
    unsafe {
        let (mut major, mut minor) = (0, 0);
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
            .result()
            .map_err(|e| NvrtcError::Compile {
                module: "-".into(),
                arch: "-".into(),
                log: format!("nvrtcVersion failed: {e:?}"),
            })?;
        Ok((major, minor))
    }
}

/// Compiles one module to PTX text for `arch` (e.g. `sm_90`).
pub fn compile(module: &KernelModule, arch: &'static str) -> Result<String, NvrtcError> {
    version()?;
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        name: Some(format!("{}.cu", module.name)),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(module.full_source(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(e) => {
            let log = match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            };
            Err(NvrtcError::Compile {
                module: module.name.into(),
                arch: arch.into(),
                log,
            })
        }
    }
}

/// The cache key of a module: source, architecture and NVRTC version.
pub fn cache_key(module: &KernelModule, arch: &str, nvrtc: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(module.full_source().as_bytes());
    h.update([0]);
    h.update(arch.as_bytes());
    h.update(format!("\0nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The default cache folder: `$XDG_CACHE_HOME/host/ptx`, else
/// `$HOME/.cache/host/ptx`, else one under the temporary folder.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("host").join("ptx")
}

/// The PTX of `module` for `arch`: read from `dir` when compiled before with
/// the same source and NVRTC, else compiled and stored (written to a
/// temporary file, then renamed, so a concurrent reader never sees half).
pub fn load_or_compile(
    module: &KernelModule,
    arch: &'static str,
    dir: &Path,
) -> Result<String, NvrtcError> {
    let nvrtc = match version() {
        Err(NvrtcError::Missing(e)) => return prebuilt(module, arch).ok_or(NvrtcError::Missing(e)),
        other => other?,
    };
    let key = cache_key(module, arch, nvrtc);
    let path = dir.join(format!("{}-{}.ptx", module.name, &key[..32]));
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        return Ok(ptx);
    }
    let ptx = compile(module, arch)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| NvrtcError::Cache { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!(".{}-{}.tmp", module.name, std::process::id()));
    std::fs::write(&tmp, &ptx).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(ptx)
}

/// The variable naming a folder of PTX compiled on another machine
/// ([`export_ptx`]), read only when NVRTC cannot be loaded here: the device
/// check carries one, since the device's CUDA may not match the bindings'.
pub const PTX_DIR_ENV: &str = "HOST_PTX_DIR";

/// A module's file in a prebuilt folder: keyed by source and architecture
/// but not NVRTC version, because the machine reading it may have none.
fn prebuilt_file(module: &KernelModule, arch: &str) -> String {
    let key: String = Sha256::digest(module.full_source().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{}-{arch}-{}.ptx", module.name, &key[..32])
}

/// The PTX of `module` for `arch` from `$HOST_PTX_DIR`, if exported there.
fn prebuilt(module: &KernelModule, arch: &str) -> Option<String> {
    let dir = std::env::var_os(PTX_DIR_ENV)?;
    std::fs::read_to_string(Path::new(&dir).join(prebuilt_file(module, arch))).ok()
}

/// What [`NvrtcError::Missing`] adds about the prebuilt folder.
fn prebuilt_hint() -> String {
    match std::env::var_os(PTX_DIR_ENV) {
        Some(dir) => format!(
            "; and {PTX_DIR_ENV}={} holds no PTX of this kernel source for this GPU",
            Path::new(&dir).display()
        ),
        None => String::new(),
    }
}

/// Compiles every module for `arch` with this machine's NVRTC into `dir`,
/// under the names [`load_or_compile`] reads from `$HOST_PTX_DIR` when the
/// machine it runs on cannot load NVRTC; returns the files written.
pub fn export_ptx(dir: &Path, arch: &'static str) -> Result<Vec<PathBuf>, NvrtcError> {
    std::fs::create_dir_all(dir).map_err(|source| NvrtcError::Cache {
        path: dir.into(),
        source,
    })?;
    MODULES
        .iter()
        .map(|module| {
            let path = dir.join(prebuilt_file(module, arch));
            let ptx = compile(module, arch)?;
            std::fs::write(&path, ptx).map_err(|source| NvrtcError::Cache {
                path: path.clone(),
                source,
            })?;
            Ok(path)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI's gate on the kernels: every module compiles for sm_90 and its PTX
    /// defines every kernel the runner launches. Without libnvrtc this fails
    /// (it does not skip) with the install command.
    #[test]
    fn every_kernel_module_compiles_to_ptx_for_sm_90() {
        if let Err(e) = version() {
            panic!("{e}");
        }
        for module in MODULES {
            let ptx = compile(module, DEFAULT_ARCH).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                ptx.contains(".target sm_90"),
                "{}: no sm_90 target",
                module.name
            );
            for kernel in module.kernels {
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "module {}: PTX lacks kernel `{kernel}`",
                    module.name
                );
            }
        }
    }

    #[test]
    fn a_broken_kernel_is_an_error_naming_module_and_line() {
        let broken = KernelModule {
            name: "broken",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n",
            kernels: &["k"],
        };
        let err = compile(&broken, DEFAULT_ARCH).unwrap_err().to_string();
        assert!(err.contains("`broken`"), "{err}");
        assert!(err.contains("undefined_name"), "{err}");
    }

    #[test]
    fn the_cache_is_keyed_by_source_arch_and_nvrtc_version() {
        let m = &MODULES[1];
        let k = cache_key(m, "sm_90", (12, 9));
        assert_eq!(k.len(), 64);
        assert_ne!(k, cache_key(m, "sm_80", (12, 9)));
        assert_ne!(k, cache_key(m, "sm_90", (12, 8)));
        assert_ne!(k, cache_key(&MODULES[0], "sm_90", (12, 9)));
        assert_eq!(k, cache_key(m, "sm_90", (12, 9)));
    }

    /// The prebuilt name follows the source and the architecture only, so
    /// PTX exported by one NVRTC is found where another (or none) is.
    #[test]
    fn exported_ptx_is_named_by_source_and_arch() {
        let dir = tempfile::tempdir().unwrap();
        let files = export_ptx(dir.path(), DEFAULT_ARCH).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(files.len(), MODULES.len());
        let rope = std::fs::read_to_string(dir.path().join(prebuilt_file(&MODULES[1], "sm_90")));
        assert!(rope.unwrap().contains(".entry rope_qk("));
        let edited = KernelModule {
            source: "// edited\n",
            ..MODULES[1]
        };
        assert_ne!(
            prebuilt_file(&edited, "sm_90"),
            prebuilt_file(&MODULES[1], "sm_90")
        );
        assert_ne!(
            prebuilt_file(&MODULES[1], "sm_80"),
            prebuilt_file(&MODULES[1], "sm_90")
        );
    }

    #[test]
    fn a_cached_module_is_read_back_not_recompiled() {
        let dir = tempfile::tempdir().unwrap();
        let m = &MODULES[1];
        let first = load_or_compile(m, DEFAULT_ARCH, dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(files.len(), 1, "one cached file, no temporary left");
        // Overwrite the cached PTX: a hit returns the file, not a fresh compile.
        let path = files[0].as_ref().unwrap().path();
        std::fs::write(&path, "// marker\n").unwrap();
        let second = load_or_compile(m, DEFAULT_ARCH, dir.path()).unwrap();
        assert_eq!(second, "// marker\n");
        assert!(first.contains(".entry rope_qk("));
    }
}
