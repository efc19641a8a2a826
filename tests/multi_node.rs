//! A multi-node group across a real network boundary on one machine: the
//! test creates a network namespace joined to this one by a veth pair
//! (`ip netns`, as root), runs the engine here as node 0 and `host serve
//! --headless` in the namespace as node 1. Traffic flows only over the
//! veth pair (and loopback).
//!
//! - TP = 3 split 2 + 1: this machine's two ranks and the namespace's one
//!   share the all-reduce over TCP, and the greedy tokens and their
//!   logprobs equal, bit for bit, those of TP = 3 on one machine over
//!   shared memory (both sum the ranks' partials in rank order).
//! - Killing the remote worker, or the whole remote node, is a worker death
//!   the engine sees within 2 s, naming the rank and the node's address.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use host::config::EngineConfig;
use host::engine::{Completion, GenerateRequest, Llm, MultiprocExecutor, Prompt};
use host::sampling::SamplingParams;

use e2e::netns::{children, free_port, tp3_config, Node, Veth};

/// One test at a time: each starts three workers on the two cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn config(nnodes: usize, master: &str, port: u16) -> EngineConfig {
    let mut c = tp3_config(nnodes, master, port);
    // A lost node is fatal here, so the test sees the death itself.
    c.engine.max_restarts = 0;
    c
}

fn greedy(config: &EngineConfig, prompts: &[&str]) -> Vec<Completion> {
    let mut llm = Llm::new(config).expect("the engine starts");
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 16,
        ignore_eos: true,
        logprobs: Some(2),
        ..SamplingParams::default()
    };
    e2e::generate_all(&mut llm, prompts, &params)
}

#[test]
fn tp3_split_over_two_nodes_generates_what_tp3_on_one_machine_does() {
    let _serial = serial();
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "1, 2, 3, 4,",
    ];
    let one_machine = greedy(&config(1, "127.0.0.1", 29501), &prompts);

    let veth = Veth::new(1);
    let port = free_port();
    let _node = Node(veth.headless_node(port));
    let two_nodes = greedy(&config(2, &veth.addr_here, port), &prompts);
    for (p, (a, b)) in one_machine.iter().zip(&two_nodes).enumerate() {
        assert_eq!(a.token_ids.len(), 16);
        assert_eq!(
            a.token_ids, b.token_ids,
            "prompt {p}: the two-node group generated other tokens"
        );
        let bits = |c: &Completion| {
            c.logprobs
                .iter()
                .flat_map(|l| l.top.iter().map(|(t, lp)| (*t, lp.to_bits())))
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(a), bits(b), "prompt {p}: logprobs differ");
    }
}

/// Polls the executor until it reports a worker death, for at most `limit`.
fn death_within(ex: &MultiprocExecutor, limit: Duration) -> (String, Duration) {
    let start = Instant::now();
    loop {
        if let Some(e) = host::engine::Executor::worker_death(ex) {
            return (e.to_string(), start.elapsed());
        }
        assert!(
            start.elapsed() < limit,
            "no worker death reported within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill(pid: u32) {
    let ok = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -KILL {pid}");
}

#[test]
fn losing_the_remote_worker_or_its_node_is_a_death_named_within_2_s() {
    let _serial = serial();
    let veth = Veth::new(2);
    for kill_node in [false, true] {
        let port = free_port();
        let mut node = Node(veth.headless_node(port));
        let config = config(2, &veth.addr_here, port);
        let ex = MultiprocExecutor::start(&config, None, 3).expect("the two-node group starts");
        let pids = ex.worker_pids();
        assert_eq!(pids.len(), 3);
        assert!(
            pids.iter().all(|&p| p != 0),
            "every rank reported its pid: {pids:?}"
        );
        // Rank 2 is node 1's; its pid is a process in the namespace, which
        // shares this machine's pid space.
        kill(if kill_node { node.0.id() } else { pids[2] });
        let (death, took) = death_within(&ex, Duration::from_secs(2));
        eprintln!("kill_node={kill_node}: {death} (after {took:?})");
        assert!(death.contains("rank 2"), "{death}");
        assert!(
            death.contains(&veth.addr_there),
            "the node's address: {death}"
        );
        drop(ex);
        let _ = node.0.kill();
        let _ = node.0.wait();
    }
}

#[test]
fn a_group_whose_remote_worker_died_is_restarted_with_the_node_and_finishes_unchanged() {
    let _serial = serial();
    let prompts = ["The capital of France is", "Once upon a time"];
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 40,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut undisturbed = Llm::new(&config(1, "127.0.0.1", 29501)).expect("the engine starts");
    let reference = e2e::generate_all(&mut undisturbed, &prompts, &params);
    drop(undisturbed);

    let veth = Veth::new(3);
    let port = free_port();
    let node = Node(veth.headless_node(port));
    let mut c = config(2, &veth.addr_here, port);
    c.engine.max_restarts = 1;
    let mut llm = Llm::new(&c).expect("the two-node group starts");
    let requests: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| GenerateRequest::new(Prompt::Text(p.to_string()), params.clone()))
        .collect();
    let mut deltas = 0;
    let mut killed = None;
    let results = llm
        .generate(
            &requests,
            |_, _| {
                deltas += 1;
                if deltas == 10 {
                    // Node 1's only child is its worker, rank 2.
                    let victim = children(node.0.id());
                    assert_eq!(victim.len(), 1, "node 1 runs one worker: {victim:?}");
                    kill(victim[0]);
                    killed = Some(victim[0]);
                }
            },
            |_, _| {},
        )
        .expect("the engine outlives one restart");
    assert!(killed.is_some(), "the worker was killed mid-generation");
    assert_eq!(
        llm.stats().num_worker_restarts,
        1,
        "the group was restarted once"
    );
    for (p, (want, got)) in reference.iter().zip(results).enumerate() {
        let got = got.expect("every request finishes");
        assert_eq!(
            got.token_ids, want.token_ids,
            "prompt {p} changed across the restart"
        );
    }
    let now = children(node.0.id());
    assert!(
        now.len() == 1 && Some(now[0]) != killed,
        "node 1 runs a new worker for the new group: {now:?}, killed {killed:?}"
    );
}
