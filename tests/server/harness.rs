//! A `host serve` process on a free port with the default model, and a
//! minimal HTTP/1.1 client over `TcpStream` (one request per connection),
//! so the tests see exactly the bytes a client gets. Every wait is bounded.

#![allow(dead_code)] // each test file uses its own subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long the model may take to load and the server to answer.
pub const STARTUP: Duration = Duration::from_secs(120);
/// How long one request may take.
pub const REQUEST: Duration = Duration::from_secs(120);

/// A running server; killed when dropped.
pub struct Server {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Its stderr so far, when started by [`Server::start_logged`].
    log: Option<Arc<Mutex<String>>>,
}

impl Server {
    /// A server with the structured-output plugin and `more`.
    pub fn start_with_structured_outputs(more: &[&str]) -> Server {
        let args = structured_outputs_args(more);
        Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// `host [global flags] serve --port 0 [args]` on the default model.
    pub fn start(args: &[&str]) -> Server {
        Server::spawn(args, false)
    }

    /// As [`Server::start`], keeping stderr (plain text) for
    /// [`Server::log`] instead of passing it through.
    pub fn start_logged<S: AsRef<str>>(args: &[S]) -> Server {
        let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
        Server::spawn(&args, true)
    }

    fn spawn(args: &[&str], keep_log: bool) -> Server {
        let model = e2e::default_model();
        let mut command = Command::new(e2e::host_bin());
        command
            .arg("--model")
            .arg(&model)
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped());
        if keep_log {
            command
                .env("NO_COLOR", "1")
                .env_remove("RUST_LOG")
                .stderr(Stdio::piped());
        } else {
            command.stderr(Stdio::inherit());
        }
        let mut child = command.spawn().expect("spawn host serve");
        let log = keep_log.then(|| keep_stderr(&mut child));
        let addr = match listening_address(&mut child).recv_timeout(STARTUP) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                panic!("host serve did not print its address within {STARTUP:?}");
            }
        };
        Server { child, addr, log }
    }

    /// Its stderr so far (started by [`Server::start_logged`]).
    pub fn log(&self) -> String {
        let log = self.log.as_ref().expect("a server started by start_logged");
        log.lock().unwrap().clone()
    }

    /// The process id (for signals).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (e.g. `TERM`) with `kill(1)`.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "kill -{signal} failed");
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], b"")
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, &[], body.to_string().as_bytes())
    }

    /// Any request; `Connection: close`, so the response ends at EOF.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        let mut stream = self.send(method, path, headers, body);
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("read the response");
        Response::parse(&raw)
    }

    /// Sends a request and returns the open connection, for reading a
    /// stream piecemeal (and dropping it midway).
    pub fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        stream.set_read_timeout(Some(REQUEST)).expect("timeout");
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).expect("write head");
        stream.write_all(body).expect("write body");
        stream
    }

    /// Sends `request` byte for byte (the caller writes every header,
    /// `Host` and `Content-Type` included, and should ask for
    /// `Connection: close`) and reads the response to its end.
    pub fn raw(&self, request: &[u8]) -> Response {
        let mut stream = TcpStream::connect(&self.addr).expect("connect");
        stream.set_read_timeout(Some(REQUEST)).expect("timeout");
        stream.write_all(request).expect("write the request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("read the response");
        Response::parse(&raw)
    }

    /// The server process's resident memory (`VmRSS`), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the server's /proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no VmRSS in:\n{status}"))
    }

    /// The value of the unlabelled-but-for-model series `name` in
    /// `/metrics`, summed over the data-parallel ranks.
    pub fn metric(&self, name: &str) -> f64 {
        self.metric_by_rank(name).iter().sum()
    }

    /// The series `name` (labelled by model and rank only) of each
    /// data-parallel rank, in rank order.
    pub fn metric_by_rank(&self, name: &str) -> Vec<f64> {
        let text = self.get("/metrics").text();
        let values: Vec<f64> = text
            .lines()
            .filter(|l| {
                l.starts_with(&format!("{name}{{"))
                    && !l.contains("le=")
                    && !l.contains("finished_reason")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert!(!values.is_empty(), "no series {name} in /metrics:\n{text}");
        values
    }

    /// Polls until `/metrics` shows no running or waiting request and no KV
    /// block in use; panics after `timeout`.
    pub fn wait_idle(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let busy = [
                self.metric("vllm:num_requests_running"),
                self.metric("vllm:num_requests_waiting"),
                self.metric("vllm:kv_cache_usage_perc"),
            ];
            if busy == [0.0, 0.0, 0.0] {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "engine not idle after {timeout:?}: running, waiting, kv = {busy:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Server {
    /// Runs the Python script `script` (under tests/server/), which drives
    /// this server through the official `openai` client with the API key
    /// `sesame`, against the `expected` answers; fails the test unless the
    /// script exits 0 and reports no failed check.
    pub fn run_openai_script(&self, script: &str, expected: &Value) {
        let script = e2e::repo_root().join("tests/server").join(script);
        // `openai` builds its pydantic models on first use unless told not
        // to, and that lazy build is not thread-safe: scripts that send
        // requests from a thread pool failed now and then with "BaseModel
        // cannot be instantiated directly" when several threads built one
        // model at once. Built at import, in one thread, it cannot race.
        let out = Command::new("python3")
            .env("DEFER_PYDANTIC_BUILD", "false")
            .arg(&script)
            .arg(format!("http://{}/v1", self.addr))
            .arg("sesame")
            .arg("SmolLM2-135M-Instruct.Q4_1")
            .arg(expected.to_string())
            .output()
            .expect("start python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{} failed ({}); it needs `pip install -r tests/reference/requirements.txt` (openai)\n{stdout}\n{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `more` and, unless it is installed beside the binary (scripts/test.sh
/// puts it there; the default configuration then serves it), the
/// structured-output plugin by path: a second copy of the same name would
/// clash with the installed one.
pub fn structured_outputs_args(more: &[&str]) -> Vec<String> {
    let installed = e2e::host_bin().with_file_name("plugins/structured_output.wasm");
    let mut args: Vec<String> = more.iter().map(|a| a.to_string()).collect();
    if !installed.is_file() {
        let wasm = e2e::plugin("structured_output");
        args.extend(["--plugin".to_string(), wasm.to_string_lossy().into_owned()]);
    }
    args
}

/// The piped stderr of `child`, kept line by line by a thread of its own
/// as it comes.
pub fn keep_stderr(child: &mut Child) -> Arc<Mutex<String>> {
    let log = Arc::new(Mutex::new(String::new()));
    let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let mut log = kept.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
    log
}

/// The address a `host serve` child prints once it listens (`listening on
/// http://ADDR`), read from its piped stdout by a thread of its own.
pub fn listening_address(child: &mut Child) -> mpsc::Receiver<String> {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.split("http://").nth(1) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    rx
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The header block, lower-cased.
    pub headers: String,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Response {
    fn parse(raw: &[u8]) -> Response {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a header block");
        let headers = String::from_utf8_lossy(&raw[..split]).to_lowercase();
        let status = headers
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line");
        let mut body = raw[split + 4..].to_vec();
        if headers.contains("transfer-encoding: chunked") {
            body = dechunk(&body);
        }
        Response {
            status,
            headers,
            body,
        }
    }

    /// The value of header `name` (lower-case), if present.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_string())
        })
    }

    /// Parses raw response bytes (a status line, headers, a body).
    pub fn from_bytes(raw: &[u8]) -> Response {
        Response::parse(raw)
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).expect("UTF-8 body")
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The `data:` payloads of a server-sent-events body, in order.
    pub fn events(&self) -> Vec<String> {
        sse_data(&self.text())
    }
}

/// The `data:` payloads in SSE text.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&body[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&body[start..(start + size).min(body.len())]);
        body = &body[(start + size + 2).min(body.len())..];
    }
    out
}

/// The streamed chunks' JSON (without `[DONE]`), checking it ends the stream.
pub fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}
