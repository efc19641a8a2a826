//! The layering test (issue 17, part 3), in the spirit of rust-analyzer's
//! tidy tests: it reads every `host/src/**/*.rs` file, maps the file to its
//! top-level module (`host/src/worker.rs` and `host/src/worker/**` are
//! `worker`), collects every `crate::<module>` path in it (in `use` lines,
//! `use crate::{a, b::c}` groups and inline paths; comments are skipped) and
//! fails, naming the file, the line and the path, when a module reaches one
//! that [`ALLOWED`] does not list for it.
//!
//! The direction: server → engine → {scheduler, kv_cache, executor} →
//! worker → model_runner → kernels; `config`, `message_queue`, `model`,
//! `sampling`, `step` and `tokenizer` are leaves (or nearly: they import only other
//! leaves); plugins are called by the scheduler (through its
//! `SchedulingPolicy` seam, which the plugin host implements) and the worker
//! only. The executor lives in `engine/executor/`, so its edge to the worker
//! is the engine's.
//! There are no exceptions: an edge the table does not list is a design
//! change, made in the table (and in docs/ARCHITECTURE.md) first.

use std::fs;
use std::path::{Path, PathBuf};

/// Module → the modules it may import (besides itself). `lib.rs` and
/// `main.rs` (the crate root) may import anything.
const ALLOWED: &[(&str, &[&str])] = &[
    // The binary's commands: the top of the graph. `bench` drives the model
    // runner directly, `plugin` inspects plugins, `worker` starts the worker
    // process, `serve` lists the plugins in use (the built-in policies are
    // the scheduler's).
    (
        "cli",
        &[
            "server",
            "engine",
            "scheduler",
            "worker",
            "model_runner",
            // The CPU kernel family: checked at start-up, named by `bench`.
            "kernels",
            "plugins",
            "config",
            "model",
            "sampling",
            "tokenizer",
        ],
    ),
    // The HTTP API: a frontend of the engine.
    (
        "server",
        &["engine", "step", "config", "sampling", "tokenizer"],
    ),
    // The engine core, its client and its executors (engine/executor/).
    (
        "engine",
        &[
            "scheduler",
            "kv_cache",
            "worker",
            "step",
            "distributed",
            "message_queue",
            "config",
            "model",
            "sampling",
            "tokenizer",
        ],
    ),
    // The scheduler resolves its policy, a built-in or a plugin, and puts a
    // plugin behind its `SchedulingPolicy` seam.
    (
        "scheduler",
        &["kv_cache", "step", "plugins", "config", "sampling"],
    ),
    ("kv_cache", &["config"]),
    (
        "worker",
        &[
            "model_runner",
            "cuda",
            "kernels",
            "plugins",
            "step",
            "distributed",
            "message_queue",
            "config",
            "model",
            "sampling",
        ],
    ),
    // The plugin host: called by the scheduler and the worker, importing
    // neither (a policy takes plain columns, an extension a `HostApi`).
    ("plugins", &["config", "sampling"]),
    (
        "model_runner",
        &["kernels", "distributed", "config", "model", "sampling"],
    ),
    // The GPU model runner: the CPU runner's peer, implementing its
    // `DeviceRunner` trait.
    (
        "cuda",
        &[
            "model_runner",
            "kernels",
            "distributed",
            "config",
            "model",
            "sampling",
        ],
    ),
    ("kernels", &["model"]),
    ("distributed", &["message_queue"]),
    // Leaves.
    ("config", &[]),
    ("message_queue", &[]),
    // The step types: what crosses the engine/worker boundary (their tests
    // round-trip them through the queue's codec).
    ("step", &["sampling", "message_queue"]),
    // The weights and their loaders (`DType`, `Tensor`, which the kernels
    // read); `LoadFormat` is re-exported from `config`.
    ("model", &["config"]),
    ("sampling", &[]),
    ("tokenizer", &["model"]),
];

/// A `crate::` path found in a file.
#[derive(Debug)]
struct Import {
    line: usize,
    module: String,
    text: String,
}

