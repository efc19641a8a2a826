//! Issue 14, the worker side: a `host serve` whose `mp` worker is killed
//! with SIGKILL mid-decode replaces its worker group and finishes every
//! stream exactly as an undisturbed run of the same server did, through the
//! official `openai` client (tests/server/kill_client.py).
//!
//! - TP = 1: 16 concurrent greedy streams, the worker killed once every
//!   stream has a chunk: same texts, `length`, `max_tokens` completion
//!   tokens each; a new worker process; the restart logged and counted.
//! - TP = 3: the same with rank 1 killed; all three ranks are replaced.
//! - A crash loop: the model file is replaced by garbage while the server
//!   runs, so every restart dies while starting; with
//!   `engine.max_restarts = 2` the stream ends with an error, the server
//!   exits non-zero within a bound, and its log names the death, `not
//!   restarted` and `crash loop`.
//!
//! After each case no process the server started outlives it (every one
//! carries an environment marker of this case, which children inherit), and
//! no /dev/shm segment owned by any process involved is left (segment names
//! carry the owner's pid, host/src/message_queue/process.rs).

use crate::harness;
use crate::kill;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Streams per run: more than one step's worth of decode rows, so the kill
/// lands on a full batch.
const STREAMS: usize = 16;
/// Tokens per stream: long enough that every stream is mid-decode when the
/// kill lands (a few tokens in), short enough for two cores.
const MAX_TOKENS: u64 = 48;
/// How long the server may take to exit after SIGTERM (it drains nothing:
/// every request has finished) or after its engine died.
const EXIT: Duration = Duration::from_secs(30);

/// A `host serve` process on a loopback port, its stderr kept in a file (the
/// harness's `Server` inherits stderr, and these tests read the log), and an
/// environment marker every process it starts inherits. Killed when dropped.
struct Served {
    child: Child,
    addr: String,
    log: PathBuf,
    marker: String,
    _dir: tempfile::TempDir,
}

/// The environment variable that marks a case's processes.
const MARKER_VAR: &str = "E2E_RECOVERY_MARKER";

impl Served {
    /// `host --model MODEL serve --host 127.0.0.1 --port 0` with the `mp`
    /// executor and `args`.
    fn start(model: &Path, args: &[&str]) -> Served {
        let dir = tempfile::tempdir().expect("a temp dir for the log");
        let log = dir.path().join("stderr.log");
        let marker = format!(
            "{}-{}",
            std::process::id(),
            dir.path().file_name().unwrap().to_string_lossy()
        );
        let mut child = Command::new(e2e::host_bin())
            .arg("--model")
            .arg(model)
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(["--set", "parallel.distributed_executor_backend=mp"])
            .args(args)
            .env(MARKER_VAR, &marker)
            // Plain log lines, to match on.
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("the log file"))
            .spawn()
            .expect("spawn host serve");
        let addr = match harness::listening_address(&mut child).recv_timeout(harness::STARTUP) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "host serve did not print its address within {:?}:\n{}",
                    harness::STARTUP,
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        Served {
            child,
            addr,
            log,
            marker,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's stderr so far, without colour codes.
    fn stderr(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// The value of counter `name` in `/metrics`, or `None` when the server
    /// does not export it.
    fn counter(&self, name: &str) -> Option<f64> {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        stream.set_read_timeout(Some(harness::REQUEST)).unwrap();
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        )
        .unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("read /metrics");
        let text = harness::Response::from_bytes(&raw).text();
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .and_then(|l| l.rsplit(' ').next())
            .map(|v| v.parse().expect("a number"))
    }

    /// The server's descendants: (pid, argv[1]).
    fn descendants(&self) -> Vec<(u32, String)> {
        let table = processes();
        let mut found = Vec::new();
        let mut frontier = vec![self.pid()];
        while let Some(parent) = frontier.pop() {
            for p in table.iter().filter(|p| p.ppid == parent) {
                found.push((p.pid, p.role.clone()));
                frontier.push(p.pid);
            }
        }
        found
    }

    /// The `host worker` processes among the descendants, sorted by pid
    /// (ranks are spawned in order).
    fn workers(&self) -> Vec<u32> {
        let mut w: Vec<u32> = self
            .descendants()
            .into_iter()
            .filter(|(_, role)| role == "worker")
            .map(|(pid, _)| pid)
            .collect();
        w.sort_unstable();
        w
    }

    /// The `host engine-core` process.
    fn engine_core(&self) -> u32 {
        let cores: Vec<u32> = self
            .descendants()
            .into_iter()
            .filter(|(_, role)| role == "engine-core")
            .map(|(pid, _)| pid)
            .collect();
        assert_eq!(cores.len(), 1, "one engine-core process: {cores:?}");
        cores[0]
    }

    /// Waits up to `timeout` for the server to exit.
    fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// SIGTERM, then the exit within [`EXIT`].
    fn stop(&mut self) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM failed");
        self.wait_exit(EXIT)
            .unwrap_or_else(|| panic!("the server did not exit within {EXIT:?} of SIGTERM"))
    }

