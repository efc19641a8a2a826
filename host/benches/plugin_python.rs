//! What a scheduling policy written in Python costs per step, beside the
//! same kind of policy in Rust and the built-in:
//!
//! - `plugin_python/order_waiting/<policy>/{16,256}`: one per-step call
//!   ordering N waiting requests (the columns cross into the guest, the order
//!   comes back, the host validates it) for `py:longest-prompt-first`
//!   (CPython inside the component, built by componentize-py), its Rust
//!   mirror `engine:shortest-prompt-first` and `builtin:fcfs`;
//! - `plugin_python/pick_victim/py:longest-prompt-first/256`.
//!
//! Needs both plugins built (scripts/test.sh does it):
//! `bash plugins/python/longest-prompt-first/build.sh` and
//! `cargo build --release --target wasm32-wasip2` in `plugins/`. Run:
//! `cargo bench -p host --bench plugin_python`.

use std::path::PathBuf;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use host::config::PluginsConfig;
use host::plugins::host_from_config;
use host::scheduler::{builtin_policy, RunningView, SchedulingPolicy, WaitingView};

fn component(relative: &str, build: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative);
    assert!(path.is_file(), "{} is missing: {build}", path.display());
    path
}

fn bench_python_policy(c: &mut Criterion) {
    let python = component(
        "plugins/target/python/longest_prompt_first.wasm",
        "run `bash plugins/python/longest-prompt-first/build.sh`",
    );
    let rust = component(
        "plugins/target/wasm32-wasip2/release/shortest_prompt_first.wasm",
        "run `cargo build --release --target wasm32-wasip2` in plugins/",
    );
    // A fixed cache (shared with tests/plugins_python.rs): compiling CPython's
    // component takes tens of seconds, a cached load milliseconds.
    let host = host_from_config(&PluginsConfig {
        paths: vec![python, rust],
        cache_dir: Some(std::env::temp_dir().join("host-plugin-tests-cache")),
        ..PluginsConfig::default()
    })
    .expect("the plugins load");
    let max = 256u32;
    let ids: Vec<u32> = (0..=max).collect();
    let lens: Vec<u32> = (0..=max)
        .map(|i| 64 + (i.wrapping_mul(2_654_435_761) >> 7) % 512)
        .collect();
    let priorities = vec![0i32; ids.len()];
    let arrivals: Vec<f64> = (0..=max).map(f64::from).collect();
    let names = [
        "py:longest-prompt-first",
        "engine:shortest-prompt-first",
        "builtin:fcfs",
    ];
    let policy = |name: &str| -> Box<dyn SchedulingPolicy> {
        match builtin_policy(name) {
            Ok(p) => p,
            Err(_) => Box::new(host.wasm_policy(name).unwrap()),
        }
    };
    let mut group = c.benchmark_group("plugin_python");
    for n in [16usize, 256] {
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
    let mut python = policy(names[0]);
    group.bench_function(
        BenchmarkId::new("pick_victim", format!("{}/256", names[0])),
        |b| b.iter(|| black_box(python.pick_victim(black_box(&running)))),
    );
    group.finish();
}

criterion_group!(benches, bench_python_policy);
criterion_main!(benches);
