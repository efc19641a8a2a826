//! `host serve`'s bounds on client-controlled sizes (issue 13), end to end:
//! a real server started with small `[server]` limits is sent bodies past
//! them (and `n` and `max_tokens` at the edges of their types), answers
//! each with a prompt 400 naming the field, and afterwards still answers a
//! normal request exactly as it did before.

use crate::harness;

use std::time::{Duration, Instant};

use harness::Server;
use serde_json::{json, Value};

/// A refusal must come at once: before the bounds, `"n": 1000000` kept the
/// server busy for minutes and `"n": 4294967295` aborted it.
const PROMPT_REFUSAL: Duration = Duration::from_secs(10);

#[test]
fn oversized_requests_get_a_400_naming_the_field_and_the_server_keeps_serving() {
    let server = Server::start(&[
        "--set",
        "server.max_n=4",
        "--set",
        "server.max_prompts=2",
        "--set",
        "server.max_prompt_bytes=64",
        "--set",
        "server.max_messages=2",
        "--set",
        "server.max_stop_strings=2",
    ]);
    let greedy = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let before = server.post("/v1/completions", &greedy);
    assert_eq!(before.status, 200, "{}", before.text());
    let before_text = before.json()["choices"][0]["text"].clone();

    let user = |text: &str| json!({"role": "user", "content": text});
    let completions = "/v1/completions";
    let chat = "/v1/chat/completions";
    // (endpoint, body, the field named, text the message must hold)
    let cases: Vec<(&str, Value, &str, Vec<&str>)> = vec![
        (
            completions,
            json!({"prompt": "hi", "n": 4294967295u64}),
            "n",
            vec!["4294967295", "at most 4", "server.max_n"],
        ),
        (
            completions,
            json!({"prompt": "hi", "n": 1000000}),
            "n",
            vec!["1000000", "server.max_n"],
        ),
        (
            completions,
            json!({"prompt": "hi", "n": 4294967296u64}),
            "n",
            vec![],
        ),
        (
            completions,
            json!({"prompt": "hi", "n": 5}),
            "n",
            vec!["5 choices"],
        ),
        (
            chat,
            json!({"messages": [user("hi")], "n": 1000000}),
            "n",
            vec!["server.max_n"],
        ),
        (
            completions,
            json!({"prompt": ["a", "b", "c"]}),
            "prompt",
            vec!["3 prompts", "server.max_prompts"],
        ),
        (
            completions,
            json!({"prompt": "x".repeat(65)}),
            "prompt",
            vec!["65 bytes", "server.max_prompt_bytes"],
        ),
        (
            chat,
            json!({"messages": [user("a"), user("b"), user("c")]}),
            "messages",
            vec!["server.max_messages"],
        ),
        (
            chat,
            json!({"messages": [user(&"x".repeat(40)), user(&"y".repeat(40))]}),
            "messages",
            vec!["80 bytes", "server.max_prompt_bytes"],
        ),
        (
            completions,
            json!({"prompt": "hi", "stop": ["a", "b", "c"]}),
            "stop",
            vec!["server.max_stop_strings"],
        ),
        (
            completions,
            json!({"prompt": vec![1u32; 100_000]}),
            "prompt",
            vec!["100000 tokens", "max_model_len"],
        ),
        (
            completions,
            json!({"prompt": "hi", "max_tokens": u32::MAX}),
            "max_tokens",
            vec!["4294967295", "max_model_len"],
        ),
        (
            completions,
            json!({"prompt": "hi", "max_tokens": u32::MAX, "stream": true}),
            "max_tokens",
            vec!["max_model_len"],
        ),
        (
            chat,
            json!({"messages": [user("hi")], "max_completion_tokens": u32::MAX}),
            "max_completion_tokens",
            vec!["max_model_len"],
        ),
        (
            chat,
            json!({"messages": [user("hi")], "guided_json": {"type": "object"}}),
            "guided_json",
            vec!["not supported"],
        ),
        (
            completions,
            json!({"prompt": "hi", "guided_choice": ["yes", "no"]}),
            "guided_choice",
            vec!["not supported"],
        ),
        (
            chat,
            json!({"messages": [{"role": "bot", "content": "hi"}]}),
            "messages[0].role",
            vec!["system", "user", "assistant"],
        ),
    ];
    for (path, body, field, needles) in cases {
        let started = Instant::now();
        let r = server.post(path, &body);
        let took = started.elapsed();
        let shown: String = body.to_string().chars().take(120).collect();
        assert_eq!(r.status, 400, "{path} {shown}: {}", r.text());
        assert!(
            took < PROMPT_REFUSAL,
            "{path} {shown}: refused after {took:?}"
        );
        let e = &r.json()["error"];
        assert_eq!(e["type"], "BadRequestError", "{shown}");
        assert_eq!(e["param"].as_str(), Some(field), "{path} {shown}: {e}");
        let message = e["message"].as_str().unwrap();
        for needle in needles {
            assert!(
                message.contains(needle),
                "{shown}: {needle:?} not in {message:?}"
            );
        }
    }

    // Still alive and serving the same answers, at the limits themselves
    // and with a field it does not know (ignored, with a warning).
    assert_eq!(server.get("/health").status, 200);
    let after = server.post("/v1/completions", &greedy);
    assert_eq!(after.status, 200, "{}", after.text());
    assert_eq!(after.json()["choices"][0]["text"], before_text);
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": ["a", "b"], "n": 4, "max_tokens": 2, "stop": ["x", "y"],
                "frobnicate": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 8);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "developer", "content": "Be brief."}, user("Hi")],
                "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
