//! `host serve` end to end: the real binary on a free port with the real
//! model, spoken to over raw HTTP. Answers are checked against the offline
//! engine (`Llm`, a different frontend over the same engine core), errors
//! against the OpenAI error shape, counters against the requests sent.
//! Failures (disconnects, SIGTERM, a dead engine) are in `server_faults.rs`.

use crate::harness;

use std::time::Duration;

use harness::{chunks, Server};
use host::engine::{Completion, GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use host::tokenizer::ChatMessage;
use serde_json::json;

/// Runs `prompts` through the offline engine with `params`.
fn offline(prompts: Vec<Prompt>, params: SamplingParams) -> Vec<Completion> {
    let config = e2e::default_config();
    let mut llm = Llm::new(&config).unwrap();
    let reqs: Vec<_> = prompts
        .into_iter()
        .map(|prompt| GenerateRequest::new(prompt, params.clone()))
        .collect();
    llm.generate(&reqs, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    }
}

#[test]
fn completions_and_chat_match_the_offline_engine() {
    let server = Server::start(&[]);
    let prompt = "The capital of France is";
    let chat = vec![ChatMessage::new("user", "Name three colours.")];
    let want = offline(
        vec![Prompt::Text(prompt.into()), Prompt::Chat(chat.clone())],
        greedy(24),
    );

    let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want[0].text);
    assert_eq!(
        v["choices"][0]["finish_reason"],
        want[0].finish.finish_reason
    );
    assert_eq!(v["usage"]["prompt_tokens"], want[0].num_prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], want[0].token_ids.len());

    // The same, streamed: the deltas add up to the same text.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/completions", &stream_body);
    assert_eq!(r.status, 200);
    assert!(
        r.headers.contains("content-type: text/event-stream"),
        "{}",
        r.headers
    );
    let cs = chunks(&r.events());
    let text: String = cs
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want[0].text);
    let last = &cs[cs.len() - 2]["choices"][0];
    assert_eq!(last["finish_reason"], want[0].finish.finish_reason);
    let usage = &cs[cs.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], want[0].token_ids.len());

    let body = json!({"messages": [{"role": "user", "content": "Name three colours."}],
                      "max_tokens": 24, "temperature": 0});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want[1].text);
    assert_eq!(v["usage"]["prompt_tokens"], want[1].num_prompt_tokens);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let cs = chunks(&server.post("/v1/chat/completions", &stream_body).events());
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(cs.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = cs
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want[1].text);

    // A batch of two prompts with n = 2: four choices, prompt-major; greedy
    // samples of one prompt agree.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": [prompt, "Once upon a time"], "n": 2, "max_tokens": 8, "temperature": 0}),
    );
    let choices = r.json()["choices"].as_array().unwrap().clone();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(choices[0]["text"], choices[1]["text"]);
    assert_eq!(choices[2]["text"], choices[3]["text"]);
    assert_eq!(
        choices[0]["text"].as_str().unwrap(),
        want[0]
            .text
            .chars()
            .take(choices[0]["text"].as_str().unwrap().chars().count())
            .collect::<String>()
    );

    // Every finished request was counted, with its latencies.
    server.wait_idle(Duration::from_secs(10));
    assert_eq!(server.metric("vllm:time_to_first_token_seconds_count"), 8.0);
    assert_eq!(server.metric("vllm:e2e_request_latency_seconds_count"), 8.0);
    assert!(server.metric("vllm:inter_token_latency_seconds_count") >= 4.0 * 23.0);
    assert!(server.metric("vllm:generation_tokens_total") >= 4.0 * 24.0);
}

#[test]
fn stop_strings_logprobs_and_seeds() {
    let server = Server::start(&[]);
    let prompt = "Once upon a time";
    let full = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 32, "temperature": 0}),
    );
    let full = full.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    // A word from the middle of the greedy answer is a stop string that
    // must cut the same answer right before it.
    let stop = full
        .split_whitespace()
        .nth(4)
        .expect("a long enough answer")
        .to_string();
    let cut = &full[..full.find(&stop).unwrap()];
    let v = server
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": [stop]}),
        )
        .json();
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], stop);

    // Greedy logprobs: the sampled token is the most likely one.
    let v = server
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}),
        )
        .json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 6);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(top.len() <= 3 && !top.is_empty());
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (lp["token_logprobs"][i].as_f64().unwrap() - best).abs() < 1e-4,
            "{lp}"
        );
    }
    let v = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
                    "logprobs": true, "top_logprobs": 2}),
        )
        .json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    assert!(content
        .iter()
        .all(|t| t["top_logprobs"].as_array().unwrap().len() == 2));

    // Seeded sampling: choice j draws with seed + j, as the offline engine
    // does with that seed; and the answer is reproducible.
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 42, "n": 2});
    let a = server.post("/v1/completions", &body).json();
    let b = server.post("/v1/completions", &body).json();
    assert_eq!(a["choices"], b["choices"]);
    let seeded = |seed| SamplingParams {
        temperature: 1.0,
        max_tokens: 12,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let want0 = offline(vec![Prompt::Text(prompt.into())], seeded(42));
    let want1 = offline(vec![Prompt::Text(prompt.into())], seeded(43));
    assert_eq!(a["choices"][0]["text"], want0[0].text);
    assert_eq!(a["choices"][1]["text"], want1[0].text);
    // A negative seed, which vLLM takes too, keys the generator by its
    // two's-complement bits.
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": -1});
    let v = server.post("/v1/completions", &body).json();
    let want = offline(vec![Prompt::Text(prompt.into())], seeded(u64::MAX));
    assert_eq!(v["choices"][0]["text"], want[0].text);
}

