//! What a plugin author does, in a temporary folder outside the
//! repository: `host plugin new` for each kind (Rust), `host plugin build`
//! as `new` says, `host --plugin` into the real engine on the real model,
//! and the plugin's effect: the template policy's order (newest first), the
//! processor's ban, the sampler's choice (top-n with `n = 1` is greedy even
//! at temperature 1), and the extension's methods through the server's
//! `POST /collective_rpc`. Also: what plugins log, print and panic reaches
//! the host's log under their name, rate-limited; and the SDK's vendored WIT
//! is the repository's, byte for byte.
//!
//! The generated projects share one `CARGO_TARGET_DIR` (in the system's
//! temporary folder, kept between runs), so wit-bindgen and serde are
//! compiled once; cargo runs with `CARGO_NET_OFFLINE=true`, the crates
//! coming from `~/.cargo` where building `plugins/` put them.

use crate::harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::{json, Value};

const PROMPT: &str = "The capital of France is";

/// The projects' folder: new each run, outside the repository.
fn projects() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("a temporary folder"));
    assert!(
        !dir.path().starts_with(e2e::repo_root()),
        "the projects must live outside the repository"
    );
    dir.path()
}

/// `host args...` with `env`, its output.
fn host(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = Command::new(e2e::host_bin())
        .args(args)
        .envs(env.iter().copied())
        .env(
            "CARGO_TARGET_DIR",
            std::env::temp_dir().join("host-plugin-new-target"),
        )
        .env("CARGO_NET_OFFLINE", "true")
        .current_dir(projects())
        .output()
        .expect("run host");
    out
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `host plugin new acme:<short> --kind <kind>`, then the build command it
/// prints; the built component's path.
fn new_and_build(short: &str, kind: &str) -> PathBuf {
    let dir = projects().join(short);
    let name = format!("acme:{short}");
    let dir_arg = dir.to_string_lossy().into_owned();
    let out = host(
        &["plugin", "new", &name, "--kind", kind, "--path", &dir_arg],
        &[],
    );
    assert!(out.status.success(), "plugin new: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for file in ["Cargo.toml", "src/lib.rs", "README.md"] {
        assert!(dir.join(file).is_file(), "{file} missing; {stdout}");
    }
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
    assert!(
        !manifest.contains("../"),
        "no relative path into the repository:\n{manifest}"
    );
    // The command `new` printed, run as printed.
    let command = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("host plugin build "))
        .unwrap_or_else(|| panic!("no build command in:\n{stdout}"));
    let args: Vec<&str> = command.split_whitespace().skip(1).collect();
    let out = host(&args, &[]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{command}:\n{}\n{stdout}",
        text(&out.stderr)
    );
    for line in [
        format!("name: {name}"),
        "wit: engine:plugins@0.4.0".to_string(),
    ] {
        assert!(stdout.contains(&line), "{line:?} missing from:\n{stdout}");
    }
    let wasm = stdout
        .lines()
        .find_map(|l| l.strip_prefix("built "))
        .expect("the component's path");
    PathBuf::from(wasm)
}

/// `host [flags] generate --input` over `requests`; the completions and
/// the host's stderr.
fn generate(flags: &[&str], requests: &[Value], tag: &str) -> (Vec<Value>, String) {
    let input = projects().join(format!("{tag}.jsonl"));
    let output = projects().join(format!("{tag}.out.jsonl"));
    let lines: Vec<String> = requests.iter().map(Value::to_string).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let model = e2e::default_model();
    let cache = projects().join("cache");
    let mut args = vec![
        "--model".to_string(),
        model.to_string_lossy().into_owned(),
        "--max-model-len".into(),
        "256".into(),
        "--set".into(),
        format!(
            "plugins.cache_dir={}",
            toml::Value::String(cache.to_string_lossy().into())
        ),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    args.extend([
        "generate".into(),
        "--input".into(),
        input.to_string_lossy().into_owned(),
        "--output".into(),
        output.to_string_lossy().into_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = host(&args, &[("RUST_LOG", "warn,plugin=info")]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "generate ({tag}):\n{stderr}");
    let done = std::fs::read_to_string(&output).unwrap();
    let done = done
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (done, stderr)
}

fn tokens(completion: &Value) -> Vec<u64> {
    completion["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {completion}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The model's own behaviour without plugins: greedy tokens of [`PROMPT`]
/// with the runner-up of the first, and a seeded temperature-1 sample.
struct Base {
    greedy: Vec<u64>,
    runner_up: u64,
    sampled: Vec<u64>,
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let (done, _) = generate(
            &[],
            &[
                json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 2}),
                json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": true}),
            ],
            "base",
        );
        let greedy = tokens(&done[0]);
        let runner_up = done[0]["logprobs"][0]["top"][1][0].as_u64().expect("top-2 logprobs");
        let sampled = tokens(&done[1]);
        assert_ne!(sampled, greedy, "the seeded sample must differ from greedy for the sampler test to mean anything");
        Base { greedy, runner_up, sampled }
    })
}

#[test]
fn the_sdk_vendors_the_repositorys_wit_byte_for_byte() {
    let root = e2e::repo_root();
    for version in ["v0.2.0", "v0.4.0"] {
        let source = std::fs::read(root.join("wit").join(version).join("plugins.wit")).unwrap();
        let vendored = std::fs::read(
            root.join("plugin-sdk/wit")
                .join(version)
                .join("plugins.wit"),
        )
        .unwrap();
        assert!(
            source == vendored,
            "plugin-sdk/wit/{version} differs from wit/{version}; copy it: cp -r wit/{version} plugin-sdk/wit/"
        );
    }
}

#[test]
fn a_new_policy_orders_newest_first_and_logs_under_its_name() {
    let wasm = new_and_build("newest-first", "policy");
    let texts = [
        "Once upon a time, in a kingdom far away, there lived a wise old king who",
        "The sky is",
        "In the beginning of the story, the hero",
        "Water boils at",
        "My favourite food is pasta because",
    ];
    let requests: Vec<Value> = texts
        .iter()
        .map(|t| json!({"prompt": t, "max_tokens": 2, "temperature": 0, "ignore_eos": true}))
        .collect();
    let wasm = wasm.to_string_lossy().into_owned();
    let flags = ["--plugin", &wasm, "--set", "scheduler.max_num_seqs=1"];
    let (done, stderr) = generate(&flags, &requests, "policy");
    let ttft: Vec<f64> = done
        .iter()
        .map(|c| c["metrics"]["time_to_first_token_s"].as_f64().unwrap())
        .collect();
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by(|&a, &b| ttft[a].total_cmp(&ttft[b]));
    assert_eq!(order, [4, 3, 2, 1, 0], "admitted newest first");
    assert!(
        stderr.contains("acme:newest-first: started: newest request first"),
        "the template's log line, under its qualified name:\n{stderr}"
    );
}

#[test]
fn a_new_logits_processor_bans_what_a_request_asks() {
    let base = base();
    let wasm = new_and_build("ban", "logits-processor");
    let wasm = wasm.to_string_lossy().into_owned();
    let flags = [
        "--plugin",
        &wasm,
        "--set",
        "plugins.logits_processors=[\"acme:ban\"]",
    ];
    let first = base.greedy[0];
    let (done, _) = generate(
        &flags,
        &[
            json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "extra_args": {"ban": [first]}}),
            json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),
        ],
        "processor",
    );
    assert_eq!(
        tokens(&done[0]),
        [base.runner_up],
        "banned: the runner-up comes first"
    );
    assert_eq!(
        tokens(&done[1]),
        [first],
        "a request that asks nothing is unchanged"
    );
}

