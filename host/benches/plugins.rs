//! WebAssembly plugin costs, beside the built-in code they replace:
//!
//! - `plugin_policy/order_waiting/<policy>/{256,1024}`: one per-step policy
//!   call ordering N waiting requests (the columns cross into the guest, the
//!   order comes back, the host validates it), for `builtin:fcfs`,
//!   `builtin:priority` and the plugins `engine:fcfs` and
//!   `engine:shortest-prompt-first`;
//! - `plugin_policy/pick_victim/<policy>/256`;
//! - `plugin_processor/process/64`: `engine:logit-bias` over a batch of 64
//!   rows of the real vocabulary size (49152), each request banning two
//!   tokens and biasing one: the call plus applying the edits;
//! - `plugin_load/{compile,cached}`: compiling a component with Cranelift
//!   versus loading its compiled form from the on-disk cache.
//!
//! Needs the plugins built: `cargo build --release --target wasm32-wasip2`
//! in `plugins/` (scripts/test.sh does it). Run:
//! `cargo bench -p host --bench plugins`.

use std::path::PathBuf;
use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use host::config::PluginsConfig;
use host::plugins::{host_from_config, runtime_from_config, PluginHost, Row};
use host::scheduler::{builtin_policy, RunningView, SchedulingPolicy, WaitingView};

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

fn bench_policy(c: &mut Criterion) {
    let cache = tempfile::tempdir().unwrap();
    let host = plugin_host(&["fcfs", "shortest_prompt_first"], cache.path());
    let mut group = c.benchmark_group("plugin_policy");
    let max = 1024u32;
    let ids: Vec<u32> = (0..=max).collect();
    let lens: Vec<u32> = (0..=max)
        .map(|i| 64 + (i.wrapping_mul(2_654_435_761) >> 7) % 512)
        .collect();
    let priorities: Vec<i32> = (0..=max)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 7) as i32)
        .collect();
    let arrivals: Vec<f64> = (0..=max).map(f64::from).collect();
    let names = [
        "builtin:fcfs",
        "builtin:priority",
        "engine:fcfs",
        "engine:shortest-prompt-first",
    ];
    for n in [256usize, 1024] {
        // Two queues shifted by one request, alternated, so no policy can
        // reuse its previous answer.
        let view = |k: usize| WaitingView {
            ids: &ids[k..k + n],
            prompt_lens: &lens[k..k + n],
            priorities: &priorities[k..k + n],
            arrival_times: &arrivals[k..k + n],
        };
        let queues = [view(0), view(1)];
        for name in names {
            let mut policy: Box<dyn SchedulingPolicy> = match builtin_policy(name) {
                Ok(p) => p,
                Err(_) => Box::new(host.wasm_policy(name).unwrap()),
            };
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
    for name in names {
        let mut policy: Box<dyn SchedulingPolicy> = match builtin_policy(name) {
            Ok(p) => p,
            Err(_) => Box::new(host.wasm_policy(name).unwrap()),
        };
        group.bench_function(
            BenchmarkId::new("pick_victim", format!("{name}/256")),
            |b| b.iter(|| black_box(policy.pick_victim(black_box(&running)))),
        );
    }
    group.finish();
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
        processors.add(i, Some(&args));
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
                .apply(black_box(&rows), &mut logits, vocab)
                .unwrap();
            black_box(logits[0])
        })
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

criterion_group!(benches, bench_policy, bench_processor, bench_load);
criterion_main!(benches);
