//! A real `host serve` under overload and misuse: past
//! `server.max_waiting_requests` requests get 429 at once while the admitted
//! ones finish exactly; past `server.max_connections` connections get 503;
//! slow headers and idle connections are closed in bounded time; and the
//! `Host`, `Content-Type` and CORS guards. Every loop is bounded in count
//! and time; servers listen on loopback only.

use crate::harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use harness::{Response, Server};
use serde_json::{json, Value};

/// How fast a refusal must come back: at once, never after a queue.
const PROMPT_REFUSAL: Duration = Duration::from_millis(900);

fn completion(prompt: &str, n: u32) -> Value {
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "n": n})
}

/// The texts of a 200 answer's choices, in index order.
fn texts(r: &Response) -> Vec<String> {
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    let mut choices = body["choices"].as_array().expect("choices").clone();
    choices.sort_by_key(|c| c["index"].as_u64());
    choices
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

/// A 429 as the overload control must answer it.
fn assert_overloaded(r: &Response, took: Duration) {
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(
        r.header("retry-after").as_deref(),
        Some("1"),
        "{}",
        r.headers
    );
    let body = r.json();
    assert_eq!(body["error"]["code"], 429);
    assert_eq!(body["error"]["type"], "RateLimitError");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("server.max_waiting_requests = 4"),
        "{message}"
    );
    assert!(took < PROMPT_REFUSAL, "a refusal took {took:?}");
}

