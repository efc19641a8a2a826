//! Writes every kernel module's sm_90 PTX into a folder, named by source
//! and architecture, for a machine whose NVRTC cannot compile them (the
//! device check reads them through `HOST_PTX_DIR`):
//!
//! ```sh
//! cargo run -p host --features cuda --example export_ptx -- target/gpu-check/ptx
//! ```
//!
//! Needs NVRTC here (the PyPI wheel `nvidia-cuda-nvrtc-cu12`, its `lib/` on
//! `LD_LIBRARY_PATH`).

use std::path::PathBuf;
use std::process::ExitCode;

use host::cuda::nvrtc::{export_ptx, DEFAULT_ARCH};

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: export_ptx <folder>");
        return ExitCode::from(2);
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("export_ptx: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    match export_ptx(&dir, DEFAULT_ARCH) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("export_ptx: {e}");
            ExitCode::FAILURE
        }
    }
}