    /// Processes still alive that this server started, at any depth (the
    /// marker survives re-parenting, which a walk of the tree would not).
    fn marked_processes(&self) -> Vec<u32> {
        let needle = format!("{MARKER_VAR}={}", self.marker);
        processes()
            .into_iter()
            .filter(|p| p.state != 'Z')
            .filter(|p| {
                std::fs::read(format!("/proc/{}/environ", p.pid))
                    .unwrap_or_default()
                    .split(|&b| b == 0)
                    .any(|kv| kv == needle.as_bytes())
            })
            .map(|p| p.pid)
            .collect()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One row of the process table.
struct Proc {
    pid: u32,
    ppid: u32,
    state: char,
    /// `argv[1]`: `worker`, `engine-core`, `serve` for a `host` process.
    role: String,
}

/// Every process /proc shows now.
fn processes() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse().ok())
        .filter_map(|pid: u32| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses; the fields
            // start after the last ')'.
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
            let state = fields.next()?.chars().next()?;
            let ppid = fields.next()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let role = cmdline
                .split(|&b| b == 0)
                .nth(1)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .unwrap_or_default();
            Some(Proc {
                pid,
                ppid,
                state,
                role,
            })
        })
        .collect()
}

/// Whether `pid` still runs (a zombie has exited).
fn alive(pid: u32) -> bool {
    processes().iter().any(|p| p.pid == pid && p.state != 'Z')
}

