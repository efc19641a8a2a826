//! What an answer says about itself, over real HTTP with the real model:
//! the prompt tokens the prefix cache served (`prompt_tokens_details`,
//! checked against vLLM's rule and the server's own prefix-cache counter),
//! vLLM's `continuous_usage_stats` (every chunk's counts against the token
//! ids the chunks carry), and a client's name for its request (vLLM's
//! `request_id` field and `X-Request-Id` header, which comes back on every
//! response under `--enable-request-id-headers`).

use crate::harness::{chunks, Server};
use serde_json::{json, Value};

/// The engine's KV-cache block size (the default configuration's).
const BLOCK_SIZE: u64 = 16;

/// The tokens of a prompt vLLM's prefix cache can serve when the whole
/// prompt is cached: its full blocks, short of the last token, which must
/// be computed to sample from.
fn cacheable(prompt_tokens: u64) -> u64 {
    (prompt_tokens - 1) / BLOCK_SIZE * BLOCK_SIZE
}

/// `usage.prompt_tokens_details.cached_tokens` (the responses API's
/// `input_tokens_details`) are the prompt tokens the prefix cache served:
/// none the first time a prompt is seen, every full block before its last
/// token the second time, on every endpoint, streamed or not, and each
/// time as many as the server's prefix-cache hit counter grew by.
#[test]
fn usage_names_the_prompt_tokens_the_prefix_cache_served() {
    let server = Server::start(&[]);
    let text = "Every harbour keeps a ledger of the boats that come and go with the tide. ";
    let prompt = text.repeat(6);
    // (prompt tokens, cached tokens) of one request, checked against the
    // counter.
    let counts = |path: &str, body: &Value| -> (u64, u64) {
        let before = server.metric("vllm:prefix_cache_hits_total");
        let r = server.post(path, body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let usage = match body["stream"].as_bool() {
            Some(true) => chunks(&r.events()).last().unwrap()["usage"].clone(),
            _ => r.json()["usage"].clone(),
        };
        let (prompt, cached) = match path {
            "/v1/responses" => (
                &usage["input_tokens"],
                &usage["input_tokens_details"]["cached_tokens"],
            ),
            _ => (
                &usage["prompt_tokens"],
                &usage["prompt_tokens_details"]["cached_tokens"],
            ),
        };
        let (prompt, cached) = (prompt.as_u64().unwrap(), cached.as_u64().unwrap());
        let hits = server.metric("vllm:prefix_cache_hits_total") - before;
        assert_eq!(cached as f64, hits, "{path}: {usage}");
        (prompt, cached)
    };
    let completion = json!({"prompt": prompt, "max_tokens": 2});
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
        "stream": true, "stream_options": {"include_usage": true}});
    let responses = json!({"instructions": "Answer briefly.", "input": prompt,
        "max_output_tokens": 2});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
        ("/v1/responses", &responses),
    ] {
        let (tokens, cached) = counts(path, body);
        assert!(tokens > 4 * BLOCK_SIZE, "{path}: {tokens} tokens");
        assert_eq!(cached, 0, "{path}: the first sight of its prompt");
        let (again, cached) = counts(path, body);
        assert_eq!(again, tokens, "{path}");
        assert_eq!(cached, cacheable(tokens), "{path}: the second sight");
    }

    // Two samples of one prompt count it once, cached tokens as well.
    let fresh = format!("A different opening line. {prompt}");
    let sampled = json!({"prompt": fresh, "max_tokens": 2, "n": 2, "temperature": 1});
    let r = server.post("/v1/completions", &sampled);
    assert_eq!(r.status, 200, "{}", r.text());
    let first = r.json()["usage"].clone();
    let r = server.post("/v1/completions", &sampled);
    let second = r.json()["usage"].clone();
    assert_eq!(first["prompt_tokens"], second["prompt_tokens"]);
    let tokens = second["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        second["prompt_tokens_details"]["cached_tokens"],
        cacheable(tokens),
        "{second}"
    );
}

