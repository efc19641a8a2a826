//! The structured-output plugin's mask time per token inside the host's
//! sandbox: `engine:structured-output` loaded as the worker loads it, given
//! SmolLM2's vocabulary, and one request constrained by the nested schema
//! of `plugins/structured-output/benches/nested.json` fed its valid answer
//! token by token; each step is one `LogitsProcessors::apply` (the WASM
//! call, the mask's copy out of the guest, its validation and the -inf pass
//! over a 49152-wide logits row). Prints p50/p99 per step, then criterion
//! times one whole answer. Its native twin, llguidance outside WASM on the
//! same schema and answer, is `cargo bench -p structured-output --bench
//! mask`; the ratio is the sandbox's overhead.
//!
//! Needs the model (`bash scripts/fetch-model.sh`) and the plugin built
//! (`cargo build --release --target wasm32-wasip2` in `plugins/`). Run:
//! `cargo bench -p host --bench structured`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use host::config::{default_model_path, EngineConfig, PluginsConfig};
use host::plugins::{host_from_config, LogitsProcessors, Row, Vocabulary};

/// Runs of the whole answer for the percentiles.
const RUNS: u32 = 20;

const NESTED: &str = include_str!("../../plugins/structured-output/benches/nested.json");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The plugin, given SmolLM2's vocabulary, and the answer's tokens.
fn setup(cache: &Path) -> (LogitsProcessors, Vec<u32>, usize) {
    let wasm = repo().join("plugins/target/wasm32-wasip2/release/structured_output.wasm");
    assert!(
        wasm.is_file(),
        "{} is missing: run `cargo build --release --target wasm32-wasip2` in plugins/",
        wasm.display()
    );
    let config = PluginsConfig {
        paths: vec![wasm],
        cache_dir: Some(cache.to_path_buf()),
        ..PluginsConfig::default()
    };
    let host = host_from_config(&config).expect("the plugin loads");
    let mut processors = host
        .logits_processors(&["engine:structured-output".into()])
        .expect("it is a logits processor")
        .expect("one processor");
    let mut engine = EngineConfig::default();
    engine.model.path = default_model_path(&repo());
    let tokenizer = host::engine::startup::load_tokenizer(&engine).expect("the model's tokenizer");
    let vocabulary = Vocabulary::from_tokens(tokenizer.tokens(), tokenizer.eos_token_id());
    processors
        .set_vocabulary(&vocabulary)
        .expect("set-vocabulary");
    let nested: serde_json::Value = serde_json::from_str(NESTED).expect("nested.json is JSON");
    let answer = tokenizer
        .encode(nested["answer"].as_str().expect("an answer"), false)
        .expect("the answer tokenizes");
    (processors, answer, tokenizer.vocab_size())
}

/// One request (`id`, a distinct grammar per `id`, so every run compiles
/// afresh) through the whole answer; `times` gets each step's time.
fn run(p: &mut LogitsProcessors, answer: &[u32], vocab: usize, id: u32, times: &mut Vec<Duration>) {
    let nested: serde_json::Value = serde_json::from_str(NESTED).unwrap();
    let args = serde_json::json!({"structured_outputs": {"json": nested["schema"]}, "run": id});
    p.add(id, Some(&args)).expect("the request is claimed");
    let mut logits = vec![0.0f32; vocab];
    for i in 0..=answer.len() {
        let row = Row {
            id,
            num_output_tokens: i as u32,
            last_token: if i == 0 { 0 } else { answer[i - 1] },
            logits_row: 0,
        };
        let outputs = &answer[..i];
        let t0 = Instant::now();
        let failed = p
            .apply(&[row], &mut logits, vocab, |_| outputs)
            .expect("the step runs");
        times.push(t0.elapsed());
        assert!(failed.is_empty(), "step {i} failed: {failed:?}");
        if let Some(&next) = answer.get(i) {
            assert!(
                logits[next as usize].is_finite(),
                "step {i}: the answer's token {next} is masked"
            );
        }
        logits.fill(0.0);
    }
    p.remove(id);
}

fn percentiles(what: &str, mut times: Vec<Duration>) {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    println!(
        "{what}: {} steps, p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        times.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

fn bench_structured(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let (mut p, answer, vocab) = setup(cache.path());
    println!(
        "{}",
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s
                .lines()
                .find(|l| l.starts_with("model name"))
                .map(str::to_string))
            .unwrap_or_default()
    );
    let mut times = Vec::new();
    for id in 0..RUNS {
        run(&mut p, &answer, vocab, id, &mut times);
    }
    percentiles(
        "apply (WASM mask + copy + validate + -inf), cold grammar",
        times,
    );
    let mut id = RUNS;
    c.bench_function("plugin_structured/whole_answer", |b| {
        b.iter(|| {
            id += 1;
            let mut t = Vec::new();
            run(&mut p, &answer, vocab, id, &mut t);
        })
    });
}

criterion_group!(benches, bench_structured);
criterion_main!(benches);
