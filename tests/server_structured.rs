//! Structured outputs over HTTP: `response_format`, `structured_outputs` and
//! the Responses API's `text.format`. Malformed shapes, vLLM's removed
//! `guided_*` fields, a constraint asked for twice and an oversized one are
//! 400s that name the field, before anything is queued; with the
//! structured-output plugin loaded, the official `openai` client's outputs
//! follow their schema, regex, choice or grammar, judged by `jsonschema`
//! and Python's `re` (tests/server/structured_client.py).

use crate::harness;

use harness::Server;
use serde_json::{json, Value};

/// A chat body asking `extra` on top of one user message.
fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// A completions body asking `extra`.
fn completion(extra: Value) -> Value {
    let mut body = json!({"prompt": "hi", "max_tokens": 4});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn malformed_structured_output_requests_are_400s_naming_the_field() {
    let server = Server::start(&[]);
    let schema_format =
        |spec: Value| json!({"response_format": {"type": "json_schema", "json_schema": spec}});
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v1/chat/completions",
            chat(schema_format(json!({"schema": {"type": "object"}}))),
            "response_format.json_schema.name",
            "must be a string naming the schema",
        ),
        (
            "/v1/chat/completions",
            chat(schema_format(json!({"name": "a"}))),
            "response_format.json_schema.schema",
            "is missing",
        ),
        (
            "/v1/completions",
            completion(json!({"response_format": {"type": "structural_tag"}})),
            "response_format.type",
            "`structural_tag` is not supported",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "yaml"}, "stream": true})),
            "response_format.type",
            "the types accepted are text, json_object and json_schema",
        ),
        (
            "/v1/completions",
            completion(json!({"structured_outputs": {"regex": "a", "choice": ["a"]}})),
            "structured_outputs",
            "sets regex and choice; set exactly one of",
        ),
        (
            "/v1/completions",
            completion(json!({"structured_outputs": {"regex": "a", "backend": "xgrammar"}})),
            "structured_outputs.backend",
            "is not a structured_outputs key",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"structured_outputs": {"json": "{not json"}, "stream": true})),
            "structured_outputs.json",
            "is a string that is not JSON",
        ),
        (
            "/v1/chat/completions",
            chat(
                json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            ),
            "structured_outputs",
            "`response_format` asks for a format too",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"},
                "vllm_xargs": {"structured_outputs": {"regex": "a"}}})),
            "response_format",
            "`vllm_xargs.structured_outputs` sets a structured-output constraint too",
        ),
        (
            "/v1/completions",
            completion(json!({"structured_outputs": {"regex": "a"},
                "extra_args": {"structured_outputs": {"choice": ["b"]}}})),
            "structured_outputs",
            "`extra_args.structured_outputs` sets a structured-output constraint too",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_json": {"type": "object"}})),
            "guided_json",
            "send `structured_outputs: {\"json\": <schema>}`",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_choice": ["a", "b"]})),
            "guided_choice",
            "send `structured_outputs: {\"choice\": [...]}`",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_regex": "[0-9]+"})),
            "guided_regex",
            "send `structured_outputs: {\"regex\": <pattern>}`",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"guided_grammar": "start: \"a\""})),
            "guided_grammar",
            "send `structured_outputs: {\"grammar\": <Lark grammar>}`",
        ),
        // A constraint travels in extra_args and shares its bound (64 KiB).
        (
            "/v1/chat/completions",
            chat(json!({"structured_outputs": {"regex": "a".repeat(70_000)}})),
            "structured_outputs",
            "`server.max_extra_args_bytes`",
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}),
            "text.format.name",
            "must be a string naming the schema",
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "text": {"format": {"type": "text"}, "verbosity": "low"}}),
            "text",
            "not `verbosity`",
        ),
    ];
    for (path, body, param, needle) in cases {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{path} {param}: {}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["type"], "BadRequestError", "{error}");
        assert_eq!(error["param"], param, "{path}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(needle), "{param}: {message}");
    }
    // Plain text asks for nothing: the request runs as before.
    let r = server.post(
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "text"}, "structured_outputs": null})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

/// In the engine's process (`uni`) and in a worker process of its own
/// (`mp`), where the vocabulary and every mask cross to the plugin inside
/// the worker through shared memory.
#[test]
fn the_openai_client_gets_outputs_that_follow_the_constraint_uni_and_mp() {
    for backend in ["uni", "mp"] {
        let executor = format!("parallel.distributed_executor_backend={backend}");
        let server =
            Server::start_with_structured_outputs(&["--api-key", "sesame", "--set", &executor]);
        server.run_openai_script("structured_client.py", &json!({}));
    }
}

/// A constrained request the plugin cannot serve fails alone, clearly:
/// `allowed_token_ids` leaves none of the tokens its choice allows, so the
/// token sampled breaks the constraint and the plugin fails that row. A
/// constrained and an unconstrained request running beside it finish as
/// they do alone.
#[test]
fn a_request_the_plugin_cannot_serve_fails_alone() {
    let server = Server::start_with_structured_outputs(&[]);
    let choice = json!({"choice": ["yes", "no"]});
    let doomed = completion(
        json!({"prompt": "Is it?", "max_tokens": 8, "temperature": 0,
        "structured_outputs": choice, "allowed_token_ids": [3]}),
    );
    let constrained = completion(
        json!({"prompt": "Is it?", "max_tokens": 8, "temperature": 0,
        "structured_outputs": choice}),
    );
    let free = completion(
        json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    );
    let alone = server.post("/v1/completions", &free).json()["choices"][0]["text"].clone();
    let server = &server;
    let [doomed, constrained, free] = std::thread::scope(|s| {
        [&doomed, &constrained, &free]
            .map(|body| s.spawn(move || server.post("/v1/completions", body)))
            .map(|h| h.join().unwrap())
    });
    assert_eq!(doomed.status, 500, "{}", doomed.text());
    let message = doomed.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("engine:structured-output")
            && message.contains("does not fit the constraint"),
        "{message}"
    );
    assert_eq!(constrained.status, 200, "{}", constrained.text());
    let text = constrained.json()["choices"][0]["text"].clone();
    assert!(text == "yes" || text == "no", "{text}");
    assert_eq!(free.status, 200, "{}", free.text());
    assert_eq!(free.json()["choices"][0]["text"], alone);
}
