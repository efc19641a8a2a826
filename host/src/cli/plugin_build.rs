//! `host plugin build [DIR]`: builds the plugin project in `DIR` (default
//! the current folder) the way its language needs, cargo for the
//! `wasm32-wasip2` target or componentize-py, after checking the toolchain
//! is there (and saying what to install when it is not); then reads the
//! component back as `host plugin inspect` does and prints its path,
//! qualified name and how to load it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use serde::Deserialize;

use super::plugin_new::{load_hint, Kind};
use crate::config::EngineConfig;
use crate::plugins::{runtime_from_config, PluginHost, PluginKind};

/// The WebAssembly target Rust plugins are built for.
const TARGET: &str = "wasm32-wasip2";

/// `plugin.toml` of a Python project (`host plugin new --lang python`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PythonProject {
    /// The WIT world in `wit/`.
    world: String,
    /// The Python module implementing it.
    module: String,
    /// The component to write, relative to the project.
    output: PathBuf,
}

/// Runs `host plugin build`.
pub fn run(config: &EngineConfig, dir: &Path) -> anyhow::Result<()> {
    let dir = dir
        .canonicalize()
        .with_context(|| format!("cannot open the plugin folder {}", dir.display()))?;
    let wasm = if dir.join("Cargo.toml").is_file() {
        build_rust(&dir)?
    } else if dir.join("plugin.toml").is_file() {
        build_python(&dir)?
    } else {
        bail!(
            "{} holds neither a Cargo.toml (a Rust plugin) nor a plugin.toml (a Python plugin); \
             run `host plugin build DIR` with a folder `host plugin new` made",
            dir.display()
        );
    };
    let info = PluginHost::inspect(runtime_from_config(&config.plugins)?, &wasm)
        .with_context(|| format!("built {}, but the host cannot load it", wasm.display()))?;
    println!("built {}", wasm.display());
    print!("{}", super::plugin::describe(&info));
    let kind = match info.kind {
        PluginKind::SchedulingPolicy => Kind::Policy,
        PluginKind::LogitsProcessor => Kind::LogitsProcessor,
        PluginKind::Sampler => Kind::Sampler,
        PluginKind::WorkerExtension => Kind::WorkerExtension,
    };
    let path = wasm.display().to_string();
    println!("load it with:\n{}", load_hint(kind, &info.name, &path));
    Ok(())
}

/// Runs `program args` in `dir` with the output shown; `missing` says what
/// to install when the program is not there.
fn run_tool(dir: &Path, program: &str, args: &[&str], missing: &str) -> anyhow::Result<()> {
    let status = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .status();
    match status {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{program} is not installed; {missing}")
        }
        Err(e) => bail!("cannot run {program}: {e}"),
        Ok(s) if !s.success() => bail!(
            "`{program} {}` failed ({s}) in {}; its messages are above",
            args.join(" "),
            dir.display()
        ),
        Ok(_) => Ok(()),
    }
}

/// Whether rustc (as rustup picks it for `dir`) has the wasm32-wasip2
/// standard library; `None` when that cannot be told.
fn target_installed(dir: &Path) -> Option<bool> {
    let out = Command::new("rustc")
        .args(["--print", "sysroot"])
        .current_dir(dir)
        .output()
        .ok()?;
    let sysroot = String::from_utf8(out.stdout).ok()?;
    Some(
        Path::new(sysroot.trim())
            .join("lib/rustlib")
            .join(TARGET)
            .is_dir(),
    )
}

/// `cargo build --release --target wasm32-wasip2` in `dir`; the component.
fn build_rust(dir: &Path) -> anyhow::Result<PathBuf> {
    const RUSTUP: &str =
        "install Rust with rustup (https://rustup.rs), then `rustup target add wasm32-wasip2`";
    if target_installed(dir) == Some(false) {
        bail!(
            "the {TARGET} target is not installed for this Rust toolchain; run `rustup target add {TARGET}` \
             (in {}, so rustup picks the same toolchain)",
            dir.display()
        );
    }
    let args = ["build", "--release", "--target", TARGET];
    eprintln!("running: cargo {} (in {})", args.join(" "), dir.display());
    run_tool(dir, "cargo", &args, RUSTUP)?;
    let out = Command::new("cargo")
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(dir)
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run `cargo metadata`")?;
    if !out.status.success() {
        bail!("`cargo metadata` failed in {}", dir.display());
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("`cargo metadata` printed no JSON")?;
    let target_dir = meta["target_directory"]
        .as_str()
        .context("`cargo metadata` names no target directory")?;
    let manifest = dir.join("Cargo.toml");
    let package = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["manifest_path"].as_str().map(Path::new) == Some(manifest.as_path()))
        .context("`cargo metadata` does not list this folder's package")?;
    let lib = package["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "cdylib"))
        })
        .and_then(|t| t["name"].as_str());
    let Some(lib) = lib else {
        bail!(
            "{} builds no cdylib, so there is no component; add `[lib] crate-type = [\"cdylib\", \"rlib\"]`",
            manifest.display()
        );
    };
    let wasm = Path::new(target_dir)
        .join(TARGET)
        .join("release")
        .join(format!("{}.wasm", lib.replace('-', "_")));
    if !wasm.is_file() {
        bail!("cargo succeeded but {} is not there", wasm.display());
    }
    Ok(wasm)
}

/// componentize-py, as `plugin.toml` says, in `dir`; the component.
fn build_python(dir: &Path) -> anyhow::Result<PathBuf> {
    let manifest = dir.join("plugin.toml");
    let text = std::fs::read_to_string(&manifest)
        .with_context(|| format!("cannot read {}", manifest.display()))?;
    let project: PythonProject =
        toml::from_str(&text).with_context(|| format!("{} is not valid", manifest.display()))?;
    const PIP: &str = "install Python 3 and then `python3 -m pip install componentize-py==0.25.1`";
    let probe = Command::new("python3")
        .args(["-c", "import componentize_py"])
        .stderr(Stdio::null())
        .status();
    match probe {
        Err(_) => bail!("python3 is not installed; {PIP}"),
        Ok(s) if !s.success() => bail!(
            "componentize-py is not installed for python3; run `python3 -m pip install componentize-py==0.25.1`"
        ),
        Ok(_) => {}
    }
    let out = dir.join(&project.output);
    let tmp = out.with_extension("wasm.tmp");
    let tmp_arg = tmp.to_string_lossy().into_owned();
    // Through python3, so the tool comes from the environment pip put it in.
    let script = "import sys, componentize_py; sys.argv[0] = 'componentize-py'; sys.exit(componentize_py.script())";
    let args = [
        "-c",
        script,
        "-d",
        "wit",
        "-w",
        &project.world,
        "componentize",
        "--stub-wasi",
        &project.module,
        "-o",
        &tmp_arg,
    ];
    eprintln!(
        "running: componentize-py -d wit -w {} componentize --stub-wasi {} -o {} (in {})",
        project.world,
        project.module,
        project.output.display(),
        dir.display()
    );
    run_tool(dir, "python3", &args, PIP)?;
    std::fs::rename(&tmp, &out)
        .with_context(|| format!("cannot move the component to {}", out.display()))?;
    Ok(out)
}
