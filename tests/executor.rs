//! The `mp` executor with real worker processes on the real model: the same
//! greedy output as `uni`, in-order futures, method errors that leave the
//! worker serving, timeouts that do not hang, a killed worker reported by
//! rank and signal within a second, no orphan worker when the parent is
//! killed, and no shared-memory segment left behind.
//!
//! The tests run one at a time (a lock): each starts worker processes that
//! load the model, and the shared-memory check must not see another test's
//! queues.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use host::config::EngineConfig;
use host::engine::{Executor, ExecutorError, Llm, MultiprocExecutor};
use host::message_queue::shm_names;
use host::sampling::SamplingParams;
use host::step::RpcValue;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));

fn config(backend: &str) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 512;
    c.worker.num_threads = 1;
    c.cache.kv_cache_memory_bytes = Some(64 << 20);
    c.parallel.distributed_executor_backend = backend.into();
    c.parallel.worker_executable = Some(e2e::host_bin());
    c.parallel.worker_start_timeout_s = 60.0;
    c
}

/// Segments in /dev/shm owned by any of `pids` (names carry the owner's pid).
fn segments_of(pids: &[u32]) -> Vec<String> {
    shm_names()
        .into_iter()
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("hostmq-{p}-"))))
        .collect()
}

/// Whether `pid` still runs (a zombie has exited).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The process group of `pid` (field 5 of /proc/<pid>/stat).
fn process_group(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    let rest = stat.rsplit(')').next().expect("stat has a command name");
    rest.split_whitespace()
        .nth(2)
        .and_then(|g| g.parse().ok())
        .expect("pgrp field")
}

/// Sends `sig` (a name: KILL, STOP, CONT) to `pid`.
fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

fn greedy_tokens(backend: &str, prompts: &[&str]) -> Vec<Vec<u32>> {
    let mut llm = Llm::new(&config(backend)).expect("the engine starts");
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 16,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    e2e::generate_all(&mut llm, prompts, &params)
        .into_iter()
        .map(|c| c.token_ids)
        .collect()
}

#[test]
fn mp_greedy_output_equals_uni_and_leaves_no_segment() {
    let _serial = serial();
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
    ];
    let uni = greedy_tokens("uni", &prompts);
    let mp = greedy_tokens("mp", &prompts);
    assert_eq!(uni.len(), prompts.len());
    assert!(
        uni.iter().all(|t| t.len() == 16),
        "every request generates max_tokens"
    );
    assert_eq!(
        mp, uni,
        "the mp executor must generate exactly what uni does"
    );
    let me = std::process::id();
    assert_eq!(
        segments_of(&[me]),
        Vec::<String>::new(),
        "the engine left shared-memory segments behind"
    );
}

#[test]
fn futures_resolve_in_call_order_and_method_errors_leave_workers_serving() {
    let _serial = serial();
    let mut ex = MultiprocExecutor::start(&config("mp"), None, 2).expect("two workers start");
    let pids = ex.worker_pids().to_vec();
    // Each worker leads its own process group, so a terminal's Ctrl-C
    // reaches only the engine.
    for &pid in &pids {
        assert_eq!(
            process_group(pid),
            pid,
            "worker {pid} shares the engine's process group"
        );
    }
    // Resolving the later future first drains the earlier one's replies.
    let first = ex
        .collective_rpc("max_model_len", RpcValue::Unit, None, true, TIMEOUT)
        .unwrap();
    let second = ex
        .collective_rpc("check_health", RpcValue::Unit, Some(1), true, TIMEOUT)
        .unwrap();
    assert_eq!(second.result().unwrap(), vec![RpcValue::Unit]);
    assert_eq!(
        first.result().unwrap(),
        vec![RpcValue::Count(512), RpcValue::Count(512)]
    );

    let err = ex
        .call("execute_model", RpcValue::Count(3), None, TIMEOUT)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 0")
            && err.contains("execute_model expects a SchedulerOutput, got Count"),
        "{err}"
    );
    let err = ex
        .call("load_weights", RpcValue::Unit, Some(1), TIMEOUT)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown worker method `load_weights`") && err.contains("check_health"),
        "{err}"
    );
    let err = ex
        .call("compile_or_warm_up_model", RpcValue::Unit, Some(1), TIMEOUT)
        .unwrap_err();
    assert!(
        matches!(err, ExecutorError::Worker { rank: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("needs initialize_from_config"),
        "{err}"
    );
    let err = ex
        .call("check_health", RpcValue::Unit, Some(2), TIMEOUT)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unique_reply_rank 2 does not exist"), "{err}");
    // A dropped, unresolved future's reply is read and discarded.
    drop(
        ex.collective_rpc("max_model_len", RpcValue::Unit, Some(0), true, TIMEOUT)
            .unwrap(),
    );
    assert_eq!(
        ex.call("check_health", RpcValue::Unit, None, TIMEOUT)
            .unwrap(),
        vec![RpcValue::Unit; 2]
    );

    let me = std::process::id();
    let started = Instant::now();
    drop(ex);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        started.elapsed()
    );
    assert!(
        pids.iter().all(|&p| !alive(p)),
        "workers {pids:?} outlived the executor"
    );
    let mut all = pids.clone();
    all.push(me);
    assert_eq!(
        segments_of(&all),
        Vec::<String>::new(),
        "segments left behind"
    );
}

