//! `collective_rpc` over the `mp` executor: two real worker processes (the
//! `host` binary, each with the default model loaded), driven from this
//! process over the shared-memory queues.
//!
//! - `collective_rpc/noop/<replies>`: a blocking `check_health` round trip
//!   (broadcast, run the no-op, reply), answered by every rank or by rank 0
//!   only. Criterion reports the mean; p50/p99 over 20,000 calls are
//!   printed at the end.
//! - `encode/scheduler_output/<format>`: one busy step's `SchedulerOutput`
//!   (64 running decodes, one new 512-token prompt) encoded as the typed
//!   `RpcValue` with postcard, beside JSON text (the `RpcValue::Json` path
//!   worker extensions use), to justify typed variants for per-step calls.
//! - Idle CPU: the engine process and both workers over 5 s with no calls
//!   (utime + stime from /proc/<pid>/stat), as a share of one core.
//!
//! Run: `cargo bench -p host --bench rpc` (needs the default model:
//! `bash scripts/fetch-model.sh`).

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use host::config::{default_model_path, EngineConfig};
use host::engine::{Executor, MultiprocExecutor};
use host::message_queue::encode;
use host::sampling::SamplingParams;
use host::step::{CachedRequestData, NewRequestData, ReqHandle, RpcValue, SchedulerOutput};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(10));

fn config() -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = default_model_path(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    assert!(
        c.model.path.is_file(),
        "{} is missing; run `bash scripts/fetch-model.sh`",
        c.model.path.display()
    );
    c.model.max_model_len = 512;
    c.worker.num_threads = 1;
    c.cache.kv_cache_memory_bytes = Some(16 << 20);
    c.parallel.distributed_executor_backend = "mp".into();
    c.parallel.worker_executable = Some(env!("CARGO_BIN_EXE_host").into());
    c
}

fn noop(ex: &mut MultiprocExecutor, reply_rank: Option<usize>) {
    let replies = ex
        .call("check_health", RpcValue::Unit, reply_rank, TIMEOUT)
        .expect("check_health");
    debug_assert_eq!(replies.len(), if reply_rank.is_some() { 1 } else { 2 });
}

/// p50 and p99 round trip, µs, over `n` blocking no-op calls.
fn percentiles(ex: &mut MultiprocExecutor, reply_rank: Option<usize>, n: usize) -> (f64, f64) {
    let mut times: Vec<u64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            noop(ex, reply_rank);
            t.elapsed().as_nanos() as u64
        })
        .collect();
    times.sort_unstable();
    let at = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0;
    (at(0.5), at(0.99))
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/<pid>/stat");
    let rest = stat.rsplit(')').next().expect("stat has a command name");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

/// A busy step: 64 running decodes (one new block each every 16th) and
/// one new 512-token prompt.
fn busy_step() -> SchedulerOutput {
    let mut cached = CachedRequestData::default();
    cached.new_block_offsets.push(0);
    for i in 0..64u32 {
        cached.handles.push(ReqHandle(i));
        cached.resumed_from_preemption.push(false);
        cached.num_computed_tokens.push(100 + i * 7);
        if i % 16 == 0 {
            cached.new_block_ids.push(1000 + i);
        }
        cached
            .new_block_offsets
            .push(cached.new_block_ids.len() as u32);
    }
    let new = NewRequestData {
        handle: ReqHandle(64),
        request_id: "cmpl-0123456789abcdef".into(),
        prompt_token_ids: (0..512)
            .map(|i: u32| i.wrapping_mul(2_654_435_761) % 49152)
            .collect(),
        output_token_ids: Vec::new(),
        sampling_params: SamplingParams::default(),
        block_ids: (0..32).collect(),
        num_computed_tokens: 0,
    };
    let mut num_scheduled_tokens: Vec<(ReqHandle, u32)> =
        (0..64).map(|i| (ReqHandle(i), 1)).collect();
    num_scheduled_tokens.push((ReqHandle(64), 512));
    SchedulerOutput {
        step_id: 42,
        scheduled_new_reqs: vec![new],
        scheduled_cached_reqs: cached,
        num_scheduled_tokens,
        total_num_scheduled_tokens: 64 + 512,
        finished_req_ids: vec![],
        preempted_req_ids: vec![],
        scheduled_spec_decode_tokens: Default::default(),
    }
}

fn main() {
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(3));
    let mut ex = MultiprocExecutor::start(&config(), None, 2).expect("two workers start");
    let mut group = c.benchmark_group("collective_rpc/noop");
    for (name, rank) in [("all_ranks", None), ("rank0", Some(0))] {
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| noop(&mut ex, rank))
        });
    }
    group.finish();

    let step = RpcValue::SchedulerOutput(Box::new(busy_step()));
    let mut group = c.benchmark_group("encode/scheduler_output");
    group.bench_function("postcard", |b| {
        b.iter(|| encode(black_box(&step)).expect("encode"))
    });
    group.bench_function("json", |b| {
        b.iter(|| serde_json::to_vec(black_box(&step)).expect("json"))
    });
    group.finish();
    c.final_summary();

    println!("\ncollective_rpc no-op round trip, 2 worker processes, µs (20,000 calls)");
    for (name, rank) in [("all_ranks", None), ("rank0", Some(0))] {
        let (p50, p99) = percentiles(&mut ex, rank, 20_000);
        println!("{name:<10} p50 {p50:>7.2}  p99 {p99:>7.2}");
    }
    let postcard = encode(&step).expect("encode").len();
    let json = serde_json::to_vec(&step).expect("json").len();
    println!("\nbusy step's SchedulerOutput: postcard {postcard} B, JSON {json} B");

    let me = std::process::id();
    let pids: Vec<u32> = std::iter::once(me)
        .chain(ex.worker_pids().iter().copied())
        .collect();
    // Let the spinning waits fall asleep before measuring.
    std::thread::sleep(Duration::from_millis(500));
    let before: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
    let window = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    let secs = window.elapsed().as_secs_f64();
    println!("\nidle CPU over {secs:.1} s (share of one core)");
    for (i, (&pid, b)) in pids.iter().zip(&before).enumerate() {
        let who = if i == 0 {
            "engine".to_string()
        } else {
            format!("worker {}", i - 1)
        };
        println!(
            "{who:<9} pid {pid:<8} {:.3}%",
            100.0 * (cpu_seconds(pid) - b) / secs
        );
    }
    drop(ex);
}
