//! Issue 14, the engine-core side: the API server (`host serve`, engine core
//! in its own process, `uni` executor) whose engine-core process is killed
//! with SIGKILL mid-decode starts a new one and replays every unfinished
//! request, so 16 concurrent streams through the official `openai` client
//! (tests/server/kill_client.py) end exactly as an undisturbed run of
//! the same 16 on the same server did. With restarts off the kill ends
//! every stream with an error naming the death, and the server exits
//! non-zero within a bound. And through `EngineCoreClient` directly, what
//! races with a restart: a request added meanwhile is sent once, by the
//! replay, without blocking its caller; one aborted meanwhile is not
//! replayed; a utility call fails with a clear error; prompt logprobs reach
//! a stream once. A crash loop (every new process fails to start) spends
//! the budget and ends the streams with a message that says so.

#[path = "server/harness.rs"]
mod harness;
#[path = "server/kill.rs"]
mod kill;

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness::Server;
use host::config::EngineConfig;
use host::engine::{EngineCoreClient, EngineCoreError, EngineCoreRequest, OutputStream};
use host::sampling::SamplingParams;
use serde_json::Value;

/// Concurrent streams per run.
const STREAMS: usize = 16;
/// Tokens per stream: the kill lands once every stream has its first
/// chunk, a few tokens in, so with 40 every stream is still unfinished then
/// and all 16 are replayed (the test checks each got chunks after the kill).
const MAX_TOKENS: u64 = 40;
/// How long the server may take to exit after its engine died for good:
/// the death is noticed within 0.1 s, then the server answers 503 for
/// 1 s (`DEAD_GRACE`) and closes its listener within 1 s more.
const DEAD_EXIT: Duration = Duration::from_secs(10);

/// Runs the kill client's 16 streams against `server`, SIGKILLing
/// `kill_pid` once every stream has a chunk (see [`kill::run_client`]).
fn run_client(server: &Server, kill_pid: Option<u32>) -> Value {
    kill::run_client(&server.addr, &kill::prompts(STREAMS), MAX_TOKENS, kill_pid)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The server's engine-core process: its one child running `engine-core`.
fn engine_core(server: &Server) -> u32 {
    let cores = kill::engine_cores(server.pid());
    assert_eq!(cores.len(), 1, "one engine-core process: {cores:?}");
    cores[0]
}

/// The streams of a report.
fn streams(report: &Value) -> &Vec<Value> {
    let streams = report["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), STREAMS, "{report}");
    streams
}

#[test]
fn a_killed_engine_core_process_is_replaced_and_every_stream_ends_as_undisturbed() {
    let _serial = kill::serial();
    let mut server = Server::start(&[]);
    let reference = run_client(&server, None);
    let expected: Vec<String> = streams(&reference)
        .iter()
        .map(|s| {
            assert!(s["error"].is_null(), "undisturbed: {s}");
            assert_eq!(s["finish_reason"], "length", "undisturbed: {s}");
            s["text"].as_str().expect("a text").to_string()
        })
        .collect();

    let victim = engine_core(&server);
    let report = run_client(&server, Some(victim));
    assert!(
        report["kill_error"].is_null() && report["killed_at"].is_f64(),
        "{report}"
    );
    for (i, s) in streams(&report).iter().enumerate() {
        assert!(s["error"].is_null(), "stream {i} survives the kill: {s}");
        assert_eq!(s["finish_reason"], "length", "stream {i}: {s}");
        assert_eq!(
            s["text"].as_str(),
            Some(expected[i].as_str()),
            "stream {i} ends as the undisturbed run did"
        );
        // Under way at the kill, and not finished: it was replayed.
        let before = s["chunks_before_kill"].as_u64().unwrap_or(0);
        assert!(before >= 1, "stream {i} had a chunk before the kill: {s}");
        assert!(
            s["chunks"].as_u64().unwrap_or(0) > before,
            "stream {i} got chunks after the kill: {s}"
        );
    }

    // One restart, replaying the 16 requests, all unfinished at the kill.
    assert_eq!(server.metric("vllm:engine_core_restarts_total"), 1.0);
    assert_eq!(
        server.metric("vllm:engine_core_replayed_requests_total"),
        STREAMS as f64
    );
    // The counters span both processes, and a replayed token is recomputed,
    // not counted again: two runs of 16 x 40 tokens.
    assert_eq!(
        server.metric("vllm:generation_tokens_total"),
        (2 * STREAMS as u64 * MAX_TOKENS) as f64
    );
    assert_eq!(server.get("/health").status, 200);

    // The new engine core is the server's only descendant: nothing orphaned.
    let replacement = engine_core(&server);
    assert_ne!(replacement, victim, "a new engine-core process");
    let rest = kill::descendants(server.pid());
    assert_eq!(
        rest.iter().map(|(pid, _)| *pid).collect::<Vec<_>>(),
        [replacement],
        "no orphans: {rest:?}"
    );
    // The dead process's queues went with it (its output queue's name was
    // unlinked once attached; the restart's new queues sweep what a dead
    // owner left).
    assert_eq!(kill::segments_of(&[victim]), Vec::<String>::new());

    // SIGTERM reaches the new process as it would the first: a clean exit,
    // the replacement reaped before the server exits.
    server.signal("TERM");
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("the server exits after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(
        !std::path::Path::new(&format!("/proc/{replacement}")).exists(),
        "the replacement engine core outlived the server"
    );
}

#[test]
fn with_restarts_off_a_killed_engine_core_ends_every_stream_and_the_server() {
    let _serial = kill::serial();
    let mut server = Server::start(&["--set", "engine.max_restarts=0"]);
    let victim = engine_core(&server);
    let report = run_client(&server, Some(victim));
    assert!(
        report["kill_error"].is_null() && report["killed_at"].is_f64(),
        "{report}"
    );
    let killed_at = report["killed_at"].as_f64().expect("the kill's time");
    for (i, s) in streams(&report).iter().enumerate() {
        let error = s["error"].as_str().unwrap_or_default();
        for part in [
            format!("the engine-core process (pid {victim}) exited: signal: 9"),
            "engine.max_restarts = 0".to_string(),
        ] {
            assert!(error.contains(&part), "stream {i} names `{part}`: {s}");
        }
        assert!(
            s["finish_reason"].is_null(),
            "stream {i} did not finish: {s}"
        );
    }
    let status = server
        .wait_exit(DEAD_EXIT)
        .unwrap_or_else(|| panic!("the server still runs {DEAD_EXIT:?} after the client ended"));
    let since_kill = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        - killed_at;
    assert!(!status.success(), "exits non-zero: {status:?}");
    assert!(
        since_kill < DEAD_EXIT.as_secs_f64(),
        "the server exited {since_kill:.1} s after the kill"
    );
    assert_eq!(kill::segments_of(&[victim]), Vec::<String>::new());
}

/// A request for `text`: greedy, `max_tokens`, with prompt logprobs.
fn request(id: &str, ids: &[u32], max_tokens: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: ids.to_vec(),
        sampling_params: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            prompt_logprobs: Some(1),
            ..SamplingParams::default()
        },
        priority: 0,
        output_token_ids: Vec::new(),
        prediction: Vec::new(),
        cache_salt: None,
    }
}

