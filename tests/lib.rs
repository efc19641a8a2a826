//! Shared helpers for the end-to-end tests: where the repository, the default
//! model and the `host` binary are, and how to run the Python references.

pub mod netns;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (the folder holding the workspace `Cargo.toml`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The default model, as `scripts/fetch-model.sh` leaves it.
///
/// Panics with the command to run when it is missing: the end-to-end tests
/// run the real model and never skip.
pub fn default_model() -> PathBuf {
    let path = host::config::default_model_path(&repo_root());
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `bash scripts/fetch-model.sh` first",
        path.display()
    );
    path
}

/// The engine's default configuration on [`default_model`], as the
/// offline engine in a test runs it.
pub fn default_config() -> host::config::EngineConfig {
    let model = default_model().display().to_string();
    host::config::EngineConfig::load(None, &[format!("model.path={model:?}")]).unwrap()
}

/// The `host` binary built by the same `cargo test` invocation.
///
/// `cargo test -p e2e` builds the `host` library but not its binary (only
/// `--workspace` does), so a binary older than the host's sources would
/// test yesterday's code: that panics with the command to run.
pub fn host_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/host
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = dir.join(format!("host{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing; build it with `cargo build -p host`",
        bin.display()
    );
    let built = modified(&bin).expect("the binary's modification time");
    // The files the binary was built from, as cargo's dep-info lists them
    // (a test-only module changes no binary); every source of the host
    // when that file is missing.
    let newest = match binary_sources(&bin) {
        Some(sources) => sources
            .into_iter()
            .map(|p| (modified(&p).unwrap_or(std::time::SystemTime::now()), p))
            .max_by_key(|(t, _)| *t),
        None => newest_file(&repo_root().join("host/src")),
    };
    if let Some(newer) = newest.filter(|(t, _)| *t > built) {
        panic!(
            "{} is older than {}; build it with `cargo build -p host` (or run `cargo test --workspace`)",
            bin.display(),
            newer.1.display()
        );
    }
    bin
}

/// The source files cargo's dep-info beside `bin` (`host.d`) says it was
/// built from; `None` when there is none. A deleted source reads as
/// modified now, so the binary counts as stale.
fn binary_sources(bin: &Path) -> Option<Vec<PathBuf>> {
    let info = std::fs::read_to_string(bin.with_extension("d")).ok()?;
    let (_, deps) = info.lines().next()?.split_once(": ")?;
    // Paths are separated by spaces; a space inside one is escaped.
    let deps = deps.replace("\\ ", "\0");
    Some(
        deps.split_whitespace()
            .map(|p| PathBuf::from(p.replace('\0', " ")))
            .collect(),
    )
}

fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The most recently modified file under `dir` and its time.
fn newest_file(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let candidate = if path.is_dir() {
            newest_file(&path)
        } else {
            modified(&path).map(|t| (t, path))
        };
        if let Some(c) = candidate {
            if newest.as_ref().is_none_or(|n| c.0 > n.0) {
                newest = Some(c);
            }
        }
    }
    newest
}

/// Runs `python3 tests/reference/<script> <args>` and returns its stdout.
///
/// Panics with stderr and the install hint when the script fails: the
/// references need `pip install -r tests/reference/requirements.txt`.
pub fn run_python(script: &str, args: &[&str]) -> String {
    let path = repo_root().join("tests/reference").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start python3 for {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "{} failed ({}); install the references' packages with \
         `pip install -r tests/reference/requirements.txt`\n{}",
        path.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("reference output is UTF-8")
}

/// The folder holding the shipped and fixture plugins as `.wasm`
/// components, built once per test process with
/// `cargo build --release --target wasm32-wasip2` in `plugins/`
/// (`scripts/test.sh` builds them before `cargo test`, so this is then a
/// no-op check).
pub fn plugins_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let plugins = repo_root().join("plugins");
            let target = plugins.join("target");
            let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args([
                    "build",
                    "--release",
                    "--target",
                    "wasm32-wasip2",
                    "--target-dir",
                ])
                .arg(&target)
                .current_dir(&plugins)
                .output()
                .expect("cannot run cargo to build the plugins");
            assert!(
                out.status.success(),
                "building the plugins failed; run `rustup target add wasm32-wasip2`, then \
                 `cargo build --release --target wasm32-wasip2` in plugins/\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            target.join("wasm32-wasip2/release")
        })
        .clone()
}

/// The component of the plugin crate `name` (e.g. `shortest_prompt_first`).
pub fn plugin(name: &str) -> PathBuf {
    let path = plugins_dir().join(format!("{name}.wasm"));
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

/// Runs every prompt of `prompts` through `llm` with the same `params`
/// (priority 0) in one `generate` call, and returns the completions in
/// prompt order; panics if the engine fails or refuses a request.
pub fn generate_all<S: AsRef<str>>(
    llm: &mut host::engine::Llm,
    prompts: &[S],
    params: &host::sampling::SamplingParams,
) -> Vec<host::engine::Completion> {
    use host::engine::{GenerateRequest, Prompt};
    let requests: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| GenerateRequest::new(Prompt::Text(p.as_ref().to_string()), params.clone()))
        .collect();
    llm.generate(&requests, |_, _| {}, |_, _| {})
        .expect("the engine runs")
        .into_iter()
        .map(|r| r.expect("every request is admitted"))
        .collect()
}
