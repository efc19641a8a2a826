//! Worker-extension call costs, through the worker's method registry as
//! `collective_rpc` reaches them (argument parsing, lending the weights to
//! the store, the guest call, the JSON answer), on the real model:
//!
//! - `plugin_extension/stats/output_norm`: `engine:weight-tools.stats` of a
//!   576-value weight: mostly the per-call overhead;
//! - `plugin_extension/stats/attn_q`: of `blk.0.attn_q.weight` (576 x 576,
//!   Q4_1): dequantize on the host, 1.3 MB copied into the guest;
//! - `plugin_extension/scale/attn_q`: `scale` by 1.0 of the same weight: read,
//!   update (re-quantize to Q4_1) and re-prepare the layer for the kernels.
//!
//! Needs the plugins built (`cargo build --release --target wasm32-wasip2`
//! in `plugins/`) and the default model. Run:
//! `cargo bench -p host --bench plugin_extension`.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use host::config::EngineConfig;
use host::step::RpcValue;
use host::worker::{proc::worker_config, Worker, WorkerMethods};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn bench(c: &mut Criterion) {
    let mut config = EngineConfig::default();
    config.model.path = repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    config.plugins.paths =
        vec![repo().join("plugins/target/wasm32-wasip2/release/weight_tools.wasm")];
    config.worker.extension = vec!["engine:weight-tools".into()];
    let mut worker = Worker::new(worker_config(&config, None).unwrap()).unwrap();
    worker.init_device().unwrap();
    worker.load_model().unwrap();
    let mut methods = WorkerMethods::builtin();
    methods.register_extensions(&config).unwrap();

    let mut g = c.benchmark_group("plugin_extension");
    g.sample_size(20);
    let cases = [
        (
            "stats/output_norm",
            "stats",
            r#"{"name": "output_norm.weight"}"#,
        ),
        (
            "stats/attn_q",
            "stats",
            r#"{"name": "blk.0.attn_q.weight"}"#,
        ),
        (
            "scale/attn_q",
            "scale",
            r#"{"name": "blk.0.attn_q.weight", "factor": 1.0}"#,
        ),
    ];
    for (id, method, args) in cases {
        let method = format!("engine:weight-tools.{method}");
        g.bench_function(id, |b| {
            b.iter(|| {
                methods
                    .call(&mut worker, &method, RpcValue::Json(args.to_string()))
                    .unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
