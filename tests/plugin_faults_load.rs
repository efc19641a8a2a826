//! Plugin faults under load, end to end (issue 14): a scheduling policy
//! that panics on every 50th `order_waiting` call (`test:misbehave`, mode
//! `panic-every-50`) and a logits processor that loops forever once
//! (`test:misbehave-processor`, mode `loop-once`) serve 32 concurrent
//! streams on the real server and model. The expectation is independent of
//! the faulty run: the same 32 requests on a server started without the
//! faulty plugins (run first, same scheduler settings).
//!
//! Which requests are affected, and how:
//! - A policy fault makes the host recreate the instance and admit by FCFS
//!   for that step (`host/src/plugins/policy.rs`); between faults the
//!   plugin answers FCFS too, so no request is affected at all.
//! - The processor is a 0.2 plugin (the fixtures build against
//!   `engine:plugins@0.2.0`), which sees every row. The loop is cut by the
//!   per-call deadline, the instance is recreated, and under
//!   `plugins.on_error = "fallback"` (set explicitly here; the default) the
//!   step is sampled without its edits (`host/src/plugins/processor.rs`).
//!   The affected requests are those with a row in that step; since the
//!   processor never edits, being sampled without its edits changes nothing
//!   for them either.
//!
//! `"fallback"` is the setting under which no request may be lost: under
//! `"fail"` the first policy fault stops the engine (every open stream
//! ends with an error, later requests get 503), and a 0.2 processor's fault
//! fails every request with a row in the step.
//!
//! So every one of the 32 streams must end normally (`length`, since
//! `ignore_eos` with a fixed `max_tokens`), with exactly `max_tokens`
//! tokens, and the text of the server without the faulty plugins. That the
//! faults happened is checked from what the host logs and from the marker
//! the processor creates just before it loops; `/metrics` must count the
//! faults the log shows, per plugin (`vllm:plugin_faults_total`).
//!
//! Load shape: KV blocks of [`BLOCK_SIZE`] tokens, each enough for a whole
//! request (prompt and output), and a KV cache of [`KV_BLOCKS`] of them, so
//! four requests decode at a time and the other streams wait. The
//! scheduler asks the policy to order the waiting queue in every step that
//! has one waiting and a free sequence slot, admitted or not (here: a
//! request waits for a block), so it is asked in nearly every step (over
//! 200 times): several faults, and each recreated instance keeps serving.
//! One block per request for its whole life also means nothing is ever
//! preempted.

use crate::harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use harness::{chunks, sse_data, Response, REQUEST, STARTUP};
use serde_json::{json, Value};

/// Concurrent streams.
const STREAMS: usize = 32;
/// Tokens each stream generates.
const MAX_TOKENS: usize = 32;
/// Token slots per KV block, and the longest request (`max_model_len`):
/// every request lives in one block.
const BLOCK_SIZE: usize = 128;
/// KV blocks: how many requests decode at once.
const KV_BLOCKS: usize = 4;
/// The one request whose `extra_args` ask the processor to loop.
const LOOPING: usize = 13;

/// The KV cache settings both servers share (see the module doc).
fn engine_flags() -> Vec<String> {
    // f32 K and V, every layer (`host/src/model_runner/kv_cache.rs`):
    // SmolLM2-135M has 30 layers of 3 KV heads of width 64.
    let block_bytes = 2 * 30 * 3 * 64 * BLOCK_SIZE * 4;
    vec![
        "--block-size".into(),
        BLOCK_SIZE.to_string(),
        "--max-model-len".into(),
        BLOCK_SIZE.to_string(),
        "--kv-cache-memory-bytes".into(),
        (KV_BLOCKS * block_bytes).to_string(),
    ]
}

