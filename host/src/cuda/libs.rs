//! Whether the CUDA libraries cudarc's bindings load at run time (the
//! driver, NVRTC, cuBLAS) are usable here, asked before their first use so
//! that a missing or mismatched library is an error saying what to install
//! instead of a panic inside cudarc.
//!
//! The bindings are generated for one CUDA version ([`BINDINGS`], chosen at
//! build time by `CUDARC_CUDA_VERSION`: 12080 by default, 13000 for CUDA 13).
//! cudarc looks for each library under a list of names for that version
//! (`libnvrtc.so`, `libnvrtc.so.12`, … — CUDA 12 bindings never try
//! `libnvrtc.so.13`) and, in the first one that opens, resolves *every*
//! symbol of the bindings with `expect`: one the library lacks panics. That
//! is what CUDA 12.8 bindings meet in CUDA 13's NVRTC, which dropped
//! `nvrtcGetNVVM`. cudarc's own `is_culib_present` opens and resolves the
//! same way, so [`check`] calls it under `catch_unwind`: the only way to ask
//! cudarc without its panic escaping. The panic's message (the missing
//! symbol) becomes part of the error; the default hook also prints it once.

use std::sync::OnceLock;

use thiserror::Error;

/// The CUDA version of the bindings this build was compiled with, as
/// cudarc spells it (`12080`, `13000`); set by `.cargo/config.toml` unless
/// the build's environment overrides it.
pub const BINDINGS: &str = env!("CUDARC_CUDA_VERSION");

/// The major CUDA version of [`BINDINGS`] (`12`, `13`): the soname suffix
/// of the libraries these bindings look for.
pub fn bindings_major() -> &'static str {
    BINDINGS.get(..2).unwrap_or(BINDINGS)
}

/// A CUDA library cudarc loads with dlopen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaLib {
    /// The driver, `libcuda.so.1` (installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler the kernels are built with at start-up.
    Nvrtc,
    /// cuBLAS, for the GEMMs.
    Cublas,
}

impl CudaLib {
    /// The soname these bindings load it by.
    pub fn soname(self) -> String {
        match self {
            CudaLib::Driver => "libcuda.so.1".into(),
            CudaLib::Nvrtc => format!("libnvrtc.so.{}", bindings_major()),
            CudaLib::Cublas => format!("libcublas.so.{}", bindings_major()),
        }
    }

    /// How to make it loadable, for this build's CUDA version.
    fn install_hint(self) -> String {
        let (wheel, module) = match (self, bindings_major()) {
            (CudaLib::Driver, _) => {
                return "install the NVIDIA driver (it provides libcuda.so.1)".into()
            }
            (CudaLib::Nvrtc, "12") => ("nvidia-cuda-nvrtc-cu12", "nvidia.cuda_nvrtc"),
            (CudaLib::Cublas, "12") => ("nvidia-cublas-cu12", "nvidia.cublas"),
            // CUDA 13's wheels keep every library in nvidia/cu13/lib.
            (CudaLib::Nvrtc, _) => ("nvidia-cuda-nvrtc", "nvidia.cu13"),
            (CudaLib::Cublas, _) => ("nvidia-cublas", "nvidia.cu13"),
        };
        format!(
            "install it with `python3 -m pip install {wheel}` and put its lib folder \
             (python3 -c 'import {module} as m; print(list(m.__path__)[0])'/lib) on \
             LD_LIBRARY_PATH, or put a CUDA {} toolkit's lib64 there",
            bindings_major()
        )
    }
}

/// Why a CUDA library cannot be used.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum LibError {
    /// No file under any name the bindings try could be opened.
    #[error(
        "the CUDA library {soname} cannot be loaded (this build has CUDA {bindings} \
         bindings); {hint}"
    )]
    Missing {
        /// The soname looked for.
        soname: String,
        /// [`BINDINGS`].
        bindings: &'static str,
        /// What to install and where to point LD_LIBRARY_PATH.
        hint: String,
    },
    /// A library opened but lacks a symbol of the bindings: another CUDA
    /// major version than the build's.
    #[error(
        "the library cudarc found for {soname} does not match this build's CUDA \
         {bindings} bindings ({detail}); it is likely another CUDA major version: \
         rebuild with CUDARC_CUDA_VERSION=13000 (CUDA 13) or 12080 (CUDA 12) — \
         scripts/gpu-check.sh builds both — or put the matching library first on \
         LD_LIBRARY_PATH"
    )]
    Mismatch {
        /// The soname looked for.
        soname: String,
        /// [`BINDINGS`].
        bindings: &'static str,
        /// cudarc's panic message (names the missing symbol).
        detail: String,
    },
}

/// `Ok` when cudarc can load `lib` here; the answer is remembered, so the
/// probe (and a mismatch's panic message) happens once per library.
pub fn check(lib: CudaLib) -> Result<(), LibError> {
    static PROBED: [OnceLock<Result<(), LibError>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match lib {
        CudaLib::Driver => &PROBED[0],
        CudaLib::Nvrtc => &PROBED[1],
        CudaLib::Cublas => &PROBED[2],
    };
    slot.get_or_init(|| probe(lib)).clone()
}

/// Asks cudarc whether `lib` loads, catching the panic of a symbol it lacks.
fn probe(lib: CudaLib) -> Result<(), LibError> {
    // SAFETY: each call only dlopens the library and resolves its symbols;
    // nothing is called through them.
    let present = std::panic::catch_unwind(|| unsafe {
        match lib {
            CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
            CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            CudaLib::Cublas => cudarc::cublas::sys::is_culib_present(),
        }
    });
    match present {
        Ok(true) => Ok(()),
        Ok(false) => Err(LibError::Missing {
            soname: lib.soname(),
            bindings: BINDINGS,
            hint: lib.install_hint(),
        }),
        Err(panic) => Err(LibError::Mismatch {
            soname: lib.soname(),
            bindings: BINDINGS,
            detail: panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a symbol could not be resolved".into()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bindings_version_is_one_cudarc_knows() {
        assert!(
            ["12080", "13000"].contains(&BINDINGS),
            "CUDARC_CUDA_VERSION={BINDINGS}: scripts/gpu-check.sh builds only 12080 and 13000"
        );
        assert_eq!(
            CudaLib::Cublas.soname(),
            format!("libcublas.so.{}", &BINDINGS[..2])
        );
    }

    #[test]
    fn a_missing_library_names_its_soname_and_the_wheel_to_install() {
        let err = LibError::Missing {
            soname: CudaLib::Nvrtc.soname(),
            bindings: BINDINGS,
            hint: CudaLib::Nvrtc.install_hint(),
        }
        .to_string();
        assert!(
            err.contains(&format!("libnvrtc.so.{}", bindings_major())),
            "{err}"
        );
        let wheel = if bindings_major() == "12" {
            "pip install nvidia-cuda-nvrtc-cu12"
        } else {
            "pip install nvidia-cuda-nvrtc`"
        };
        assert!(err.contains(wheel), "{err}");
        assert!(err.contains("LD_LIBRARY_PATH"), "{err}");
    }

    /// CI installs NVRTC for the kernels' PTX test, so the probe must find
    /// it, and asking twice gives the remembered answer.
    #[test]
    fn the_installed_nvrtc_passes_the_probe() {
        check(CudaLib::Nvrtc).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(check(CudaLib::Nvrtc), Ok(()));
    }
}
