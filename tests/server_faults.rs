//! `host serve` under failure, end to end: a client that disconnects
//! mid-answer, SIGTERM with and without draining, and an engine that dies
//! under the server (a worker process killed). The engine's own counters in
//! `/metrics` and the process's exit status are the expectations.

use crate::harness;

use std::time::Duration;

use harness::{chunks, sse_data, Server};
use serde_json::json;

#[test]
fn a_client_that_disconnects_has_its_request_aborted_and_blocks_freed() {
    let server = Server::start(&[]);
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut conn = server.send("POST", "/v1/completions", &[], body.to_string().as_bytes());
    // Read until a few tokens arrived: the request is running and holds KV.
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while sse_data(&seen).len() < 3 {
        let n = std::io::Read::read(&mut conn, &mut buf).expect("stream read");
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(server.metric("vllm:kv_cache_usage_perc") > 0.0);
    drop(conn);
    server.wait_idle(Duration::from_secs(5));

    // Non-streaming too: the handler is dropped with the connection.
    let body = json!({"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": true});
    let conn = server.send("POST", "/v1/completions", &[], body.to_string().as_bytes());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while server.metric("vllm:num_requests_running") == 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conn);
    server.wait_idle(Duration::from_secs(5));
}

#[test]
fn sigterm_drains_running_requests_then_exits_zero() {
    let mut server = Server::start(&[]);
    let body = json!({"prompt": "Count:", "max_tokens": 40, "ignore_eos": true, "stream": true});
    let mut conn = server.send("POST", "/v1/completions", &[], body.to_string().as_bytes());
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut conn, &mut first).expect("the answer starts");
    server.signal("TERM");
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut conn, &mut rest).expect("the stream completes");
    let text = String::from_utf8_lossy(&rest);
    let cs = chunks(&sse_data(&text));
    let texts = cs
        .iter()
        .filter(|c| c["choices"][0]["text"].is_string())
        .count();
    assert_eq!(texts, 40, "a draining shutdown lets the request finish");
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "length");
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("exits after draining");
    assert!(status.success(), "{status:?}");
}

#[test]
fn sigterm_without_drain_aborts_running_requests() {
    let mut server = Server::start(&["--set", "server.drain_on_shutdown=false"]);
    let body = json!({"prompt": "Count:", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut conn = server.send("POST", "/v1/completions", &[], body.to_string().as_bytes());
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut conn, &mut first).expect("the answer starts");
    server.signal("TERM");
    let status = server
        .wait_exit(Duration::from_secs(10))
        .expect("exits without waiting for 3000 tokens");
    assert!(status.success(), "{status:?}");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut conn, &mut rest);
    let events = sse_data(&String::from_utf8_lossy(&rest));
    assert!(events.len() < 3000, "the request was cut short");
}

#[test]
fn a_dead_engine_answers_503_and_the_server_exits_nonzero() {
    // The engine (on the server's threads, so the worker is the server's
    // child) dies of a worker process killed under it, since restarts are
    // off (vLLM's behaviour; tests/recovery.rs covers the restarts).
    let server = Server::start(&[
        "--set",
        "parallel.distributed_executor_backend=\"mp\"",
        "--set",
        "server.engine_core_process=false",
        NO_RESTARTS[0],
        NO_RESTARTS[1],
    ]);
    kill_child_and_expect_503_then_exit(server, "the mp executor's worker");
}

#[test]
fn an_engine_core_process_serves_and_its_death_is_503_then_exit() {
    // vLLM's layout (the default): the engine core in its own process,
    // behind the same client; killing that process, restarts off, is the
    // engine dying.
    let server = Server::start(&NO_RESTARTS);
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4);
    kill_child_and_expect_503_then_exit(server, "the engine-core process");
}

