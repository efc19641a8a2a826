//! WebAssembly plugin costs, beside the built-in code they replace:
//!
//! - `plugin_policy/order_waiting/<policy>/{256,1024}`: one per-step policy
//!   call ordering N waiting requests (the columns cross into the guest, the
//!   order comes back, the host validates it), for `builtin:fcfs`,
//!   `builtin:priority` and the plugins `engine:fcfs` and
//!   `engine:shortest-prompt-first`;
//! - `plugin_policy/pick_victim/<policy>/256`;
//! - `plugin_python/{order_waiting/<policy>/{16,256},pick_victim/<policy>/256}`:
//!   the same calls for `py:longest-prompt-first` (CPython inside the
//!   component, built by componentize-py) beside its Rust mirror
//!   `engine:shortest-prompt-first` and `builtin:fcfs`;
//! - `plugin_processor/process/64`: `engine:logit-bias` over a batch of 64
//!   rows of the real vocabulary size (49152), each request banning two
//!   tokens and biasing one: the call plus applying the edits;
//! - `plugin_mask/{mask,no_mask}/{49152,131072}`: the fixture
//!   `test:allow-mask` (WIT 0.3) over a batch of 64 rows at the default
//!   model's vocabulary and at 128k, every row answered with a packed
//!   allow-mask (`vocab / 64` u64 words, precomputed in the guest) that the
//!   host validates and applies (-inf to the disallowed logits), beside the
//!   same call with no mask; the difference over 64 is a mask's cost per row;
//! - `plugin_sampler/{host,engine:typical-p}/64`: sampling a batch of 64
//!   rows of the real vocabulary (seeded, temperature 0.8): the host's
//!   sampler beside the sampler plugin's whole path (the host's top-20
//!   candidates per row, one `choose` call, the chosen tokens recorded);
//!   `plugin_sampler/choose/64` is the plugin call alone;
//! - `plugin_load/{compile,cached}`: compiling a component with Cranelift
//!   versus loading its compiled form from the on-disk cache;
//! - `plugin_step/<policy>/{256,1024}`: one whole scheduler step
//!   (`schedule_into` + `update_from_output_into`) with N requests decoding
//!   and N more waiting, so the policy orders the queue every step (the
//!   waiting prompts are longer than the budget the decodes leave, so none
//!   is admitted and the step stays the same); `builtin:fcfs` beside the
//!   plugins `engine:fcfs` and `engine:shortest-prompt-first` (goal: a
//!   plugin's step <= 1.2x the built-in's).
//!
//! Needs the plugins built: `cargo build --release --target wasm32-wasip2`
//! in `plugins/` and `bash plugins/python/longest-prompt-first/build.sh`
//! (scripts/test.sh does both). Run:
//! `cargo bench -p host --bench plugins`.

use std::path::PathBuf;
use std::sync::Arc;

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use host::config::PluginsConfig;
use host::plugins::{host_from_config, runtime_from_config, PluginHost, Row};
use host::sampling::{RequestSampler, SamplingParams};
use host::scheduler::{
    builtin_policy, Request, RequestOutput, RunningView, Scheduler, SchedulerConfig,
    SchedulingPolicy, WaitingView,
};
use host::step::{ReqHandle, SchedulerOutput};