#[test]
fn bad_input_gets_an_openai_error_naming_the_field() {
    // A KV cache of 16 blocks (256 tokens), far below the model's context.
    let server = Server::start(&[
        "--set",
        "server.max_body_bytes=4096",
        "--kv-cache-memory-bytes",
        "12000000",
    ]);
    let cases: Vec<(&str, &[u8], Option<&str>)> = vec![
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", br#"{"max_tokens": 5}"#, Some("prompt")),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 0}"#,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": -3}"#,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": "ten"}"#,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "temperature": -1}"#,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "top_p": 1.5}"#,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "logprobs": 50}"#,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "model": "gpt-4"}"#,
            Some("model"),
        ),
        ("/v1/completions", br#"{"prompt": 7}"#, Some("prompt")),
        ("/v1/completions", br#"{"prompt": [49152]}"#, Some("prompt")),
        // Empty once tokenized: refused before it reaches the engine.
        ("/v1/completions", br#"{"prompt": ""}"#, Some("prompt")),
        (
            "/v1/completions",
            br#"{"prompt": [[1, 2], []]}"#,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "seed": 1.5}"#,
            Some("seed"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}"#,
            Some("stream_options"),
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "prompt_logprobs": 1, "stream": true}"#,
            Some("prompt_logprobs"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": []}"#,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"content": "hi"}]}"#,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
            Some("top_logprobs"),
        ),
    ];
    for (path, body, param) in cases {
        let r = server.request("POST", path, &[], body);
        let shown = String::from_utf8_lossy(body);
        assert_eq!(r.status, 400, "{shown}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["type"], "BadRequestError", "{shown}");
        assert_eq!(e["code"], 400);
        assert_eq!(e["param"].as_str(), param, "{shown}: {e}");
        assert!(!e["message"].as_str().unwrap().is_empty());
    }
    // Prompt + max_tokens past max_model_len: refused by the scheduler,
    // with the numbers in the message.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 100000}),
    );
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_model_len"),
        "{}",
        r.text()
    );
    // The engine's refusal arrives before a stream's headers: a 400 too.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 100000, "stream": true}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    // A chat request without max_tokens defaults to the rest of the
    // context, and the context was lowered at start-up to what this cache
    // holds (256 tokens): it is served, within that bound.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let total = r.json()["usage"]["total_tokens"].as_u64().unwrap();
    assert!(total <= 256, "{total} tokens in a 256-token cache");
    // A body over the limit.
    let big = json!({"prompt": "x".repeat(8192)});
    let r = server.post("/v1/completions", &big);
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], 413);
    // Unknown route.
    assert_eq!(server.get("/v2/nothing").status, 404);
    // After all that, the engine serves as before.
    assert_eq!(server.get("/health").status, 200);
    let r = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn api_key_guards_v1_but_not_probes() {
    let server = Server::start(&["--api-key", "sesame"]);
    let r = server.get("/v1/models");
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "AuthenticationError");
    assert_eq!(
        server
            .request(
                "GET",
                "/v1/models",
                &[("Authorization", "Bearer nope")],
                b""
            )
            .status,
        401
    );
    let r = server.request(
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sesame")],
        b"",
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(server.get("/health").status, 200);
    assert!(server
        .get("/metrics")
        .text()
        .contains("vllm:num_requests_running"));
}

#[test]
fn the_rpc_endpoint_is_off_unless_enabled() {
    let off = Server::start(&[]);
    assert_eq!(
        off.post("/collective_rpc", &json!({"method": "check_health"}))
            .status,
        404
    );
    drop(off);
    let on = Server::start(&["--set", "server.enable_rpc_endpoint=true"]);
    // The call reaches the workers' method registry, which names what it
    // does not know.
    let r = on.post("/collective_rpc", &json!({"method": "no_such_method"}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no_such_method"),
        "{}",
        r.text()
    );
}

#[test]
fn requests_wait_while_the_engine_sleeps_and_run_after_wake_up() {
    let server = Server::start(&["--set", "server.enable_rpc_endpoint=true"]);
    let prompt = "The capital of France is";
    let want = offline(vec![Prompt::Text(prompt.into())], greedy(8));
    let asleep = |server: &Server| server.get("/is_sleeping").json()["is_sleeping"].clone();
    assert_eq!(asleep(&server), json!(false));
    let r = server.post("/sleep?level=3", &json!({}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("level 3"), "{}", r.text());
    let r = server.post("/sleep?level=1", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(asleep(&server), json!(true));
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let server = &server;
        s.spawn(move || {
            let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
            tx.send(server.post("/v1/completions", &body)).unwrap();
        });
        // Asleep, the engine schedules nothing: the request waits.
        assert!(
            rx.recv_timeout(Duration::from_secs(2)).is_err(),
            "a request ran while asleep"
        );
        let r = server.post("/wake_up?tags=weights", &json!({}));
        assert_eq!(r.json()["is_sleeping"], json!(true), "{}", r.text());
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "ran with the KV cache asleep"
        );
        let r = server.post("/wake_up?tags=kv_cache", &json!({}));
        assert_eq!(r.json()["is_sleeping"], json!(false), "{}", r.text());
        let r = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the request ran after wake_up");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["text"], want[0].text);
    });
    let r = server.post("/reset_prefix_cache", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn host_without_a_subcommand_serves() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(e2e::host_bin())
        .arg("--model")
        .arg(e2e::default_model())
        .args(["--set", "server.port=0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let line = std::io::BufReader::new(stdout).lines().next();
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(harness::STARTUP);
    let _ = child.kill();
    let _ = child.wait();
    let line = line
        .expect("a line within the start-up time")
        .expect("stdout line")
        .expect("stdout");
    assert!(line.contains("listening on http://127.0.0.1:"), "{line}");
}