#[test]
fn modules_import_only_what_the_layering_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(
        files.len() > 50,
        "found only {} files under {}",
        files.len(),
        src.display()
    );

    let mut violations = Vec::new();
    for path in &files {
        let rel = path
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let Some(module) = top_module(&rel) else {
            continue; // lib.rs, main.rs: the crate root.
        };
        let allowed = ALLOWED
            .iter()
            .find(|(m, _)| *m == module)
            .unwrap_or_else(|| panic!("host/src/{rel}: module `{module}` is not in ALLOWED"))
            .1;
        let text = fs::read_to_string(path).unwrap();
        for import in crate_paths(&text) {
            if import.module == module || allowed.contains(&import.module.as_str()) {
                continue;
            }
            violations.push(format!(
                "host/src/{rel}:{}: `{module}` must not import `{}`: {}",
                import.line, import.module, import.text
            ));
        }
    }
    assert!(
        violations.is_empty(),
        "layering violations (the table is ALLOWED in host/tests/layering.rs; \
         docs/ARCHITECTURE.md explains it):\n{}",
        violations.join("\n")
    );
}

/// The parser finds every shape of path the tree uses.
#[test]
fn crate_paths_finds_uses_groups_and_inline_paths() {
    let text = "use crate::config::EngineConfig;\n\
                use crate::{\n    worker::{Worker, RpcValue},\n    model::DType,\n};\n\
                // use crate::server::Ignored;\n\
                /// [`crate::engine::Doc`] is a comment too.\n\
                let x = crate::kernels::dot(a, b); pub(crate) fn f() {}\n\
                macro_rules! m { () => { $crate::ignored::X } }\n";
    let found: Vec<(usize, String)> = crate_paths(text)
        .into_iter()
        .map(|i| (i.line, i.module))
        .collect();
    let want = [(1, "config"), (3, "worker"), (4, "model"), (8, "kernels")];
    let want: Vec<(usize, String)> = want.iter().map(|(l, m)| (*l, m.to_string())).collect();
    assert_eq!(found, want);
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `worker.rs`, `worker/rpc.rs` → `worker`; `lib.rs`, `main.rs` → none.
fn top_module(rel: &str) -> Option<&str> {
    match rel.split_once('/') {
        Some((dir, _)) => Some(dir),
        None => match rel.strip_suffix(".rs")? {
            "lib" | "main" => None,
            m => Some(m),
        },
    }
}

/// Every `crate::<module>` path in `text`, with its line, skipping `//`
/// comments (doc comments included) and `$crate`.
fn crate_paths(text: &str) -> Vec<Import> {
    // Blank out comments, keeping lines and columns.
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let bytes = code.as_bytes();
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let line_text = |at: usize| {
        let start = code[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = code[at..].find('\n').map_or(code.len(), |i| at + i);
        code[start..end].trim().to_string()
    };
    let ident_at = |at: usize| {
        let len = code[at..]
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(code.len() - at);
        &code[at..at + len]
    };

    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("crate::") {
        let at = from + i;
        from = at + "crate::".len();
        let before = at.checked_sub(1).map(|b| bytes[b]);
        if matches!(before, Some(b) if b == b'$' || b == b'_' || b.is_ascii_alphanumeric()) {
            continue;
        }
        let mut push = |pos: usize| {
            let module = ident_at(pos);
            if !module.is_empty() {
                out.push(Import {
                    line: line_of(pos),
                    module: module.to_string(),
                    text: line_text(pos),
                });
            }
        };
        if bytes.get(from) != Some(&b'{') {
            push(from);
            continue;
        }
        // A group: the first identifier of each item at depth 1.
        let mut depth = 0;
        let mut item_start = true;
        let mut k = from;
        while k < bytes.len() {
            match bytes[k] {
                b'{' => {
                    depth += 1;
                    item_start = depth == 1;
                }
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                b',' if depth == 1 => item_start = true,
                c if depth == 1 && item_start && (c.is_ascii_alphabetic() || c == b'_') => {
                    push(k);
                    item_start = false;
                }
                c if depth == 1 && !c.is_ascii_whitespace() => item_start = false,
                _ => {}
            }
            k += 1;
        }
        from = k;
    }
    out
}