/// A `host serve` whose log (stderr) is kept, since the plugin faults are
/// visible only there; killed when dropped.
struct Served {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Served {
    /// `bin --model M serve --host 127.0.0.1 --port 0 [args]`, logging at
    /// `warn` (which includes every plugin fault).
    fn start(bin: &Path, args: &[String]) -> Served {
        let mut child = Command::new(bin)
            .arg("--model")
            .arg(e2e::default_model())
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn host serve");
        let log = harness::keep_stderr(&mut child);
        let Ok(addr) = harness::listening_address(&mut child).recv_timeout(STARTUP) else {
            let _ = child.kill();
            panic!(
                "host serve exited or printed no address within {STARTUP:?}:\n{}",
                log.lock().unwrap()
            );
        };
        Served { child, addr, log }
    }

    /// `POST path` with a JSON body, one connection, read to its end.
    fn post(&self, path: &str, body: &Value) -> Response {
        self.send("POST", path, &body.to_string())
    }

    /// `GET path`, one connection, read to its end.
    fn get(&self, path: &str) -> Response {
        self.send("GET", path, "")
    }

    fn send(&self, method: &str, path: &str, body: &str) -> Response {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        stream.set_read_timeout(Some(REQUEST)).expect("timeout");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("write head");
        stream.write_all(body.as_bytes()).expect("write body");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("read the response");
        Response::from_bytes(&raw)
    }

    /// `vllm:plugin_faults_total` of plugin `name`, summed over the ranks;
    /// `None` if no series names it.
    fn plugin_faults(&self, name: &str) -> Option<u64> {
        let text = String::from_utf8(self.get("/metrics").body).expect("UTF-8 metrics");
        let label = format!("plugin=\"{name}\"");
        let values: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with("vllm:plugin_faults_total{") && l.contains(&label))
            .map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()).expect(l))
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    /// What the server logged so far.
    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// [`STREAMS`] distinct prompts, short enough that prompt and output fit
/// one KV block.
fn prompts() -> Vec<String> {
    (0..STREAMS)
        .map(|i| {
            format!(
                "Note {i}. The harbour town wakes before dawn and the ferry sounds its \
                 horn twice. Tell what the keeper of lighthouse number {i} does that morning."
            )
        })
        .collect()
}

/// What one stream delivered.
#[derive(Debug, Clone, PartialEq)]
struct Streamed {
    text: String,
    finish_reason: Option<String>,
    completion_tokens: Option<u64>,
}

/// Streams one greedy completion of `prompt`; the HTTP status and the
/// events must be a normal stream (200, ending in `[DONE]`, no error event).
fn stream(server: &Served, prompt: &str, loop_once: bool) -> Streamed {
    let mut body = json!({
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    });
    if loop_once {
        body["vllm_xargs"] = json!({"loop_once": true});
    }
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut out = Streamed {
        text: String::new(),
        finish_reason: None,
        completion_tokens: None,
    };
    for chunk in chunks(&sse_data(&r.text())) {
        assert!(chunk.get("error").is_none(), "an error event: {chunk}");
        for choice in chunk["choices"].as_array().expect("choices") {
            out.text
                .push_str(choice["text"].as_str().unwrap_or_default());
            if let Some(reason) = choice["finish_reason"].as_str() {
                assert!(out.finish_reason.is_none(), "two finish reasons: {chunk}");
                out.finish_reason = Some(reason.to_string());
            }
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            out.completion_tokens = Some(n);
        }
    }
    out
}

/// All prompts at once, one thread and connection each, released together.
fn stream_all(server: &Served, prompts: &[String]) -> Vec<Streamed> {
    let start = Barrier::new(prompts.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    stream(server, prompt, i == LOOPING)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|_| {
                    panic!("stream {i} failed; the server logged:\n{}", server.log())
                })
            })
            .collect()
    })
}

