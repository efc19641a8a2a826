//! A scheduling policy written in Python (componentize-py), to show the WIT
//! contract is language-neutral: `host plugin inspect` reads its metadata,
//! and the real engine on the real model admits requests in the order it
//! defines (longest prompt first, the mirror of the Rust
//! `engine:shortest-prompt-first`) while producing exactly the tokens the
//! built-in FCFS produces for the same requests.
//!
//! Needs componentize-py (`pip install -r plugins/python/requirements.txt`,
//! which `scripts/test.sh` does); the component is built by
//! `plugins/python/longest-prompt-first/build.sh`, a no-op when up to date.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use host::config::EngineConfig;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;

const NAME: &str = "py:longest-prompt-first";

/// Prompts whose arrival order, ascending-length order and descending-length
/// order all differ.
const TEXTS: [&str; 5] = [
    "The sky is",
    "Once upon a time, in a kingdom far away, there lived a wise old king who",
    "Water boils at",
    "In the beginning of the story, the hero",
    "My favourite food is pasta because",
];

/// Where the compiled form of the component is cached: shared by every test
/// here and by the `host` binary, so CPython's interpreter (an 18 MB
/// component, tens of seconds to compile) is compiled once.
fn cache_dir() -> PathBuf {
    std::env::temp_dir().join("host-plugin-tests-cache")
}

/// The built component, built once per test process and loaded once so the
/// cache is warm before the tests that time the engine start.
fn component() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = e2e::repo_root();
            let wasm = root.join("plugins/target/python/longest_prompt_first.wasm");
            let out = Command::new("bash")
                .arg(root.join("plugins/python/longest-prompt-first/build.sh"))
                .arg(&wasm)
                .output()
                .expect("cannot run bash to build the Python plugin");
            assert!(
                out.status.success(),
                "building the Python plugin failed; install its tool with \
                 `python3 -m pip install -r plugins/python/requirements.txt`\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let host = host::plugins::host_from_config(&engine_config(&wasm).plugins)
                .expect("the Python plugin loads");
            assert!(host.plugins().any(|p| p.name == NAME));
            wasm
        })
        .clone()
}

fn engine_config(wasm: &std::path::Path) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.plugins.paths = vec![wasm.to_path_buf()];
    c.plugins.cache_dir = Some(cache_dir());
    c
}

#[test]
fn inspect_shows_the_python_plugins_name_kind_and_wit_version() {
    let wasm = component();
    let out = Command::new(e2e::host_bin())
        .arg("--set")
        .arg(format!("plugins.cache_dir={}", cache_dir().display()))
        .args(["plugin", "inspect"])
        .arg(&wasm)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "name: py:longest-prompt-first",
        "version: 0.1.0",
        "kind: scheduling policy",
        // The version build.sh builds against (wit/v0.2.0).
        "wit: engine:plugins@0.2.0",
        "engine:plugins/scheduling-policy@0.2.0",
        "max_wait_s (default 0)",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    // The exports are the plugin's interfaces only, not componentize-py's
    // own plain-named `exports` instance.
    let exports: Vec<&str> = stdout
        .lines()
        .skip_while(|l| *l != "exports:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect();
    assert_eq!(
        exports,
        ["  engine:plugins/scheduling-policy@0.2.0"],
        "in:\n{stdout}"
    );
}

/// Runs every prompt greedily under `policy`, one request at a time, and
/// returns the order the requests got their first token in, each one's
/// output tokens, and the prompts' lengths in tokens.
fn run(policy: &str) -> (Vec<usize>, Vec<Vec<u32>>, Vec<usize>) {
    let mut c = engine_config(&component());
    c.scheduler.policy = policy.into();
    c.scheduler.max_num_seqs = 1;
    let mut llm = Llm::new(&c).unwrap();
    let lens: Vec<usize> = TEXTS
        .iter()
        .map(|t| llm.encode(&Prompt::Text(t.to_string())).unwrap().len())
        .collect();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 4,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let reqs: Vec<GenerateRequest> = TEXTS
        .iter()
        .map(|t| GenerateRequest::new(Prompt::Text(t.to_string()), params.clone()))
        .collect();
    let done: Vec<_> = llm
        .generate(&reqs, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let ttft: Vec<f64> = done
        .iter()
        .map(|r| r.metrics.time_to_first_token_s.unwrap())
        .collect();
    let mut order: Vec<usize> = (0..TEXTS.len()).collect();
    order.sort_by(|&a, &b| ttft[a].total_cmp(&ttft[b]));
    let tokens = done.into_iter().map(|r| r.token_ids).collect();
    (order, tokens, lens)
}

#[test]
fn the_python_policy_admits_longest_prompts_first_with_unchanged_outputs() {
    let (order, tokens, lens) = run(NAME);
    let mut longest_first: Vec<usize> = (0..TEXTS.len()).collect();
    longest_first.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    assert_eq!(order, longest_first, "prompt lengths {lens:?}");

    let (fcfs_order, fcfs_tokens, _) = run("builtin:fcfs");
    assert_eq!(fcfs_order, [0, 1, 2, 3, 4]);
    assert_ne!(
        order, fcfs_order,
        "the prompts were chosen so the orders differ"
    );
    assert_eq!(
        tokens, fcfs_tokens,
        "the order changes, the content does not"
    );
}
