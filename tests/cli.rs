//! The `host` binary as a user runs it: a chat answer on the real model, a
//! JSONL batch, and clear errors (never a panic, always a non-zero exit) for
//! bad configuration, bad flags and bad input files.

use std::path::Path;
use std::process::{Command, Output};

use e2e::{default_model, host_bin};

fn host(args: &[&str]) -> Output {
    Command::new(host_bin())
        .arg("--model")
        .arg(default_model())
        .args(args)
        .output()
        .expect("the host binary starts")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Fails with the command's stderr unless it exited non-zero with a message
/// containing every `needle` — and did not panic.
fn assert_clear_error(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert!(
        !out.status.success(),
        "expected a failure, got success; stderr:\n{err}"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit code 1 (an error, not a crash):\n{err}"
    );
    assert!(
        !err.contains("panicked"),
        "a panic instead of an error:\n{err}"
    );
    for needle in needles {
        assert!(
            err.contains(needle),
            "the error does not mention {needle:?}:\n{err}"
        );
    }
}

#[test]
fn chat_answer_names_the_capital() {
    let prompt = "What is the capital of France? Answer in one sentence.";
    let out = host(&[
        "generate",
        "--chat",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--prompt",
        prompt,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).expect("UTF-8 output");
    assert!(
        text.contains("Paris"),
        "a greedy SmolLM2 answer should name Paris, got: {text:?}"
    );
    assert!(
        !text.contains("<|im"),
        "special tokens are skipped in the output: {text:?}"
    );
}

#[test]
fn seeded_sampling_is_reproducible_and_stop_strings_cut() {
    let args = [
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "24",
        "--temperature",
        "0.9",
        "--seed",
        "11",
    ];
    let a = host(&args);
    let b = host(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout, "the same seed must give the same text");
    let full = String::from_utf8(a.stdout).unwrap();
    // Cut at the first space of the seeded text: the output must end right before it.
    let Some(cut) = full
        .trim_start()
        .find(' ')
        .map(|i| i + full.len() - full.trim_start().len())
    else {
        panic!("expected several words, got {full:?}")
    };
    let mut stop_args = args.to_vec();
    stop_args.extend(["--stop", " "]);
    let stopped = host(&stop_args);
    assert!(stopped.status.success(), "{}", stderr(&stopped));
    assert_eq!(
        String::from_utf8(stopped.stdout)
            .unwrap()
            .trim_end_matches('\n'),
        &full[..cut]
    );
}

#[test]
fn batch_file_in_results_file_out() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    let output = dir.path().join("results.jsonl");
    std::fs::write(
        &input,
        concat!(
            "{\"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"Say hi\"}], \"max_tokens\": 4}\n",
            "\n",
            "{\"prompt\": \"too many\", \"max_tokens\": 100000}\n",
        ),
    )
    .unwrap();
    let out = generate_batch(&[], &input, &output);
    let lines = results(&out, &output);
    assert_eq!(
        lines.len(),
        3,
        "one result per request, blank lines skipped: {lines:?}"
    );
    assert_eq!(lines[0]["token_ids"].as_array().unwrap().len(), 8);
    assert_eq!(lines[0]["finish_reason"], "length");
    assert!(
        lines[0]["text"].as_str().unwrap().contains("Paris"),
        "{lines:?}"
    );
    assert!(lines[1]["token_ids"].as_array().unwrap().len() <= 4);
    let err = lines[2]["error"]
        .as_str()
        .expect("the impossible request is refused with a reason");
    assert!(
        err.contains("max_model_len") || err.contains("max_tokens"),
        "{err}"
    );
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `host FLAGS generate --input INPUT --output OUTPUT`.
fn generate_batch(flags: &[&str], input: &Path, output: &Path) -> Output {
    let mut args = flags.to_vec();
    args.extend(["generate", "--input", path(input), "--output", path(output)]);
    host(&args)
}

/// The result lines of a batch that succeeded.
fn results(out: &Output, output: &Path) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "{}", stderr(out));
    std::fs::read_to_string(output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn bad_sampling_values_name_the_field() {
    let out = host(&["generate", "--prompt", "hi", "--top-p", "1.5"]);
    assert_clear_error(&out, &["top_p", "1.5"]);
    let out = host(&["generate", "--prompt", "hi", "--temperature=-1"]);
    assert_clear_error(&out, &["temperature"]);
}

#[test]
fn bad_config_names_the_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("engine.toml");
    std::fs::write(&config, "[scheduler]\nmax_num_seqs = 4\nmax_num_seqz = 4\n").unwrap();
    let out = host(&["--config", path(&config), "config", "show"]);
    assert_clear_error(&out, &["max_num_seqz", "line 3"]);
    let out = host(&[
        "--set",
        "parallel.distributed_executor_backend=ray",
        "config",
        "show",
    ]);
    assert_clear_error(&out, &["ray", "uni"]);
}

#[test]
fn bad_model_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("broken.gguf");
    std::fs::write(&fake, b"GGUF\x03\x00\x00\x00truncated").unwrap();
    let out = Command::new(host_bin())
        .args(["--model", path(&fake), "generate", "--prompt", "hi"])
        .output()
        .unwrap();
    assert_clear_error(&out, &["broken.gguf"]);
    let missing = dir.path().join("missing.gguf");
    let out = Command::new(host_bin())
        .args(["--model", path(&missing), "generate", "--prompt", "hi"])
        .output()
        .unwrap();
    assert_clear_error(&out, &["missing.gguf"]);
}