#[test]
fn a_timed_out_call_is_an_error_and_its_late_reply_does_not_shift_later_ones() {
    let _serial = serial();
    let mut ex = MultiprocExecutor::start(&config("mp"), None, 1).expect("a worker starts");
    let pid = ex.worker_pids()[0];
    signal(pid, "STOP");
    let started = Instant::now();
    let err = ex
        .call(
            "max_model_len",
            RpcValue::Unit,
            None,
            Some(Duration::from_millis(300)),
        )
        .unwrap_err();
    let waited = started.elapsed();
    signal(pid, "CONT");
    assert!(
        matches!(err, ExecutorError::Timeout { rank: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("max_model_len"), "{err}");
    assert!(
        waited < Duration::from_secs(2),
        "the timeout took {waited:?}"
    );
    // The late Count reply is dropped; this call gets its own Unit.
    assert_eq!(
        ex.call("check_health", RpcValue::Unit, None, TIMEOUT)
            .unwrap(),
        vec![RpcValue::Unit]
    );
}

#[test]
fn a_killed_worker_fails_the_next_call_within_a_second_naming_rank_and_signal() {
    let _serial = serial();
    let mut ex = MultiprocExecutor::start(&config("mp"), None, 2).expect("two workers start");
    let pids = ex.worker_pids().to_vec();
    assert_eq!(
        ex.call("check_health", RpcValue::Unit, None, TIMEOUT)
            .unwrap()
            .len(),
        2
    );
    signal(pids[1], "KILL");
    let started = Instant::now();
    let err = ex
        .call("check_health", RpcValue::Unit, None, TIMEOUT)
        .unwrap_err();
    let waited = started.elapsed();
    let text = err.to_string();
    assert!(
        waited < Duration::from_millis(1500),
        "noticed after {waited:?}"
    );
    assert!(
        text.contains("rank 1") && text.contains(&pids[1].to_string()),
        "{text}"
    );
    assert!(
        text.contains("signal: 9") || text.contains("SIGKILL"),
        "{text}"
    );
    // Sticky: later calls fail the same way, at once.
    let again = ex
        .call("check_health", RpcValue::Unit, Some(0), TIMEOUT)
        .unwrap_err()
        .to_string();
    assert_eq!(again, text);
    drop(ex);
    assert!(
        !alive(pids[0]),
        "the surviving worker outlived the executor"
    );
}

#[test]
fn a_worker_killed_during_a_call_fails_the_pending_future() {
    let _serial = serial();
    let mut ex = MultiprocExecutor::start(&config("mp"), None, 2).expect("two workers start");
    let pids = ex.worker_pids().to_vec();
    // Rank 1 is stopped, so the call is still pending when it is killed.
    signal(pids[1], "STOP");
    let pending = ex
        .collective_rpc("check_health", RpcValue::Unit, None, true, TIMEOUT)
        .unwrap();
    signal(pids[1], "KILL");
    let started = Instant::now();
    let err = pending.result().unwrap_err();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "noticed after {:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, ExecutorError::WorkerDied { rank: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("SIGKILL") || err.to_string().contains("signal: 9"),
        "{err}"
    );
}

#[test]
fn a_worker_that_cannot_load_its_model_fails_start_up_by_rank_and_leaves_nothing() {
    let _serial = serial();
    let mut c = config("mp");
    c.model.path = "/nonexistent/model.gguf".into();
    let err = MultiprocExecutor::start(&c, None, 1)
        .err()
        .expect("start-up must fail")
        .to_string();
    assert!(
        err.contains("rank 0") && err.contains("/nonexistent/model.gguf"),
        "{err}"
    );
    assert_eq!(segments_of(&[std::process::id()]), Vec::<String>::new());
}

/// Children of `parent` whose command line is `host worker`.
fn worker_children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|p| p.parse().ok());
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(parent) && cmd.split('\0').nth(1) == Some("worker")
        })
        .collect()
}

#[test]
fn a_parent_killed_with_sigkill_leaves_no_orphan_worker() {
    let _serial = serial();
    let model = e2e::default_model();
    let mut parent = Command::new(e2e::host_bin())
        .args([
            "generate",
            "--prompt",
            "Write a very long story about a dragon.",
            "--ignore-eos",
        ])
        .args([
            "--max-tokens",
            "4000",
            "--max-model-len",
            "4096",
            "--num-threads",
            "1",
        ])
        .arg("--model")
        .arg(&model)
        .args(["--set", "parallel.distributed_executor_backend=\"mp\""])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start host generate");
    let pid = parent.id();
    // Text on stdout means the worker started and the engine is stepping.
    let stdout = parent.stdout.take().expect("piped");
    let (tx, text) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut first = Vec::new();
        let _ = BufReader::new(stdout).read_until(b' ', &mut first);
        let _ = tx.send(first);
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let workers = loop {
        let workers = worker_children(pid);
        if !workers.is_empty() {
            break workers;
        }
        assert!(
            Instant::now() < deadline,
            "host generate started no worker within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let first = text
        .recv_timeout(Duration::from_secs(60))
        .expect("host generate printed nothing within 60 s");
    assert!(!first.is_empty(), "host generate exited without printing");
    signal(pid, "KILL");
    parent.wait().expect("reap the parent");
    let deadline = Instant::now() + Duration::from_secs(5);
    while workers.iter().any(|&w| alive(w)) {
        assert!(
            Instant::now() < deadline,
            "workers {workers:?} outlived their killed parent by 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