/// A stream read to its end: its tokens and the prompt positions its
/// prompt logprobs covered, in order.
fn drain(mut stream: OutputStream) -> (Vec<u32>, Vec<u32>) {
    let (mut tokens, mut positions) = (Vec::new(), Vec::new());
    while let Some(out) = stream.blocking_next() {
        let out = out.unwrap_or_else(|e| panic!("the request survives the restart: {e}"));
        tokens.extend(out.new_token_ids);
        if let Some(chunk) = out.new_prompt_logprobs {
            positions.extend(chunk.start..chunk.start + chunk.entries.len() as u32);
        }
        if out.finish_reason.is_some() {
            break;
        }
    }
    (tokens, positions)
}

#[test]
fn what_races_a_restart_is_sent_once_aborted_or_refused_clearly() {
    let _serial = kill::serial();
    let mut config = EngineConfig::default();
    config.model.path = e2e::default_model();
    config.parallel.worker_executable = Some(e2e::host_bin());
    let (client, tokenizer) = EngineCoreClient::start_process(&config).unwrap();
    let texts = ["Once upon a time,", "The three primary colors are"];
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tokenizer.encode(t, true).unwrap())
        .collect();
    let whole: Vec<u32> = (1..ids[0].len() as u32).collect();
    let reference: Vec<Vec<u32>> = ids
        .iter()
        .map(|p| {
            let (tokens, positions) = drain(client.add_request(request("ref", p, 24)).unwrap());
            assert_eq!(positions, (1..p.len() as u32).collect::<Vec<_>>());
            tokens
        })
        .collect();

    let mut running = client.add_request(request("a", &ids[0], 24)).unwrap();
    let first = running.blocking_next().unwrap().unwrap();
    let victim = client.process_id().unwrap();
    let killed = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // The client names the replacement as soon as it is spawned; it then
    // loads the model (~0.5 s here) before it is connected: these land
    // while it does.
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.process_id() == Some(victim) {
        assert!(Instant::now() < deadline, "no replacement spawned");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    let added = client.add_request(request("b", &ids[1], 24)).unwrap();
    let aborted = client.add_request(request("c", &ids[1], 24)).unwrap();
    drop(aborted);
    let adding = t0.elapsed();
    match client.call_utility("reset_prefix_cache", Value::Null) {
        Err(EngineCoreError::Unavailable(why)) => {
            assert!(why.contains("engine-core process died"), "{why}")
        }
        other => panic!("a utility call during the restart fails clearly: {other:?}"),
    }
    assert_eq!(
        client.restarts().restarts,
        0,
        "the adds and the call landed during the restart"
    );
    assert!(client.is_alive());
    assert!(
        adding < Duration::from_millis(200),
        "adding during a restart does not wait for it: {adding:?}"
    );

    // `a` resumes: the same tokens, its prompt logprobs not sent again;
    // `b` is sent once, by the replay, with its prompt logprobs once.
    let (rest, positions) = drain(running);
    let mut tokens = first.new_token_ids;
    tokens.extend(rest);
    let mut a_positions: Vec<u32> = first
        .new_prompt_logprobs
        .map(|c| (c.start..c.start + c.entries.len() as u32).collect())
        .unwrap_or_default();
    a_positions.extend(positions);
    assert_eq!(tokens, reference[0]);
    assert_eq!(a_positions, whole);
    let (tokens, positions) = drain(added);
    assert_eq!(tokens, reference[1]);
    assert_eq!(positions, (1..ids[1].len() as u32).collect::<Vec<_>>());
    // Only `a` was replayed: `b` was new to every process, `c` aborted.
    let restarts = client.restarts();
    assert_eq!((restarts.restarts, restarts.replayed_requests), (1, 1));
    assert_ne!(client.process_id(), Some(victim));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = client.stats().scheduler;
        if (s.num_running, s.num_waiting) == (0, 0) {
            break;
        }
        assert!(Instant::now() < deadline, "`c` still runs: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    client.shutdown(false);
    assert_eq!(kill::segments_of(&[victim]), Vec::<String>::new());
}

#[test]
fn a_crash_loop_spends_the_budget_and_ends_every_stream_saying_so() {
    let _serial = kill::serial();
    // A private copy of the model, to break while the engine core runs.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join(e2e::default_model().file_name().unwrap());
    std::fs::copy(e2e::default_model(), &model).unwrap();
    let mut config = EngineConfig::default();
    config.model.path = model.clone();
    config.parallel.worker_executable = Some(e2e::host_bin());
    config.engine.max_restarts = 2;
    let (client, tokenizer) = EngineCoreClient::start_process(&config).unwrap();
    let ids = tokenizer.encode("Once upon a time,", true).unwrap();
    let mut stream = client.add_request(request("a", &ids, 200)).unwrap();
    stream.blocking_next().unwrap().unwrap();
    // Garbage in its place, by rename: the running process keeps the file
    // it mapped; every new one opens the garbage and fails to start.
    let garbage = dir.path().join("garbage.tmp");
    std::fs::write(&garbage, vec![0x5a; 1 << 20]).unwrap();
    std::fs::rename(&garbage, &model).unwrap();
    let victim = client.process_id().unwrap();
    let t0 = Instant::now();
    let killed = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let end = loop {
        match stream.blocking_next() {
            Some(Ok(out)) if out.finish_reason.is_none() => continue,
            other => break other,
        }
    };
    let ended = t0.elapsed();
    let Some(Err(EngineCoreError::Dead(reason))) = end else {
        panic!("the stream ends with the engine-dead sentinel, got {end:?}");
    };
    for part in [
        format!("the engine-core process (pid {victim}) exited: signal: 9"),
        "a crash loop: 2 restart(s) in a row failed to start".into(),
        "not restarted".into(),
        "engine.max_restarts = 2".into(),
    ] {
        assert!(
            reason.contains(&part),
            "the reason names `{part}`: {reason}"
        );
    }
    // Measured: ~35 ms (two starts that fail at the model file); 30 s
    // leaves room for a loaded machine.
    assert!(ended < Duration::from_secs(30), "ended after {ended:?}");
    assert!(!client.is_alive());
    assert_eq!(client.restarts(), Default::default());
    client.shutdown(false);
    // The failed starts were reaped, and the dead process left no segment.
    let left: Vec<_> = kill::descendants(std::process::id())
        .into_iter()
        .filter(|(_, args)| args.contains("engine-core"))
        .collect();
    assert!(left.is_empty(), "no engine-core process left: {left:?}");
    assert_eq!(kill::segments_of(&[victim]), Vec::<String>::new());
    eprintln!("crash loop: the stream ended {ended:?} after the kill");
}