/// The configuration that loads the faulty plugins: the policy panics on
/// every 50th call, the processor loops once (its marker in `once`).
fn faulty_config(dir: &Path, once: &Path) -> String {
    let path = |p: &Path| toml::Value::String(p.to_string_lossy().into_owned()).to_string();
    let config = format!(
        r#"[scheduler]
policy = "test:misbehave"

[plugins]
paths = [{policy}, {processor}]
logits_processors = ["test:misbehave-processor"]
on_error = "fallback"
# Far above an honest call, so only the deliberate loop overruns; one
# budget whatever the batch, so the fault names it.
deadline_ms = 250
deadline_per_request_us = 0

[plugins.options."test:misbehave"]
mode = "panic-every-50"

[plugins.options."test:misbehave-processor"]
mode = "loop-once"

[[plugins.grants]]
plugin = "test:misbehave-processor"
dir = {once}
guest = "/once"
writable = true
"#,
        policy = path(&e2e::plugin("misbehave")),
        processor = path(&e2e::plugin("misbehave_processor")),
        once = path(once),
    );
    let file = dir.join("faulty.toml");
    std::fs::write(&file, config).unwrap();
    file.to_string_lossy().into_owned()
}

/// The lines of `log` reporting a fault of plugin `name` (the host logs
/// `<hook> failed: <what>; recreating the instance`, with `plugin=<name>`).
fn faults<'a>(log: &'a str, name: &str) -> Vec<&'a str> {
    let field = format!("plugin={name}");
    log.lines()
        .filter(|l| l.contains("recreating the instance"))
        .filter(|l| l.split_whitespace().any(|w| w == field))
        .collect()
}

#[test]
fn faulting_plugins_under_32_streams_lose_no_request_and_change_no_output() {
    let began = Instant::now();
    // Both servers run the same binary, checked once to be current.
    let bin = e2e::host_bin();
    let flags = engine_flags();
    let prompts = prompts();

    let reference = Served::start(&bin, &flags);
    let expected = stream_all(&reference, &prompts);
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(e.finish_reason.as_deref(), Some("length"), "reference {i}");
        assert_eq!(
            e.completion_tokens,
            Some(MAX_TOKENS as u64),
            "reference {i}"
        );
    }
    let reference_faults = reference.plugin_faults("test:misbehave");
    drop(reference);

    let dir = tempfile::tempdir().unwrap();
    let once = dir.path().join("once");
    std::fs::create_dir(&once).unwrap();
    let mut args = flags;
    args.extend(["--config".into(), faulty_config(dir.path(), &once)]);
    let faulty = Served::start(&bin, &args);
    let got = stream_all(&faulty, &prompts);
    let log = faulty.log();

    for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            got, want,
            "stream {i} differs from the run without the faulty plugins; the server logged:\n{log}"
        );
    }

    // The processor entered its endless loop exactly once (the marker is
    // created just before it), and the deadline cut it: the one fault.
    assert!(
        once.join("looped").is_file(),
        "the processor never looped:\n{log}"
    );
    let processor = faults(&log, "test:misbehave-processor");
    assert_eq!(processor.len(), 1, "{processor:#?}\n{log}");
    assert!(
        processor[0].contains("process failed: exceeded its deadline of 250 ms"),
        "{}",
        processor[0]
    );

    // The policy panicked more than once, every time on the 50th call of a
    // fresh instance: each fault recreated it and the count restarted.
    let policy = faults(&log, "test:misbehave");
    assert!(policy.len() >= 2, "{policy:#?}\n{log}");
    for line in &policy {
        assert!(
            line.contains("order-waiting failed")
                && line.contains("misbehave: deliberate panic on call 50)"),
            "{line}"
        );
    }

    // `/metrics` counts the same faults, per plugin.
    let counted = |name| faulty.plugin_faults(name);
    assert_eq!(counted("test:misbehave"), Some(policy.len() as u64));
    assert_eq!(counted("test:misbehave-processor"), Some(1));
    assert_eq!(reference_faults, None, "a run without plugins counts none");

    // Still serving after the faults.
    let after = stream(&faulty, &prompts[0], false);
    assert_eq!(after, expected[0], "after the load");
    eprintln!(
        "{} policy faults, {} processor fault, {STREAMS} streams twice in {:?}",
        policy.len(),
        processor.len(),
        began.elapsed()
    );
}