#[test]
fn a_new_sampler_chooses_by_its_own_rule() {
    let base = base();
    let wasm = new_and_build("top-n", "sampler");
    // Options come from a config file: top-1 sampling, greedy at any temperature.
    let config = projects().join("sampler.toml");
    std::fs::write(
        &config,
        "[plugins]\nsampler = \"acme:top-n\"\n[plugins.options.\"acme:top-n\"]\nn = 1\n",
    )
    .unwrap();
    let (wasm, config) = (
        wasm.to_string_lossy().into_owned(),
        config.to_string_lossy().into_owned(),
    );
    let flags = ["--plugin", &wasm, "--config", &config];
    let request = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": true});
    let (done, _) = generate(&flags, &[request], "sampler");
    assert_eq!(
        tokens(&done[0]),
        base.greedy,
        "top-1 is greedy even at temperature 1"
    );
    assert_ne!(tokens(&done[0]), base.sampled);
}

#[test]
fn a_new_worker_extension_answers_collective_rpc() {
    let wasm = new_and_build("inspector", "worker-extension");
    let wasm = wasm.to_string_lossy().into_owned();
    let server = harness::Server::start(&[
        "--plugin",
        &wasm,
        "--set",
        "worker.extension=[\"acme:inspector\"]",
        "--set",
        "server.enable_rpc_endpoint=true",
        "--max-model-len",
        "256",
    ]);
    let reply = |method: &str, args: Value| -> Value {
        let r = server.post("/collective_rpc", &json!({"method": method, "args": args}));
        assert_eq!(r.status, 200, "{method}: {}", r.text());
        let result = r.json()["results"][0].clone();
        match result.as_str() {
            Some(s) => serde_json::from_str(s).unwrap(),
            None => result,
        }
    };
    let summary = reply("acme:inspector.summary", Value::Null);
    assert_eq!(summary["num_layers"], 30, "{summary}");
    assert_eq!(summary["vocab_size"], 49152, "{summary}");
    let mean = reply(
        "acme:inspector.weight_mean",
        json!({"name": "output_norm.weight"}),
    );
    assert_eq!(mean["count"], 576, "{mean}");
}

#[test]
fn guest_stdout_and_stderr_reach_the_log_rate_limited() {
    let misbehave = e2e::plugin("misbehave").to_string_lossy().into_owned();
    let config = projects().join("print.toml");
    for mode in ["print", "chatty"] {
        std::fs::write(
            &config,
            format!("[plugins.options.\"test:misbehave\"]\nmode = \"{mode}\"\n"),
        )
        .unwrap();
        let config = config.to_string_lossy().into_owned();
        let flags = ["--plugin", &misbehave, "--config", &config];
        let request = json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0});
        let (done, stderr) = generate(&flags, &[request], mode);
        assert_eq!(tokens(&done[0]).len(), 2, "{mode}: served, no trap");
        assert!(
            !stderr.contains("recreating the instance"),
            "{mode}: no fault:\n{stderr}"
        );
        if mode == "print" {
            for stream in ["stdout", "stderr"] {
                let line = format!("test:misbehave: misbehave: 1 waiting ({stream})");
                assert!(stderr.contains(&line), "{line:?} missing:\n{stderr}");
            }
        } else {
            let logged = stderr.matches("misbehave: chatty line").count();
            assert!(
                (150..=400).contains(&logged),
                "{logged} of 1000+ lines logged"
            );
            assert!(stderr.contains("test:misbehave: suppressed "), "{stderr}");
        }
    }
}