/// A kernel family the override cannot use is refused before anything
/// runs, naming the variable, the value and what to pick instead.
#[test]
fn a_bad_kernel_override_is_named() {
    let run = |value: &str| {
        Command::new(host_bin())
            .args([
                "--model",
                path(&default_model()),
                "generate",
                "--prompt",
                "hi",
            ])
            .env("HOST_CPU_KERNELS", value)
            .output()
            .unwrap()
    };
    assert_clear_error(&run("neon"), &["HOST_CPU_KERNELS", "\"neon\"", "scalar"]);
    // Which families a CPU lacks differs between machines (the AMD ones
    // lack AVX-VNNI), so this case uses one this CPU lacks, if any.
    let missing = host::kernels::CpuKernels::ALL
        .into_iter()
        .find(|k| !k.is_supported());
    if let Some(k) = missing {
        assert_clear_error(
            &run(k.name()),
            &["cannot run", k.name(), "Unset HOST_CPU_KERNELS"],
        );
    }
}

/// `host bench` refuses a context that cannot fit with an error naming the
/// flag, rather than overflowing.
#[test]
fn bench_refuses_an_overflowing_depth() {
    let out = Command::new(host_bin())
        .args(["--model", path(&default_model()), "bench"])
        .args(["--depth", &usize::MAX.to_string(), "--repetitions", "1"])
        .output()
        .unwrap();
    assert_clear_error(&out, &["--depth", "overflows"]);
}

/// `host bench` runs one worker in this process, so it refuses a parallel
/// layout instead of measuring a single unsharded rank under its name.
#[test]
fn bench_refuses_a_parallel_layout_it_cannot_measure() {
    for set in [
        "parallel.tensor_parallel_size=2",
        "parallel.data_parallel_size=2",
    ] {
        let out = Command::new(host_bin())
            .args(["--model", path(&default_model()), "bench"])
            .args([
                "--set",
                set,
                "--set",
                "parallel.distributed_executor_backend=\"mp\"",
            ])
            .args(["--repetitions", "1"])
            .output()
            .unwrap();
        assert_clear_error(
            &out,
            &["cannot measure", "bench throughput", "set them to 1"],
        );
    }
}

/// `host bench` says where its figures came from: the CPU's name and
/// flags as /proc/cpuinfo gives them, and the kernel family that ran (the
/// forced one when `HOST_CPU_KERNELS` names one).
#[test]
fn bench_names_the_cpu_and_the_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(host_bin())
        .args(["--model", path(&default_model()), "bench"])
        .args([
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "2",
            "--repetitions",
            "1",
        ])
        .args(["--json", path(&json)])
        .env("HOST_CPU_KERNELS", "scalar")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let model_name = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map(|(_, v)| v.trim())
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(model_name) && stdout.contains("kernels: scalar"),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        (v["cpu"].as_str(), v["kernels"].as_str()),
        (Some(model_name), Some("scalar"))
    );
    let flags = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags")?.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>())
        .unwrap();
    for flag in v["cpu_flags"].as_array().unwrap() {
        assert!(
            flags.contains(&flag.as_str().unwrap()),
            "{flag} is not a flag of this CPU"
        );
    }
    assert_eq!(
        v["cpu_flags"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "avx2"),
        flags.contains(&"avx2")
    );
}

#[test]
fn bad_batch_lines_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"temprature\": 0}\n",
    )
    .unwrap();
    let out = generate_batch(&[], &input, &dir.path().join("o.jsonl"));
    assert_clear_error(&out, &["in.jsonl:2", "temprature"]);
}