fn plugin(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release");
    let path = dir.join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --release --target wasm32-wasip2` in plugins/",
        path.display()
    );
    path
}

fn plugin_host(names: &[&str], cache: &std::path::Path) -> PluginHost {
    let config = PluginsConfig {
        paths: names.iter().map(|n| plugin(n)).collect(),
        cache_dir: Some(cache.to_path_buf()),
        ..PluginsConfig::default()
    };
    host_from_config(&config).expect("the plugins load")
}

/// `order_waiting` of `names` over queues of each of `sizes` waiting
/// requests, and `pick_victim` over 256 running ones, in benchmark group
/// `group`.
fn bench_policy_calls(
    c: &mut Criterion,
    group: &str,
    host: &PluginHost,
    names: &[&str],
    sizes: &[usize],
) {
    let policy = |name: &str| -> Box<dyn SchedulingPolicy> {
        match builtin_policy(name) {
            Ok(p) => p,
            Err(_) => Box::new(host.wasm_policy(name).unwrap()),
        }
    };
    let mut group = c.benchmark_group(group);
    let max = *sizes.iter().max().unwrap() as u32;
    let ids: Vec<u32> = (0..=max).collect();
    let lens: Vec<u32> = (0..=max)
        .map(|i| 64 + (i.wrapping_mul(2_654_435_761) >> 7) % 512)
        .collect();
    let priorities: Vec<i32> = (0..=max)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 7) as i32)
        .collect();
    let arrivals: Vec<f64> = (0..=max).map(f64::from).collect();
    for &n in sizes {
        // Two queues shifted by one request, alternated, so no policy can
        // reuse its previous answer.
        let view = |k: usize| WaitingView {
            ids: &ids[k..k + n],
            prompt_lens: &lens[k..k + n],
            priorities: &priorities[k..k + n],
            arrival_times: &arrivals[k..k + n],
        };
        let queues = [view(0), view(1)];
        for &name in names {
            let mut policy = policy(name);
            let mut order = Vec::with_capacity(n);
            let mut k = 0;
            group.bench_function(
                BenchmarkId::new("order_waiting", format!("{name}/{n}")),
                |b| {
                    b.iter(|| {
                        k ^= 1;
                        order.clear();
                        policy.order_waiting(black_box(&queues[k]), &mut order);
                        black_box(order.len())
                    })
                },
            );
        }
    }
    let running = RunningView {
        ids: &ids[..256],
        priorities: &priorities[..256],
        arrival_times: &arrivals[..256],
        num_computed_tokens: &lens[..256],
    };
    for &name in names {
        let mut policy = policy(name);
        group.bench_function(
            BenchmarkId::new("pick_victim", format!("{name}/256")),
            |b| b.iter(|| black_box(policy.pick_victim(black_box(&running)))),
        );
    }
    group.finish();
}

fn bench_policy(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["fcfs", "shortest_prompt_first"], cache.path());
    let names = [
        "builtin:fcfs",
        "builtin:priority",
        "engine:fcfs",
        "engine:shortest-prompt-first",
    ];
    bench_policy_calls(c, "plugin_policy", &host, &names, &[256, 1024]);
}

/// The Python policy (CPython inside the component, built by
/// componentize-py) beside its Rust mirror and the built-in.
fn bench_python_policy(c: &mut Criterion) {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/python/longest_prompt_first.wasm");
    assert!(
        python.is_file(),
        "{} is missing: run `bash plugins/python/longest-prompt-first/build.sh`",
        python.display()
    );
    // A fixed cache (shared with tests/plugins_python.rs): compiling CPython's
    // component takes tens of seconds, a cached load milliseconds.
    let host = host_from_config(&PluginsConfig {
        paths: vec![python, plugin("shortest_prompt_first")],
        cache_dir: Some(std::env::temp_dir().join("host-plugin-tests-cache")),
        ..PluginsConfig::default()
    })
    .expect("the plugins load");
    let names = [
        "py:longest-prompt-first",
        "engine:shortest-prompt-first",
        "builtin:fcfs",
    ];
    bench_policy_calls(c, "plugin_python", &host, &names, &[16, 256]);
}

fn bench_processor(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["logit_bias"], cache.path());
    let mut processors = host
        .logits_processors(&["engine:logit-bias".into()])
        .unwrap()
        .unwrap();
    let (batch, vocab) = (64usize, 49152usize);
    for i in 0..batch as u32 {
        let args = serde_json::json!({"banned_token_ids": [i, i + 100], "logit_bias": {(i + 200).to_string(): 1.5}});
        processors.add(i, Some(&args)).unwrap();
    }
    let rows: Vec<Row> = (0..batch)
        .map(|i| Row {
            id: i as u32,
            num_output_tokens: 3,
            last_token: 42,
            logits_row: i,
        })
        .collect();
    let mut logits = vec![0.0f32; batch * vocab];
    let mut group = c.benchmark_group("plugin_processor");
    group.bench_function(BenchmarkId::new("process", batch), |b| {
        b.iter(|| {
            processors
                .apply(black_box(&rows), &mut logits, vocab, |_| &[])
                .unwrap();
            black_box(logits[0])
        })
    });
    group.finish();
}

fn bench_mask(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["allow_mask"], cache.path());
    let batch = 64usize;
    let rows: Vec<Row> = (0..batch)
        .map(|i| Row {
            id: i as u32,
            num_output_tokens: 3,
            last_token: 42,
            logits_row: i,
        })
        .collect();
    let mut group = c.benchmark_group("plugin_mask");
    for vocab in [49152usize, 131072] {
        for masked in [true, false] {
            let mut processors = host
                .logits_processors(&["test:allow-mask".into()])
                .unwrap()
                .unwrap();
            for i in 0..batch as u32 {
                // A few hundred allowed tokens spread over the vocabulary.
                let ids: Vec<u32> = (0..300).map(|k| (i + k * 97) % vocab as u32).collect();
                let args = serde_json::json!({"allow_ids": ids});
                processors.add(i, masked.then_some(&args)).unwrap();
            }
            let mut logits = vec![0.0f32; batch * vocab];
            let name = if masked { "mask" } else { "no_mask" };
            group.bench_function(BenchmarkId::new(name, vocab), |b| {
                b.iter(|| {
                    processors
                        .apply(black_box(&rows), &mut logits, vocab, |_| &[])
                        .unwrap();
                    black_box(logits[0])
                })
            });
        }
    }
    group.finish();
}

fn bench_sampler(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["typical_p"], cache.path());
    let k = 20;
    let mut plugin = host.sampler("engine:typical-p", k).unwrap().unwrap();
    let (batch, vocab) = (64usize, 49152usize);
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(1),
        ..SamplingParams::default()
    };
    // A skewed, deterministic distribution per row.
    let logits: Vec<f32> = (0..batch * vocab)
        .map(|i| ((i as u64 * 2654435761) % 1000) as f32 / 100.0)
        .collect();
    let mut samplers: Vec<RequestSampler> = (0..batch)
        .map(|_| RequestSampler::new(&params, &[1, 2, 3], None))
        .collect();
    for i in 0..batch as u32 {
        plugin.add(i, None);
    }
    let mut work = logits.clone();
    let mut group = c.benchmark_group("plugin_sampler");
    group.bench_function(BenchmarkId::new("host", batch), |b| {
        b.iter(|| {
            work.copy_from_slice(&logits);
            for (row, s) in work.chunks_exact_mut(vocab).zip(&mut samplers) {
                black_box(s.sample(row, &params));
            }
        })
    });
    let mut candidates = Vec::with_capacity(k);
    group.bench_function(BenchmarkId::new("engine:typical-p", batch), |b| {
        b.iter(|| {
            work.copy_from_slice(&logits);
            plugin.clear_rows();
            let mut prepared = Vec::with_capacity(batch);
            for (i, (row, s)) in work.chunks_exact_mut(vocab).zip(&mut samplers).enumerate() {
                prepared.push(s.prepare(row, &params));
                s.top_candidates(row, &params, k, &mut candidates);
                plugin.push_row(i as u32, &candidates, s.next_uniform() as f32);
            }
            let tokens = plugin.choose().unwrap();
            for (((row, s), p), t) in work
                .chunks_exact(vocab)
                .zip(&mut samplers)
                .zip(prepared)
                .zip(tokens)
            {
                black_box(s.finish(row, t, p));
            }
        })
    });
    group.bench_function(BenchmarkId::new("choose", batch), |b| {
        b.iter(|| black_box(plugin.choose().unwrap()))
    });
    group.finish();
}

fn bench_load(c: &mut Criterion) {
    let bytes = std::fs::read(plugin("shortest_prompt_first")).unwrap();
    let uncached = runtime_from_config(&PluginsConfig {
        cache: false,
        ..PluginsConfig::default()
    })
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let cached: Arc<_> = runtime_from_config(&PluginsConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..PluginsConfig::default()
    })
    .unwrap();
    cached.load_component(&bytes).unwrap();
    let mut group = c.benchmark_group("plugin_load");
    group.sample_size(10);
    group.bench_function("compile", |b| {
        b.iter(|| uncached.load_component(black_box(&bytes)).unwrap())
    });
    group.bench_function("cached", |b| {
        b.iter(|| cached.load_component(black_box(&bytes)).unwrap())
    });
    group.finish();
}

/// Steps one scheduler serves before it is rebuilt (untimed).
const STRETCH: u64 = 500;

/// A scheduler with `n` requests decoding and `n` waiting that never fit
/// the budget the decodes leave, and the buffers an engine loop reuses.
struct QueuedEngine {
    scheduler: Scheduler,
    out: SchedulerOutput,
    sampled: Vec<(ReqHandle, [u32; 1])>,
    outputs: Vec<RequestOutput>,
}

impl QueuedEngine {
    fn new(n: u32, policy: Box<dyn SchedulingPolicy>) -> QueuedEngine {
        let (prompt, budget, max_tokens) = (128u32, 9000u32, 2 * STRETCH as u32);
        let config = SchedulerConfig {
            max_num_seqs: 2 * n,
            max_num_batched_tokens: budget,
            enable_chunked_prefill: false,
            max_model_len: budget,
            num_blocks: n * (prompt + max_tokens).div_ceil(16) + budget / 16 + 64,
            ..SchedulerConfig::new(0)
        };
        let mut scheduler = Scheduler::with_policy(config, policy).expect("valid bench config");
        let add = |s: &mut Scheduler, i: u32, len: u32, max_tokens: u32| {
            let ids = (0..len).map(|t| 1000 + (i * 7919 + t) % 40000).collect();
            let params = SamplingParams {
                max_tokens,
                ..SamplingParams::default()
            };
            let req = Request::new(format!("req-{i}"), ids, params, f64::from(i), 0);
            s.add_request(req).expect("request fits");
        };
        for i in 0..n {
            add(&mut scheduler, i, prompt, max_tokens);
        }
        let mut e = QueuedEngine {
            scheduler,
            out: SchedulerOutput::default(),
            sampled: Vec::new(),
            outputs: Vec::new(),
        };
        while e.out.total_num_scheduled_tokens != n {
            e.step();
        }
        // Longer than the budget the decodes leave (for n > 250), within
        // max_model_len; lengths differ so shortest-prompt-first really sorts.
        for i in n..2 * n {
            add(&mut e.scheduler, i, budget - 250 + (i * 37) % 150, 100);
        }
        e
    }

    /// One step: schedule, sample token 7 for every request that reached
    /// the end of its sequence, apply the samples.
    fn step(&mut self) {
        self.scheduler.schedule_into(&mut self.out);
        self.sampled.clear();
        for &(h, _) in &self.out.num_scheduled_tokens {
            let r = self
                .scheduler
                .request(h)
                .expect("scheduled request is live");
            if r.num_computed_tokens() >= r.num_tokens() {
                self.sampled.push((h, [7]));
            }
        }
        self.scheduler
            .update_from_output_into(&self.out, &self.sampled, &mut self.outputs);
    }
}

fn bench_step(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["fcfs", "shortest_prompt_first"], cache.path());
    let mut group = c.benchmark_group("plugin_step");
    group.measurement_time(Duration::from_secs(5));
    for n in [256u32, 1024] {
        for name in [
            "builtin:fcfs",
            "engine:fcfs",
            "engine:shortest-prompt-first",
        ] {
            let policy = || -> Box<dyn SchedulingPolicy> {
                match builtin_policy(name) {
                    Ok(p) => p,
                    Err(_) => Box::new(host.wasm_policy(name).unwrap()),
                }
            };
            group.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut done = 0;
                    while done < iters {
                        let mut e = QueuedEngine::new(n, policy());
                        let k = STRETCH.min(iters - done);
                        let start = Instant::now();
                        for _ in 0..k {
                            e.step();
                        }
                        total += start.elapsed();
                        assert_eq!(e.outputs.len(), n as usize, "{name}: every request decoded");
                        let stats = e.scheduler.make_stats();
                        assert_eq!(
                            (stats.num_waiting, stats.num_policy_fallbacks),
                            (n as usize, 0),
                            "{name}: the queue stays, the policy answers"
                        );
                        done += k;
                    }
                    total
                });
            });
        }
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_mask,
    bench_policy,
    bench_python_policy,
    bench_processor,
    bench_sampler,
    bench_load,
    bench_step
);
criterion_main!(benches);