/// Polls `done` every 20 ms for up to `timeout`; whether it came true.
fn eventually(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Runs the kill client against `server` (see [`kill::run_client`]); a
/// failure shows the server's log too.
fn run_client(
    server: &Served,
    prompts: &[String],
    max_tokens: u64,
    kill_pid: Option<u32>,
) -> Value {
    kill::run_client(&server.addr, prompts, max_tokens, kill_pid)
        .unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", server.stderr()))
}

/// Asserts every stream of an undisturbed run ended whole; returns its texts.
fn reference_texts(report: &Value, max_tokens: u64) -> Vec<String> {
    let streams = report["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), STREAMS);
    streams
        .iter()
        .map(|s| {
            assert!(s["error"].is_null(), "reference stream failed: {s}");
            assert_eq!(s["finish_reason"], "length", "{s}");
            assert_eq!(s["usage_completion_tokens"], max_tokens, "{s}");
            s["text"].as_str().unwrap().to_string()
        })
        .collect()
}

/// Case 1 and 2: `world_size` ranks, the worker `victim_rank` killed
/// mid-decode; every stream ends as the undisturbed run did and the whole
/// group is replaced.
fn kill_one_worker(args: &[&str], world_size: usize, victim_rank: usize) {
    let model = e2e::default_model();
    let mut server = Served::start(&model, args);
    let prompts = kill::prompts(STREAMS);
    let started = Instant::now();

    // The undisturbed run, on the same server: the expectation (a TP = 3
    // group may differ from TP = 1 in the last bits, so no other run is).
    let reference = run_client(&server, &prompts, MAX_TOKENS, None);
    let expected = reference_texts(&reference, MAX_TOKENS);
    let reference_s = started.elapsed().as_secs_f64();

    let server_pid = server.pid();
    let engine_core = server.engine_core();
    let old = server.workers();
    assert_eq!(old.len(), world_size, "one `host worker` per rank: {old:?}");
    let victim = old[victim_rank];
    // The orphan check below sees what it looks for: the marker reaches
    // every process of the tree.
    let marked = server.marked_processes();
    for pid in [server_pid, engine_core].iter().chain(&old) {
        assert!(marked.contains(pid), "{pid} lacks the marker: {marked:?}");
    }

    let t = Instant::now();
    let report = run_client(&server, &prompts, MAX_TOKENS, Some(victim));
    let disturbed_s = t.elapsed().as_secs_f64();
    let log = server.stderr();
    assert!(
        report["kill_error"].is_null() && report["killed_at"].is_number(),
        "the kill did not happen: {report}\n{log}"
    );
    let killed_at = report["killed_at"].as_f64().unwrap();
    let streams = report["streams"].as_array().unwrap();
    let mut stall: f64 = 0.0;
    for (i, (s, want)) in streams.iter().zip(&expected).enumerate() {
        assert!(s["error"].is_null(), "stream {i} failed: {s}\n{log}");
        assert_eq!(s["finish_reason"], "length", "stream {i}: {s}");
        assert_eq!(
            s["text"].as_str().unwrap(),
            want,
            "stream {i} differs from the undisturbed run\n{log}"
        );
        // Equal texts could still hide a token repeated and one lost that
        // decode alike; the count of tokens the server sent rules it out.
        assert_eq!(s["usage_completion_tokens"], MAX_TOKENS, "stream {i}: {s}");
        // The kill landed mid-decode of this stream: it had tokens before
        // and after.
        let before = s["chunks_before_kill"].as_u64().unwrap();
        let chunks = s["chunks"].as_u64().unwrap();
        assert!(
            before >= 1 && before < chunks && before < MAX_TOKENS,
            "stream {i} was not mid-decode at the kill: {before} of {chunks} chunks before it"
        );
        let times: Vec<f64> = s["chunk_times"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap())
            .collect();
        if let Some(after) = times.iter().find(|&&t| t > killed_at) {
            stall = stall.max(after - killed_at);
        }
    }

    // The group was really replaced: the victim is gone and every rank is a
    // new process, the same number as before.
    assert!(!alive(victim), "the killed worker {victim} still runs");
    let new = server.workers();
    assert_eq!(
        new.len(),
        world_size,
        "one `host worker` per rank: {new:?}\n{log}"
    );
    assert!(
        new.iter().all(|p| !old.contains(p)),
        "every rank is replaced: before {old:?}, after {new:?}"
    );
    assert_eq!(
        server.engine_core(),
        engine_core,
        "the engine core itself survived"
    );
    // The log names this death and this replay: the victim we chose, the
    // streams we started.
    assert!(
        log.contains(&format!(
            "worker rank {victim_rank} (pid {victim}) died: signal: 9 (SIGKILL)"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "restarting the worker group (restart 1 of 3 within 300 s), {STREAMS} request(s) to replay"
        )),
        "{log}"
    );
    assert!(log.contains("worker group restarted in"), "{log}");
    assert!(
        log.contains("first tokens after the worker restart"),
        "{log}"
    );
    // The counters agree: one restart, every stream replayed.
    for (name, want) in [
        ("vllm:worker_restarts_total", 1.0),
        ("vllm:worker_replayed_requests_total", STREAMS as f64),
    ] {
        let got = server
            .counter(name)
            .unwrap_or_else(|| panic!("/metrics has no {name}"));
        assert_eq!(got, want, "{name}");
    }

    // Nothing the old group owned is left once the new group runs: what the
    // dead worker left goes with the reader that finds its owner dead (or
    // the sweep a new queue makes), the others' with their shutdown.
    assert!(
        eventually(Duration::from_secs(5), || kill::segments_of(&old)
            .is_empty()),
        "segments of the old workers left: {:?}",
        kill::segments_of(&old)
    );

    let status = server.stop();
    assert!(status.success(), "SIGTERM after recovery exits 0: {status}");
    assert_left_nothing(
        &server,
        &[&[server_pid, engine_core], &old[..], &new[..]].concat(),
    );
    eprintln!(
        "TP = {world_size}: reference {reference_s:.1} s, with the kill {disturbed_s:.1} s, \
         kill to first token after it {stall:.2} s"
    );
}

/// After the server exited: no process it started still runs, and no
/// segment owned by any of `pids` is left.
fn assert_left_nothing(server: &Served, pids: &[u32]) {
    // Workers exit on their death pipe's end-of-file; give them the
    // shutdown grace the executor itself would.
    assert!(
        eventually(Duration::from_secs(10), || server
            .marked_processes()
            .is_empty()),
        "processes the server started outlive it: {:?}",
        server.marked_processes()
    );
    assert_eq!(
        kill::segments_of(pids),
        Vec::<String>::new(),
        "pids {pids:?}"
    );
}

#[test]
fn a_killed_worker_is_replaced_and_every_stream_ends_as_undisturbed() {
    let _serial = kill::serial();
    kill_one_worker(&[], 1, 0);
}

#[test]
fn a_killed_tensor_parallel_rank_replaces_the_whole_group() {
    let _serial = kill::serial();
    // One thread per rank: three workers share two cores.
    kill_one_worker(
        &[
            "--set",
            "parallel.tensor_parallel_size=3",
            "--set",
            "worker.num_threads=1",
        ],
        3,
        1,
    );
}

#[test]
fn a_crash_loop_spends_the_budget_and_the_server_exits() {
    let _serial = kill::serial();
    // A private copy of the model, under its own name (the served model's
    // name is the file stem), to break while the server runs.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join(e2e::default_model().file_name().unwrap());
    std::fs::copy(e2e::default_model(), &model).unwrap();
    let mut server = Served::start(&model, &["--set", "engine.max_restarts=2"]);
    let server_pid = server.pid();
    let engine_core = server.engine_core();
    let workers = server.workers();
    assert_eq!(workers.len(), 1, "{workers:?}");

    // Garbage in place of the model, by rename: the running worker maps the
    // old file, which must stay intact under it; only a new worker opens the
    // new one.
    let garbage = dir.path().join("garbage.tmp");
    std::fs::write(&garbage, vec![0x5a; 1 << 20]).unwrap();
    std::fs::rename(&garbage, &model).unwrap();

    let t = Instant::now();
    let report = run_client(&server, &kill::prompts(1), 256, Some(workers[0]));
    let stream_end_s = t.elapsed().as_secs_f64();
    let log = server.stderr();
    assert!(
        report["kill_error"].is_null(),
        "the kill did not happen: {report}\n{log}"
    );
    let stream = &report["streams"][0];
    let error = stream["error"].as_str().unwrap_or_else(|| {
        panic!("the stream should end with an error, not finish: {stream}\n{log}")
    });
    // The client learns the first death and why it stayed dead.
    assert!(
        error.contains("signal: 9")
            && error.contains("not restarted")
            && error.contains("crash loop"),
        "{error}"
    );

    // Measured: the server is gone ~2 s after the kill (two failed starts
    // of a file that is not GGUF); 30 s leaves room for a loaded machine.
    let status = server.wait_exit(EXIT).unwrap_or_else(|| {
        panic!(
            "the server still runs {EXIT:?} after its engine died\n{}",
            server.stderr()
        )
    });
    let exit_s = t.elapsed().as_secs_f64();
    assert!(!status.success(), "a spent budget exits non-zero: {status}");
    let log = server.stderr();
    let death = format!(
        "worker rank 0 (pid {}) died: signal: 9 (SIGKILL)",
        workers[0]
    );
    for needle in [death.as_str(), "not restarted:", "crash loop"] {
        assert!(log.contains(needle), "the log lacks {needle:?}:\n{log}");
    }
    // The failed workers die in load_model, before they make any segment;
    // those of the processes we know must be gone.
    assert_left_nothing(&server, &[server_pid, engine_core, workers[0]]);
    eprintln!(
        "crash loop: stream ended after {stream_end_s:.1} s, server exited after {exit_s:.1} s"
    );
}