/// vLLM's `cache_salt` on a batch line: a prompt is served from the
/// prefix cache by an earlier prompt of the same salt only. One request runs
/// at a time, so each finds the blocks of those before it; a hit covers the
/// prompt's full blocks short of its last token (vLLM's rule).
#[test]
fn batch_lines_take_a_cache_salt() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("salted.jsonl");
    let output = dir.path().join("results.jsonl");
    let prompt = "The history of the city goes back two thousand years, to a small \
                  settlement of fishermen on the river bank, which grew into a market town \
                  and then, under the merchants of the middle ages, into a port that traded \
                  with every coast of the northern sea";
    let line = |salt: Option<&str>| {
        let mut l = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
        if let Some(salt) = salt {
            l["cache_salt"] = salt.into();
        }
        format!("{l}\n")
    };
    let salts = [None, None, Some("a"), Some("a"), Some("b"), None];
    std::fs::write(&input, salts.map(line).concat()).unwrap();
    let out = generate_batch(&["--max-num-seqs", "1"], &input, &output);
    let lines = results(&out, &output);
    let prompt_tokens = lines[0]["num_prompt_tokens"].as_u64().unwrap();
    let hit = (prompt_tokens - 1) / 16 * 16;
    assert!(hit >= 32, "a prompt of {prompt_tokens} tokens");
    let cached: Vec<u64> = lines
        .iter()
        .map(|l| l["num_cached_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(cached, [0, hit, 0, hit, 0, hit], "salts {salts:?}");

    std::fs::write(&input, line(Some(""))).unwrap();
    let out = generate_batch(&[], &input, &output);
    assert_clear_error(&out, &["salted.jsonl:1", "cache_salt", "must not be empty"]);
}

/// `n` on a batch line, as vLLM's parallel sampling: the line's result
/// holds `n` choices, each what the line gives alone with seed, seed + 1,
/// …; more than `server.max_n` is an error naming the line and the key.
/// One request runs at a time and the prompt is shorter than a KV block,
/// so every choice runs as its own line does.
#[test]
fn batch_lines_take_n_choices() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("choices.jsonl");
    let output = dir.path().join("results.jsonl");
    let line = |n: Option<u32>, seed: u64| {
        let mut l = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 1.0, "seed": seed});
        if let Some(n) = n {
            l["n"] = n.into();
        }
        format!("{l}\n")
    };
    let lines = [
        line(Some(3), 5),
        line(None, 5),
        line(None, 6),
        line(None, 7),
    ];
    std::fs::write(&input, lines.concat()).unwrap();
    let out = generate_batch(&["--max-num-seqs", "1"], &input, &output);
    let results = results(&out, &output);
    assert_eq!(results.len(), 4, "one result line per input line");
    let texts = |v: &serde_json::Value| (v["text"].clone(), v["token_ids"].clone());
    let choices: Vec<_> = results[0]["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(texts)
        .collect();
    let alone: Vec<_> = results[1..].iter().map(texts).collect();
    assert_eq!(choices, alone);
    assert!(
        choices[0] != choices[1] || choices[1] != choices[2],
        "{choices:?}"
    );

    std::fs::write(&input, line(Some(129), 1)).unwrap();
    let out = generate_batch(&[], &input, &output);
    assert_clear_error(&out, &["choices.jsonl:1", "n = 129", "server.max_n"]);
}

#[test]
fn config_show_prints_the_effective_config() {
    let out = host(&[
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "8",
        "--set",
        "scheduler.async_scheduling=false",
        "--kv-cache-dtype",
        "half",
        "config",
        "show",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let shown: toml::Table = String::from_utf8(out.stdout)
        .unwrap()
        .parse()
        .expect("config show prints TOML");
    assert_eq!(
        shown["scheduler"]["max_num_batched_tokens"].as_integer(),
        Some(512)
    );
    assert_eq!(shown["scheduler"]["max_num_seqs"].as_integer(), Some(8));
    assert_eq!(
        shown["scheduler"]["async_scheduling"].as_bool(),
        Some(false)
    );
    assert_eq!(
        shown["cache"]["block_size"].as_integer(),
        Some(16),
        "defaults are filled in"
    );
    assert_eq!(
        shown["cache"]["cache_dtype"].as_str(),
        Some("float16"),
        "--kv-cache-dtype, by its canonical name"
    );
}

/// A KV-cache type the engine does not implement is refused at start,
/// naming the key and the types that work.
#[test]
fn an_unknown_kv_cache_dtype_is_named() {
    let out = host(&["--kv-cache-dtype", "fp8_e5m2", "config", "show"]);
    assert_clear_error(&out, &["cache_dtype", "fp8_e5m2", "float16", "bfloat16"]);
}

/// `--chat-template` (vLLM's) replaces the model's template for `generate
/// --chat` too: the chat answers as the prompt the template writes; a
/// template that does not compile, or a path that names no file, stops
/// start-up naming the key.
#[test]
fn a_chat_template_flag_replaces_the_models() {
    let greedy = ["--temperature", "0", "--max-tokens", "12"];
    let prompt = ["--prompt", "The capital of France is"];
    let run = |args: &[&str]| {
        let out = host(&[args, &greedy, &prompt].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    // The template writes the message alone: the chat is the completion.
    let templated = run(&[
        "--chat-template",
        "{{ messages[0].content }}",
        "generate",
        "--chat",
    ]);
    assert_eq!(templated, run(&["generate"]));
    assert!(templated.contains("Paris"), "{templated:?}");
    assert_ne!(
        templated,
        run(&["generate", "--chat"]),
        "the model's own template differs"
    );

    for (bad, says) in [
        ("{% for m in messages %}", "does not compile"),
        ("missing.jinja", "missing.jinja"),
    ] {
        let out = host(&[
            "--chat-template",
            bad,
            "generate",
            "--chat",
            "--prompt",
            "hi",
        ]);
        assert_clear_error(&out, &["model.chat_template", says]);
    }
}