/// The `data:` chunks of a streamed answer to `body`.
fn streamed(server: &Server, path: &str, body: &Value) -> Vec<Value> {
    let r = server.post(path, body);
    assert_eq!(r.status, 200, "{}", r.text());
    chunks(&r.events())
}

/// vLLM's `stream_options.continuous_usage_stats`: with `include_usage`,
/// every chunk of a choice carries that choice's prompt tokens and the
/// tokens it generated so far (counted from the ids the chunks carry);
/// the last chunk's usage is the answer's, as without it. Without
/// `include_usage` no chunk carries usage, as in vLLM.
#[test]
fn continuous_usage_stats_count_each_choice_as_it_streams() {
    let server = Server::start(&[]);
    let prompts = ["The sea is", "Tell me a long story about the mountains and"];
    let lens: Vec<u64> = prompts
        .iter()
        .map(|p| {
            let r = server.post("/tokenize", &json!({"prompt": p}));
            r.json()["count"].as_u64().unwrap()
        })
        .collect();
    let options = json!({"include_usage": true, "continuous_usage_stats": true});
    let completion = json!({"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 1,
        "seed": 3, "stream": true, "stream_options": options, "return_token_ids": true});
    let cs = streamed(&server, "/v1/completions", &completion);
    let mut generated = [0u64; 4];
    for c in &cs[..cs.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        generated[i] += choice["token_ids"].as_array().unwrap().len() as u64;
        let usage = &c["usage"];
        assert_eq!(usage["prompt_tokens"], lens[i / 2], "{c}");
        assert_eq!(usage["completion_tokens"], generated[i], "{c}");
        assert_eq!(usage["total_tokens"], lens[i / 2] + generated[i], "{c}");
    }
    let last = &cs.last().unwrap()["usage"];
    assert_eq!(last["prompt_tokens"], lens[0] + lens[1], "{last}");
    assert_eq!(
        last["completion_tokens"],
        generated.iter().sum::<u64>(),
        "{last}"
    );
    assert_eq!(generated, [8; 4], "every choice ran to max_tokens");

    // Chat: the opening chunk (the role) has generated nothing yet.
    let chat = json!({"messages": [{"role": "user", "content": prompts[1]}], "max_tokens": 6,
        "stream": true, "stream_options": options, "return_token_ids": true});
    let prompt_tokens = server
        .post("/tokenize", &json!({"messages": chat["messages"]}))
        .json()["count"]
        .clone();
    let cs = streamed(&server, "/v1/chat/completions", &chat);
    let mut generated = 0;
    for c in &cs[..cs.len() - 1] {
        if let Some(ids) = c["choices"][0]["token_ids"].as_array() {
            generated += ids.len() as u64;
        }
        assert_eq!(c["usage"]["prompt_tokens"], prompt_tokens, "{c}");
        assert_eq!(c["usage"]["completion_tokens"], generated, "{c}");
    }
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(cs[0]["usage"]["completion_tokens"], 0);
    let last = &cs.last().unwrap()["usage"];
    assert_eq!(last["completion_tokens"], 6, "{last}");
    assert_eq!(generated, 6);

    // Without include_usage: no counts anywhere.
    let mut quiet = chat.clone();
    quiet["stream_options"] = json!({"continuous_usage_stats": true});
    for c in streamed(&server, "/v1/chat/completions", &quiet) {
        assert!(c["usage"].is_null(), "{c}");
        assert!(!c["choices"].as_array().unwrap().is_empty(), "{c}");
    }
}