#[test]
fn past_max_waiting_requests_requests_get_429_at_once_and_admitted_ones_finish_exactly() {
    let server = Server::start(&[
        "--set",
        "server.max_waiting_requests=4",
        "--set",
        "server.enable_rpc_endpoint=true",
        // Two running at most: the rest of a burst waits in the scheduler.
        "--set",
        "scheduler.max_num_seqs=2",
    ]);
    let prompts: Vec<String> = (0..4)
        .map(|i| format!("Fact number {i} about the sea:"))
        .collect();
    // The same requests on the quiet server, one at a time.
    let want: Vec<String> = prompts
        .iter()
        .map(|p| texts(&server.post("/v1/completions", &completion(p, 1))).remove(0))
        .collect();
    let rss_before = server.rss_kib();

    // Deterministic part: asleep, the engine schedules nothing, so one
    // request of 4 choices holds every slot until wake-up.
    assert_eq!(server.post("/sleep?level=1", &json!({})).status, 200);
    std::thread::scope(|s| {
        let held = s.spawn(|| server.post("/v1/completions", &completion(&prompts[0], 4)));
        // Time for it to be admitted (a local request: milliseconds).
        std::thread::sleep(Duration::from_secs(1));
        assert!(!held.is_finished(), "a request ran while the engine slept");
        let refusals: Vec<_> = (0..6)
            .map(|t| {
                let (server, prompts) = (&server, &prompts);
                s.spawn(move || {
                    (0..10)
                        .map(|i| {
                            let started = Instant::now();
                            let r = server.post(
                                "/v1/completions",
                                &completion(&prompts[(t + i) % 4], 1 + (i % 2) as u32),
                            );
                            (r, started.elapsed())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (r, took) in refusals.into_iter().flat_map(|t| t.join().unwrap()) {
            assert_overloaded(&r, took);
        }
        assert!(
            !held.is_finished(),
            "the refusals must not disturb the admitted request"
        );
        assert_eq!(server.post("/wake_up", &json!({})).status, 200);
        let held = held.join().unwrap();
        assert_eq!(
            texts(&held),
            vec![want[0].clone(); 4],
            "admitted choices match the quiet run"
        );
    });

    // Free-running part: a burst from 8 threads against 2 running and 4
    // waiting. Every answer is either the quiet run's text or a prompt 429.
    let barrier = std::sync::Barrier::new(8);
    let results: Vec<(usize, Response, Duration)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (server, prompts, barrier) = (&server, &prompts, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    (0..6)
                        .map(|i| {
                            let p = (t + i) % 4;
                            let started = Instant::now();
                            let r = server.post("/v1/completions", &completion(&prompts[p], 2));
                            (p, r, started.elapsed())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    assert_eq!(results.len(), 48);
    let mut served = 0;
    let mut refused = 0;
    for (p, r, took) in &results {
        if r.status == 200 {
            served += 1;
            assert_eq!(texts(r), vec![want[*p].clone(); 2], "prompt {p} under load");
        } else {
            refused += 1;
            assert_overloaded(r, *took);
        }
    }
    assert!(
        served > 0 && refused > 0,
        "served {served}, refused {refused}"
    );

    // Nothing queued or leaked: the engine drains, and a request needing
    // every slot is admitted again.
    server.wait_idle(Duration::from_secs(60));
    assert_eq!(
        texts(&server.post("/v1/completions", &completion(&prompts[1], 4))),
        vec![want[1].clone(); 4]
    );
    // A request that could never fit is a 400, not a 429 to retry forever.
    let r = server.post("/v1/completions", &completion(&prompts[1], 5));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("server.max_waiting_requests = 4"),
        "{}",
        r.text()
    );
    let grown = server.rss_kib().saturating_sub(rss_before);
    assert!(
        grown < 64 * 1024,
        "the server grew by {grown} KiB under the flood"
    );
}

#[test]
fn past_max_connections_new_connections_get_503_until_others_close() {
    let server = Server::start(&[
        "--set",
        "server.max_connections=4",
        "--set",
        "server.header_read_timeout_s=60",
    ]);
    // No request before these: a finished connection gives its slot back
    // only after the client has read its answer, which would race.
    let mut idle: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(&server.addr).expect("connect"))
        .collect();
    // Time for the server to accept them.
    std::thread::sleep(Duration::from_millis(300));
    for conn in &mut idle {
        conn.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let mut buf = [0u8; 64];
        let read = conn.read(&mut buf);
        assert!(
            read.is_err(),
            "an idle connection within the cap was answered: {read:?}"
        );
    }
    let started = Instant::now();
    let r = server.get("/health");
    let took = started.elapsed();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(took < PROMPT_REFUSAL, "the refusal took {took:?}");
    assert_eq!(
        r.header("retry-after").as_deref(),
        Some("1"),
        "{}",
        r.headers
    );
    let body = r.json();
    assert_eq!(body["error"]["code"], 503);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.max_connections = 4"),
        "{body}"
    );

    drop(idle);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = server.get("/health").status;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(
            Instant::now() < deadline,
            "still refused 5 s after the idle connections closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads until the server closes the connection (or `limit` passes);
/// returns what it sent and when it closed, measured from `since`.
fn read_until_closed(
    stream: &mut TcpStream,
    since: Instant,
    limit: Duration,
) -> (Vec<u8>, Duration) {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return (got, since.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn slow_headers_bodies_and_idle_connections_are_closed_in_bounded_time() {
    let server = Server::start(&[
        "--set",
        "server.header_read_timeout_s=1",
        "--set",
        "server.idle_connection_timeout_s=3",
        "--set",
        "server.body_read_timeout_s=2",
    ]);
    // A client that sends its headers, then a tenth of its body, then
    // nothing: 408 once the body timeout passes, not a connection held.
    let mut trickle = TcpStream::connect(&server.addr).unwrap();
    let started = Instant::now();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\":",
        server.addr
    );
    trickle.write_all(head.as_bytes()).unwrap();
    let (got, _) = read_until_closed(&mut trickle, started, Duration::from_secs(10));
    let answered = started.elapsed();
    let r = Response::from_bytes(&got);
    assert_eq!(r.status, 408, "{}", String::from_utf8_lossy(&got));
    assert!(
        answered >= Duration::from_millis(1900) && answered < Duration::from_millis(4000),
        "answered after {answered:?}, not the 2 s body timeout"
    );

    // A client that never finishes its headers.
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    let started = Instant::now();
    slow.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
    let (got, closed) = read_until_closed(&mut slow, started, Duration::from_secs(10));
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
        "closed after {closed:?}, not the 1 s header timeout"
    );

    // A kept-alive connection may idle past the header timeout, up to the
    // idle timeout.
    let mut kept = TcpStream::connect(&server.addr).unwrap();
    let request = format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", server.addr);
    kept.write_all(request.as_bytes()).unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            kept.read(&mut byte).unwrap(),
            1,
            "the connection closed mid-response"
        );
        head.push(byte[0]);
    }
    let response = Response::from_bytes(&head);
    assert_eq!(response.status, 200);
    assert_eq!(response.header("content-length").as_deref(), Some("0"));
    let answered = Instant::now();
    let (got, closed) = read_until_closed(&mut kept, answered, Duration::from_secs(10));
    assert!(got.is_empty());
    assert!(
        closed >= Duration::from_millis(2700) && closed < Duration::from_millis(4500),
        "an idle connection closed after {closed:?}, not the 3 s idle timeout"
    );
    // CORS is off unless configured: no header for another site's page.
    let r = server.request(
        "GET",
        "/v1/models",
        &[("Origin", "https://app.example")],
        b"",
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), None);
}

#[test]
fn host_content_type_and_cors_guards() {
    let server = Server::start(&[
        "--set",
        "server.allowed_hosts=[\"box.lan\"]",
        "--set",
        "server.cors_allowed_origins=[\"https://app.example\"]",
    ]);
    let port = server.addr.rsplit(':').next().unwrap().to_string();
    let get = |host: &str| {
        server.raw(
            format!("GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
    };
    for ok in [
        format!("localhost:{port}"),
        "127.0.0.1".into(),
        format!("[::1]:{port}"),
        format!("box.lan:{port}"),
    ] {
        assert_eq!(get(&ok).status, 200, "Host: {ok}");
    }
    // DNS rebinding: a page on evil.example whose name now points here.
    let r = get(&format!("evil.example:{port}"));
    assert_eq!(r.status, 421, "{}", r.text());
    let body = r.json();
    assert_eq!(body["error"]["code"], 421);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.allowed_hosts"),
        "{body}"
    );

    // Only JSON bodies run a completion; a cross-site form post does not.
    let json_body = completion("Hello", 1).to_string();
    let post = |content_type: Option<&str>| {
        let content_type = content_type.map_or(String::new(), |c| format!("Content-Type: {c}\r\n"));
        server.raw(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{content_type}Content-Length: {}\r\n\r\n{json_body}",
                server.addr,
                json_body.len()
            )
            .as_bytes(),
        )
    };
    for bad in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let r = post(bad);
        assert_eq!(r.status, 415, "{bad:?}: {}", r.text());
        let body = r.json();
        assert_eq!(body["error"]["type"], "UnsupportedMediaTypeError");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("application/json"),
            "{body}"
        );
    }
    assert_eq!(post(Some("application/json; charset=utf-8")).status, 200);

    // CORS: the listed origin's preflight is answered; its responses are
    // marked readable; another origin's are not.
    let preflight = |origin: &str| {
        server.request(
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization, content-type",
                ),
            ],
            b"",
        )
    };
    let r = preflight("https://app.example");
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
    // The harness lower-cases the header block.
    assert!(r
        .header("access-control-allow-methods")
        .unwrap()
        .contains("post"));
    assert!(r
        .header("access-control-allow-headers")
        .unwrap()
        .contains("authorization"));
    assert_eq!(preflight("https://evil.example").status, 403);
    let models = |origin: &str| server.request("GET", "/v1/models", &[("Origin", origin)], b"");
    let r = models("https://app.example");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
    let r = models("https://evil.example");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), None);
}
