//! Scheduler step benchmarks: one engine step's scheduler work —
//! `schedule_into` plus `update_from_output_into` — with N running requests
//! all in decode (one token each), prefix caching on, so every 16th step per
//! request also hashes and caches a filled block, as in real serving.
//!
//! - `scheduler_step/decode/{256,1024}` with `builtin:fcfs`;
//! - `scheduler_step/decode_priority/256` with `builtin:priority` (the
//!   policy is only consulted when something waits or must be preempted, so
//!   this should match FCFS);
//! - `policy/order_waiting{,_unchanged}/<policy>/1024` and
//!   `policy/pick_victim/<policy>/256`: the policy hooks alone (wall time),
//!   the baseline for WebAssembly policies.
//!
//! Goal: ≤ 50 µs at 256 running (vLLM: ~0.5 ms). Times are the thread's CPU
//! time (see `thread_cpu_time`). Each measured stretch uses
//! a fresh scheduler warmed into decode outside the timing, so sequences stay
//! far from `max_tokens`.
//!
//! Run: `cargo bench -p host --bench scheduler`.

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use host::sampling::SamplingParams;
use host::scheduler::{
    builtin_policy, Request, RequestOutput, RunningView, Scheduler, SchedulerConfig, WaitingView,
    BUILTIN_POLICIES,
};
use host::step::{ReqHandle, SchedulerOutput};

const PROMPT: u32 = 128;
/// Steps one scheduler serves before it is rebuilt (untimed).
const STRETCH: u64 = 1000;

/// The buffers an engine loop would reuse across steps.
struct Engine {
    scheduler: Scheduler,
    out: SchedulerOutput,
    sampled: Vec<(ReqHandle, [u32; 1])>,
    outputs: Vec<RequestOutput>,
}

impl Engine {
    /// `n` requests with distinct 128-token prompts, stepped until all decode.
    fn new(n: u32, policy: &str) -> Self {
        let max_tokens = 4 * STRETCH as u32;
        let per_req_blocks = (PROMPT + max_tokens).div_ceil(16);
        let config = SchedulerConfig {
            max_num_seqs: n,
            max_num_batched_tokens: 8192,
            max_model_len: PROMPT + max_tokens,
            num_blocks: n * per_req_blocks,
            policy: policy.to_string(),
            ..SchedulerConfig::new(0)
        };
        let mut scheduler = Scheduler::new(config).expect("valid bench config");
        for i in 0..n {
            let prompt = (0..PROMPT).map(|t| 1000 + i * PROMPT + t).collect();
            let params = SamplingParams {
                max_tokens,
                ..SamplingParams::default()
            };
            scheduler
                .add_request(Request::new(
                    format!("req-{i}"),
                    prompt,
                    params,
                    f64::from(i),
                    0,
                ))
                .expect("request fits");
        }
        let mut e = Engine {
            scheduler,
            out: SchedulerOutput::default(),
            sampled: Vec::new(),
            outputs: Vec::new(),
        };
        while e.out.total_num_scheduled_tokens != n {
            e.step();
        }
        e
    }

    /// One step: schedule, "sample" token 7 for every scheduled request whose
    /// sequence is complete, and apply the samples.
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

/// This thread's CPU time. The benchmark reports CPU time rather than wall
/// time so that other load on a small shared machine (CI has 2 vCPUs) does
/// not count as scheduler cost; on an idle machine the two agree.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // every Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler_step");
    group.measurement_time(Duration::from_secs(5));
    for (name, n, policy) in [
        ("decode", 256u32, "builtin:fcfs"),
        ("decode", 1024, "builtin:fcfs"),
        ("decode_priority", 256, "builtin:priority"),
    ] {
        group.throughput(Throughput::Elements(u64::from(n)));
        group.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let mut e = Engine::new(n, policy);
                    let k = STRETCH.min(iters - done);
                    let start = thread_cpu_time();
                    for _ in 0..k {
                        e.step();
                    }
                    total += thread_cpu_time() - start;
                    assert_eq!(e.outputs.len(), n as usize, "every request decoded");
                    done += k;
                }
                total
            });
        });
    }
    group.finish();
}

/// The policy hooks alone over columnar views, the baseline a WebAssembly
/// policy will be compared with: ordering 1024 waiting requests (a queue that
/// changed since the last call, and one that did not) and picking a victim
/// among 256 running ones.
fn bench_policy_hooks(c: &mut Criterion) {
    let mut group = c.benchmark_group("policy");
    let n = 1024u32;
    let ids: Vec<u32> = (0..=n).collect();
    let lens: Vec<u32> = (0..=n).map(|i| 64 + i % 512).collect();
    let priorities: Vec<i32> = (0..=n)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 7) as i32)
        .collect();
    let arrivals: Vec<f64> = (0..=n).map(f64::from).collect();
    // Two different queues (shifted by one request) so that alternating
    // between them defeats any reuse of the previous order.
    let view = |k: usize| WaitingView {
        ids: &ids[k..k + n as usize],
        prompt_lens: &lens[k..k + n as usize],
        priorities: &priorities[k..k + n as usize],
        arrival_times: &arrivals[k..k + n as usize],
    };
    let queues = [view(0), view(1)];
    let running = RunningView {
        ids: &ids[..256],
        priorities: &priorities[..256],
        arrival_times: &arrivals[..256],
        num_computed_tokens: &lens[..256],
    };
    let mut order = Vec::with_capacity(n as usize);
    for name in BUILTIN_POLICIES {
        let mut policy = builtin_policy(name).expect("built-in policy");
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
        group.bench_function(
            BenchmarkId::new("order_waiting_unchanged", format!("{name}/{n}")),
            |b| {
                b.iter(|| {
                    order.clear();
                    policy.order_waiting(black_box(&queues[0]), &mut order);
                    black_box(order.len())
                })
            },
        );
        group.bench_function(
            BenchmarkId::new("pick_victim", format!("{name}/256")),
            |b| b.iter(|| policy.pick_victim(black_box(&running))),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_decode, bench_policy_hooks);
criterion_main!(benches);