#[test]
fn a_server_killed_with_sigkill_leaves_no_engine_core_or_worker_behind() {
    let server = Server::start(&["--set", "parallel.distributed_executor_backend=\"mp\""]);
    let engine_core = children(server.pid());
    assert_eq!(
        engine_core.len(),
        1,
        "the engine-core process: {engine_core:?}"
    );
    let workers = children(engine_core[0]);
    assert_eq!(workers.len(), 1, "its worker process: {workers:?}");
    server.signal("KILL");
    // The death pipes close with the killed process: both exit on their own.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            !stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
    };
    while [engine_core[0], workers[0]].into_iter().any(alive) {
        assert!(
            std::time::Instant::now() < deadline,
            "orphans left running after 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_idle_server_notices_its_worker_or_engine_core_dying_within_a_second() {
    // No request in flight: nothing but the engine's own watch can notice.
    // Restarts off: a death is the end (tests/recovery.rs restarts).
    let mp = [
        "--set",
        "parallel.distributed_executor_backend=\"mp\"",
        NO_RESTARTS[0],
        NO_RESTARTS[1],
    ];
    // The mp worker as the server's child (engine core on its threads).
    let server = Server::start(&[&mp[..], &["--set", "server.engine_core_process=false"]].concat());
    let worker = children(server.pid());
    assert_eq!(worker.len(), 1, "the worker process: {worker:?}");
    kill_idle_and_expect_503_then_exit(
        server,
        worker[0],
        "the mp worker under in-process engine core",
    );

    // The mp worker as the engine-core process's child (the default layout).
    let server = Server::start(&mp);
    let engine_core = children(server.pid());
    assert_eq!(
        engine_core.len(),
        1,
        "the engine-core process: {engine_core:?}"
    );
    let worker = children(engine_core[0]);
    assert_eq!(worker.len(), 1, "its worker process: {worker:?}");
    kill_idle_and_expect_503_then_exit(
        server,
        worker[0],
        "the mp worker under the engine-core process",
    );

    // The engine-core process itself.
    let server = Server::start(&NO_RESTARTS);
    let engine_core = children(server.pid());
    assert_eq!(
        engine_core.len(),
        1,
        "the engine-core process: {engine_core:?}"
    );
    kill_idle_and_expect_503_then_exit(server, engine_core[0], "the engine-core process");
}

/// The override that turns restarts off: what dies stays dead.
const NO_RESTARTS: [&str; 2] = ["--set", "engine.max_restarts=0"];

/// `GET /health`'s status, or `None` once the server no longer listens.
fn health(addr: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    String::from_utf8_lossy(&raw)
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}

/// With the server idle and healthy, SIGKILLs `victim`; `/health` must turn
/// 503 within a second (0.5 s slack for a loaded machine) and the server
/// exit non-zero soon after.
fn kill_idle_and_expect_503_then_exit(mut server: Server, victim: u32, what: &str) {
    assert_eq!(
        health(&server.addr),
        Some(200),
        "healthy before {what} dies"
    );
    let killed = std::process::Command::new("kill")
        .arg("-9")
        .arg(victim.to_string())
        .status()
        .unwrap();
    assert!(killed.success());
    let killed_at = std::time::Instant::now();
    loop {
        let status = health(&server.addr);
        let waited = killed_at.elapsed();
        match status {
            Some(503) => break,
            Some(200) => assert!(
                waited < Duration::from_millis(1500),
                "/health still 200 {waited:?} after {what} died"
            ),
            other => {
                panic!("/health answered {other:?} {waited:?} after {what} died, before any 503")
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server exits after the engine died");
    assert!(!status.success(), "{status:?}");
}

/// Kills the server's (first) child process with SIGKILL, then expects
/// every request to get 503 until the server exits, non-zero.
fn kill_child_and_expect_503_then_exit(mut server: Server, what: &str) {
    let ok = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let victims = children(server.pid());
    assert!(!victims.is_empty(), "{what} is a child process");
    let killed = std::process::Command::new("kill")
        .arg("-9")
        .arg(victims[0].to_string())
        .status()
        .unwrap();
    assert!(killed.success());
    // The engine notices within its step / monitor deadline; until the
    // process exits, every request is refused with 503.
    let mut saw_503 = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        match std::net::TcpStream::connect(&server.addr) {
            Err(_) => break, // the listener is gone: the process is exiting
            Ok(_) => {
                let r = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
                if r.status == 503 {
                    assert_eq!(r.json()["error"]["code"], 503);
                    assert_eq!(server.get("/health").status, 503);
                    saw_503 = true;
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(saw_503, "no 503 after {what} died");
    let status = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server exits after the engine died");
    assert!(!status.success(), "{status:?}");
}

/// Child processes of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let children =
            std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
        pids.extend(
            children
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    pids
}

#[test]
fn health_is_503_while_the_model_loads_then_200() {
    // A worker executable that waits 3 s before becoming `host worker`
    // holds the start-up open long enough to be seen from outside.
    let dir = std::env::temp_dir().join(format!("host-slow-worker-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("slow-host.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsleep 3\nexec {} \"$@\"\n",
            e2e::host_bin().display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(e2e::host_bin())
        .arg("--model")
        .arg(e2e::default_model())
        .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--set", "parallel.distributed_executor_backend=mp"])
        .arg("--set")
        .arg(format!(
            "parallel.worker_executable={:?}",
            script.display().to_string()
        ))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while seen.last() != Some(&200) {
        assert!(
            std::time::Instant::now() < deadline,
            "not ready within 60 s: {seen:?}"
        );
        if let Some(status) = health(&addr) {
            if seen.last() != Some(&status) {
                seen.push(status);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        seen,
        [503, 200],
        "loading answers 503, then ready answers 200"
    );
}