/// vLLM's `request_id` and `X-Request-Id`: a client's name becomes the
/// answer's `id` (`cmpl-<name>`, `chatcmpl-<name>`) in every chunk, the
/// header winning over the field; answers a client gave one name run side
/// by side as if named apart; an empty name is no name; an oversized or
/// unreadable one is a 400 naming where it came from.
#[test]
fn a_client_names_its_request() {
    let server = Server::start(&[]);
    let post = |path: &str, headers: &[(&str, &str)], body: &Value| {
        server.request("POST", path, headers, &serde_json::to_vec(body).unwrap())
    };
    let completion = |prompt: &str| json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    let named = |mut body: Value, name: &str| {
        body["request_id"] = json!(name);
        body
    };

    let r = post("/v1/completions", &[], &named(completion("Hi"), "job-7"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], "cmpl-job-7");
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "stream": true});
    let r = post("/v1/chat/completions", &[], &named(chat.clone(), "job-8"));
    assert_eq!(r.status, 200, "{}", r.text());
    let cs = chunks(&r.events());
    assert!(cs.len() > 2);
    assert!(cs.iter().all(|c| c["id"] == "chatcmpl-job-8"), "{cs:?}");
    let r = post(
        "/v1/chat/completions",
        &[("X-Request-Id", "from-header")],
        &named(chat.clone(), "from-body"),
    );
    assert!(chunks(&r.events())
        .iter()
        .all(|c| c["id"] == "chatcmpl-from-header"));
    assert_eq!(r.header("x-request-id"), None, "echoed only when asked");
    let r = post("/v1/completions", &[], &named(completion("Hi"), ""));
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("cmpl-") && id.len() > "cmpl-".len(), "{id}");

    // One name, two answers at once: each is the answer to its own prompt.
    let prompts = ["The capital of France is", "Water boils at"];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| post("/v1/completions", &[], &completion(p)).json()["choices"][0]["text"].clone())
        .collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let runs: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || post("/v1/completions", &[], &named(completion(p), "same"))))
            .collect();
        runs.into_iter()
            .map(|h| {
                let r = h.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                assert_eq!(r.json()["id"], "cmpl-same");
                r.json()["choices"][0]["text"].clone()
            })
            .collect()
    });
    assert_eq!(together, alone);

    let long = "x".repeat(257);
    let r = post("/v1/completions", &[], &named(completion("Hi"), &long));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "request_id");
    assert!(r.text().contains("257 bytes"), "{}", r.text());
    let r = post(
        "/v1/completions",
        &[("X-Request-Id", &long)],
        &completion("Hi"),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "X-Request-Id");
    let raw = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nX-Request-Id: caf\xc3\xa9\r\nContent-Length: 15\r\nConnection: close\r\n\r\n{\"prompt\": \"a\"}";
    let r = server.raw(raw);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "X-Request-Id");
    let r = post(
        "/v1/responses",
        &[],
        &json!({"input": "Hi", "request_id": "mine"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "request_id");
}

/// vLLM's `--enable-request-id-headers`: every response carries
/// `X-Request-Id`, the request's own (which also names the answer, streamed
/// or not) or, when it sent none, a fresh one per request; refusals too.
#[test]
fn responses_carry_the_request_id_when_asked() {
    let server = Server::start(&["--enable-request-id-headers"]);
    let post = |headers: &[(&str, &str)], path: &str, body: &Value| {
        server.request("POST", path, headers, &serde_json::to_vec(body).unwrap())
    };
    let completion = json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0});
    let r = post(&[("X-Request-Id", "job-9")], "/v1/completions", &completion);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id").as_deref(), Some("job-9"));
    assert_eq!(r.json()["id"], "cmpl-job-9");
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "stream": true});
    let r = post(&[("X-Request-Id", "job-10")], "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id").as_deref(), Some("job-10"));
    assert!(chunks(&r.events())
        .iter()
        .all(|c| c["id"] == "chatcmpl-job-10"));

    let fresh: Vec<String> = (0..2)
        .map(|_| {
            let r = post(&[], "/v1/completions", &completion);
            assert_eq!(r.status, 200, "{}", r.text());
            r.header("x-request-id").expect("a fresh id")
        })
        .collect();
    assert!(!fresh[0].is_empty() && fresh[0] != fresh[1], "{fresh:?}");

    let r = post(
        &[("X-Request-Id", "job-11")],
        "/v1/completions",
        &json!({"n": -1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-request-id").as_deref(), Some("job-11"));
    let r = server.request("GET", "/no/such/page", &[("X-Request-Id", "job-12")], b"");
    assert_eq!(r.status, 404);
    assert_eq!(r.header("x-request-id").as_deref(), Some("job-12"));
    let r = server.get("/health");
    assert!(r.header("x-request-id").is_some_and(|id| !id.is_empty()));
}
