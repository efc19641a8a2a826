//! What crossing machines costs a tensor-parallel group: TP = 3 on one
//! machine (shared-memory queues and all-reduce) against TP = 3 split 2 + 1
//! over a veth pair into a network namespace (the remote rank's queues and
//! every rank's all-reduce over TCP), in the same run, alternating.
//!
//! - `collective_rpc`: a blocking no-op `check_health` answered by all
//!   three ranks, p50 / p99 over 3,000 calls.
//! - Decode: one greedy stream, the time per output token between 8 and
//!   72 tokens (so the prompt's prefill cancels). A decode step runs two
//!   all-reduces per layer (60 for SmolLM2), so the difference per token
//!   divided by 60 is what one all-reduce of a token's 576 floats costs
//!   over TCP beyond shared memory.
//!
//! Run as root (it creates a network namespace):
//! `cargo bench -p e2e --bench multi_node` (`REPS=3` by default).

use std::time::{Duration, Instant};

use e2e::netns::{free_port, tp3_config, Node, Veth};
use host::config::EngineConfig;
use host::engine::{Executor, Llm, MultiprocExecutor};
use host::sampling::SamplingParams;
use host::step::RpcValue;

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(10));
/// SmolLM2-135M: 30 layers, two all-reduces each.
const ALL_REDUCES_PER_TOKEN: f64 = 60.0;

/// One measurement: rpc p50 and p99 (µs), decode ms per token.
struct Figures {
    rpc_p50: f64,
    rpc_p99: f64,
    decode_ms: f64,
}

fn measure(config: &EngineConfig, calls: usize) -> Figures {
    let mut ex = MultiprocExecutor::start(config, None, 3).expect("the group starts");
    let mut call = || {
        let t = Instant::now();
        ex.call("check_health", RpcValue::Unit, None, TIMEOUT)
            .expect("check_health");
        t.elapsed()
    };
    (0..200).for_each(|_| {
        call();
    });
    let mut times: Vec<Duration> = (0..calls).map(|_| call()).collect();
    times.sort();
    drop(ex);
    let us = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    let mut llm = Llm::new(config).expect("the engine starts");
    let mut generate = |max_tokens| {
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let t = Instant::now();
        e2e::generate_all(&mut llm, &["The capital of France is"], &params);
        t.elapsed().as_secs_f64()
    };
    generate(8);
    let (short, long) = (generate(8), generate(72));
    Figures {
        rpc_p50: us(0.5),
        rpc_p99: us(0.99),
        decode_ms: (long - short) / 64.0 * 1e3,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // once as a smoke test, short.
    let bench = std::env::args().any(|a| a == "--bench");
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if bench { 3 } else { 1 });
    let calls = if bench { 3_000 } else { 100 };
    let veth = Veth::new(9);
    let (mut shm, mut tcp) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        shm.push(measure(&tp3_config(1, "127.0.0.1", free_port()), calls));
        let port = free_port();
        let _node = Node(veth.headless_node(port));
        tcp.push(measure(&tp3_config(2, &veth.addr_here, port), calls));
        eprintln!("rep {rep} done");
    }
    let col = |v: &[Figures], f: fn(&Figures) -> f64| median(v.iter().map(f).collect());
    println!("| TP = 3 | rpc p50 µs | rpc p99 µs | decode ms/token |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, v) in [("one machine (shm)", &shm), ("2 + 1 over veth (TCP)", &tcp)] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.2} |",
            col(v, |f| f.rpc_p50),
            col(v, |f| f.rpc_p99),
            col(v, |f| f.decode_ms)
        );
    }
    let extra = col(&tcp, |f| f.decode_ms) - col(&shm, |f| f.decode_ms);
    println!(
        "\nper all-reduce over TCP beyond shared memory: {:.1} µs ({ALL_REDUCES_PER_TOKEN} per token)",
        extra / ALL_REDUCES_PER_TOKEN * 1e3
    );
}
