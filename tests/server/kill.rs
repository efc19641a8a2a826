//! What the recovery tests share: one server at a time, the prompts, and
//! `kill_client.py` (concurrent streams through the official `openai`
//! client, one process SIGKILLed once every stream has a chunk), plus the
//! shared-memory segments a process left.

#![allow(dead_code)] // each test file uses its own subset

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use host::message_queue::{shm_names, NAME_PREFIX};
use serde_json::{json, Value};

/// The served model's name: the default model's file stem.
pub const MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";
/// The client's bound on each of its waits (seconds): 16 streams take
/// ~10-20 s on a loaded two-core machine, a restart a few more.
pub const CLIENT_TIMEOUT_S: u64 = 150;

/// One server at a time: two would only compete for the two cores (and
/// blur the timings).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `n` distinct prompts.
pub fn prompts(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("Write a short story about the number {i}."))
        .collect()
}

/// The texts of `n` greedy streams (24 tokens) run at once through
/// kill_client.py, `kill_pid` killed once every stream has a chunk; every
/// stream must end without an error.
pub fn greedy_texts(addr: &str, n: usize, kill_pid: Option<u32>) -> Vec<String> {
    let report = run_client(addr, &prompts(n), 24, kill_pid).unwrap_or_else(|e| panic!("{e}"));
    report["streams"]
        .as_array()
        .expect("streams")
        .iter()
        .map(|s| {
            assert!(s["error"].is_null(), "{s}");
            s["text"].as_str().expect("a text").to_string()
        })
        .collect()
}

/// Runs kill_client.py against the server at `addr`: `prompts` streamed at
/// once (greedy, `ignore_eos`, `max_tokens`), `kill_pid` sent SIGKILL once
/// every stream has a chunk. Returns its report, or the script's output
/// when it failed. Bounded: the script bounds its own waits; it is killed
/// past twice that.
pub fn run_client(
    addr: &str,
    prompts: &[String],
    max_tokens: u64,
    kill_pid: Option<u32>,
) -> Result<Value, String> {
    let script = e2e::repo_root().join("tests/server/kill_client.py");
    let spec = json!({
        "prompts": prompts,
        "max_tokens": max_tokens,
        "kill_pid": kill_pid,
        "timeout_s": CLIENT_TIMEOUT_S,
    });
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{addr}/v1"))
        .arg(MODEL_NAME)
        .arg(spec.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python3");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        let (mut o, mut e) = (String::new(), String::new());
        let _ = out.read_to_string(&mut o);
        let _ = err.read_to_string(&mut e);
        (o, e)
    });
    let limit = Duration::from_secs(2 * CLIENT_TIMEOUT_S + 30);
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{} ran past {limit:?}", script.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = reader.join().unwrap();
    if !status.success() {
        return Err(format!(
            "{} failed ({status}); it needs `pip install -r tests/reference/requirements.txt` (openai)\n{stdout}\n{stderr}",
            script.display()
        ));
    }
    serde_json::from_str(&stdout).map_err(|e| format!("not JSON ({e}): {stdout}"))
}

/// The /dev/shm segments owned by any of `pids` (names carry the owner's
/// pid: `<prefix><pid>-<start time>-…`). A live queue's name is unlinked
/// once every reader attached, so what a death can leave is a queue no
/// reader attached yet.
pub fn segments_of(pids: &[u32]) -> Vec<String> {
    shm_names()
        .into_iter()
        .filter(|n| {
            pids.iter()
                .any(|p| n.starts_with(&format!("{NAME_PREFIX}{p}-")))
        })
        .collect()
}

/// The descendants of `pid` as (pid, command line), from `ps`.
pub fn descendants(pid: u32) -> Vec<(u32, String)> {
    let out = Command::new("ps")
        .args(["-eo", "pid=,ppid=,args="])
        .output()
        .expect("run ps");
    let table: Vec<(u32, u32, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let pid = parts.next()?.parse().ok()?;
            let ppid = parts.next()?.parse().ok()?;
            Some((pid, ppid, parts.collect::<Vec<_>>().join(" ")))
        })
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (child, _, args) in table.iter().filter(|(_, ppid, _)| *ppid == parent) {
            found.push((*child, args.clone()));
            frontier.push(*child);
        }
    }
    found
}

/// The `host engine-core` processes under `pid`.
pub fn engine_cores(pid: u32) -> Vec<u32> {
    descendants(pid)
        .into_iter()
        .filter(|(_, args)| args.split(' ').any(|a| a == "engine-core"))
        .map(|(pid, _)| pid)
        .collect()
}
