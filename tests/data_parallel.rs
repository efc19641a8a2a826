//! Issue 16, part 1: `parallel.data_parallel_size = 2` behind one API
//! server, on the real model: two engine-core processes on disjoint cores,
//! greedy outputs equal to one engine's, every series of `/metrics` once per
//! rank, and a request sharing a cached prefix sent back to the engine that
//! holds it even when load alone would pick the other.

use crate::harness;
use crate::kill;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::time::Duration;

use harness::Server;
use serde_json::{json, Value};

/// `host serve` with `size` engine cores.
fn serve(size: usize) -> Server {
    let size = format!("parallel.data_parallel_size={size}");
    Server::start(&["--set", &size])
}

/// The cores a process may run on, from `/proc`.
fn cores_of(pid: u32) -> BTreeSet<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim();
    list.split(',')
        .flat_map(|range| {
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()
        })
        .collect()
}

#[test]
fn two_engines_on_their_own_cores_answer_as_one_does() {
    let _serial = kill::serial();
    let server = serve(2);
    let engines = kill::engine_cores(server.pid());
    assert_eq!(engines.len(), 2, "two engine-core processes: {engines:?}");
    let ours = cores_of(std::process::id());
    let (a, b) = (cores_of(engines[0]), cores_of(engines[1]));
    if ours.len() >= 2 {
        assert!(a.is_disjoint(&b), "each rank on its own cores: {a:?} {b:?}");
        assert_eq!(a.len() + b.len(), ours.len(), "between them, every core");
    }

    let texts = kill::greedy_texts(&server.addr, 12, None);
    // Twelve at once: the router spreads them by load over both ranks.
    let prompts = server.metric_by_rank("vllm:prompt_tokens_total");
    assert_eq!(prompts.len(), 2, "one series per rank");
    assert!(
        prompts.iter().all(|&p| p > 0.0),
        "both ranks served: {prompts:?}"
    );
    let finished = server.get("/metrics").text();
    for rank in 0..2 {
        let label = format!("engine=\"{rank}\",finished_reason=\"length\"");
        assert!(
            finished
                .lines()
                .any(|l| l.starts_with("vllm:request_success_total") && l.contains(&label)),
            "rank {rank}'s finished requests are counted under its label:\n{finished}"
        );
    }
    drop(server);

    let one = serve(1);
    assert_eq!(
        kill::greedy_texts(&one.addr, 12, None),
        texts,
        "each stream's greedy text does not depend on the rank that ran it"
    );
}

/// A prompt of about 100 tokens (six full 16-token blocks) on `topic`.
fn long_prompt(topic: &str) -> String {
    let sentence = format!("This sentence is about {topic} and nothing else at all. ");
    sentence.repeat(8)
}

fn complete(server: &Server, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The rank whose `series` grew between two readings (exactly one must).
fn rank_that_grew(before: &[f64], after: &[f64], series: &str) -> usize {
    let grew: Vec<usize> = (0..before.len())
        .filter(|&r| after[r] > before[r])
        .collect();
    assert_eq!(
        grew.len(),
        1,
        "{series} grew on one rank: {before:?} -> {after:?}"
    );
    grew[0]
}

#[test]
fn a_request_goes_to_the_engine_that_caches_its_prefix() {
    let _serial = kill::serial();
    let server = serve(2);
    let (a, b) = (long_prompt("apples"), long_prompt("boats"));

    // A is streamed and still running when B arrives, so B goes to the
    // other rank by load; each rank then caches one prefix.
    let mut stream = BufReader::new(server.send(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        json!({"prompt": a, "max_tokens": 48, "temperature": 0, "ignore_eos": true, "stream": true})
            .to_string()
            .as_bytes(),
    ));
    let mut line = String::new();
    while !line.starts_with("data: {") {
        line.clear();
        assert!(
            stream.read_line(&mut line).expect("read A's stream") > 0,
            "A's stream ended early"
        );
    }
    complete(&server, &b);
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut stream, &mut rest).expect("read the rest of A");
    server.wait_idle(Duration::from_secs(60));
    let served = server.metric_by_rank("vllm:prompt_tokens_total");
    assert!(
        served.iter().all(|&p| p > 0.0),
        "A and B on different ranks: {served:?}"
    );

    // Now both engines are idle: load alone would send every request to
    // rank 0. The cached prefixes must win.
    let mut ranks = Vec::new();
    for prompt in [&b, &a, &b] {
        let hits = server.metric_by_rank("vllm:prefix_cache_hits_total");
        let tokens = server.metric_by_rank("vllm:prompt_tokens_total");
        complete(&server, &format!("{prompt}So what is next?"));
        let rank = rank_that_grew(
            &tokens,
            &server.metric_by_rank("vllm:prompt_tokens_total"),
            "prompt tokens",
        );
        let hits_after = server.metric_by_rank("vllm:prefix_cache_hits_total");
        assert!(
            hits_after[rank] - hits[rank] >= 64.0,
            "rank {rank} reused the prefix it cached: hits {hits:?} -> {hits_after:?}"
        );
        ranks.push(rank);
    }
    assert_ne!(
        ranks[0], ranks[1],
        "B and A went where each was cached: {ranks:?}"
    );
    assert_eq!(
        ranks[0], ranks[2],
        "B went back to the same rank: {ranks:?}"
    );
}
