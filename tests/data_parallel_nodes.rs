//! Issue 16, parts 2 and 6 for data parallelism: engine cores on another
//! machine. The test creates a network namespace joined to this one by a
//! veth pair (`ip netns`, as root); `host serve` runs here with
//! `data_parallel_size = 2, data_parallel_size_local = 1`, and `host serve
//! --headless` in the namespace runs rank 1, its queues over TCP across the
//! veth pair. Greedy streams equal one engine's, rank 1 serves some of them,
//! and killing rank 1's engine core mid-stream is survived (its machine
//! starts a new one, the server replays the streams there), or, with
//! restarts off, seen by `/health` within 2 s, naming the rank and address.

use crate::harness;
use crate::kill;

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use e2e::netns::{children, free_port, Node, Veth};
use harness::Server;
use serde_json::json;

/// `host serve` with rank 0 here and rank 1 on the namespace's machine.
fn serve_split(veth: &Veth, port: u16, more: &[&str]) -> (Server, Node) {
    let node = Node(veth.headless_engines(port, 2, 1));
    let port = port.to_string();
    let mut args = vec![
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--master-addr",
        &veth.addr_here,
        "--master-port",
        &port,
        "--set",
        "parallel.worker_start_timeout_s=60",
    ];
    args.extend_from_slice(more);
    (Server::start(&args), node)
}

/// The engine-core process the namespace's machine runs (a child of the
/// headless process; the namespace shares this machine's pid space).
fn remote_engine_core(node: &Node) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found: Vec<u32> = children(node.0.id())
            .into_iter()
            .flat_map(|p| std::iter::once(p).chain(children(p)))
            .filter(|&p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"engine-core"))
            })
            .collect();
        if let [pid] = found[..] {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "one remote engine core: {found:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_rank_on_another_machine_answers_as_one_engine_does_and_survives_its_death() {
    let _serial = kill::serial();
    let veth = Veth::new(4);
    let (server, node) = serve_split(&veth, free_port(), &[]);
    assert_eq!(
        kill::engine_cores(server.pid()).len(),
        1,
        "one engine core on the API server's machine"
    );

    let texts = kill::greedy_texts(&server.addr, 8, None);
    let prompts = server.metric_by_rank("vllm:prompt_tokens_total");
    assert_eq!(prompts.len(), 2, "one series per rank");
    assert!(
        prompts.iter().all(|&p| p > 0.0),
        "the remote rank served too: {prompts:?}"
    );

    // Rank 1's engine core dies mid-stream: its machine offers the rank
    // again, the server starts a new engine core there and replays.
    let victim = remote_engine_core(&node);
    let replayed = kill::greedy_texts(&server.addr, 8, Some(victim));
    assert_eq!(replayed, texts, "the replayed streams end as before");
    let restarts = server.metric_by_rank("vllm:engine_core_restarts_total");
    assert_eq!(restarts, vec![0.0, 1.0], "rank 1 was restarted once");
    assert_ne!(remote_engine_core(&node), victim, "a new engine core");
    drop(server);
    drop(node);

    let one = Server::start(&[]);
    assert_eq!(
        kill::greedy_texts(&one.addr, 8, None),
        texts,
        "each stream's greedy text does not depend on the machine that ran it"
    );
}

/// Opens a greedy stream and reads up to its first chunk.
fn open_stream(server: &Server, prompt: &str) -> BufReader<TcpStream> {
    let body = json!({"prompt": prompt, "max_tokens": 200, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut stream = BufReader::new(server.send(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    ));
    let mut line = String::new();
    while !line.starts_with("data: {") {
        line.clear();
        assert!(
            stream.read_line(&mut line).expect("read the stream") > 0,
            "ended early"
        );
    }
    stream
}

#[test]
fn losing_the_remote_engine_core_or_its_machine_is_seen_within_2_s() {
    let _serial = kill::serial();
    let veth = Veth::new(5);
    for kill_machine in [false, true] {
        let (server, node) = serve_split(&veth, free_port(), &["--set", "engine.max_restarts=0"]);
        assert_eq!(server.get("/health").status, 200);
        // The second stream goes to rank 1, by load.
        let streams = [
            open_stream(&server, "One, two,"),
            open_stream(&server, "A, B,"),
        ];
        let victim = if kill_machine {
            node.0.id()
        } else {
            remote_engine_core(&node)
        };
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &victim.to_string()])
            .status();
        assert!(killed.is_ok_and(|s| s.success()), "kill {victim}");
        let killed = Instant::now();
        while server.get("/health").status == 200 {
            assert!(
                killed.elapsed() < Duration::from_secs(2),
                "kill_machine={kill_machine}: /health still 200 after 2 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "kill_machine={kill_machine}: /health failed after {:?}",
            killed.elapsed()
        );
        let mut rest = String::new();
        for mut stream in streams {
            stream.read_to_string(&mut rest).expect("read the rest");
        }
        let error = rest
            .lines()
            .find(|l| l.contains("\"error\""))
            .unwrap_or_else(|| panic!("rank 1's stream ends with an error:\n{rest}"));
        assert!(error.contains("rank 1"), "names the rank: {error}");
        assert!(
            error.contains(&veth.addr_there),
            "names the address: {error}"
        );
    }
}
