//! Tool calling over HTTP with the official `openai` client: named and
//! required calls, streamed and not, a call -> tool result -> answer round
//! trip and `auto`, every call's arguments validated against the function's
//! schema with `jsonschema` (tests/server/tools_client.py); the same on the
//! Responses API, against chat's answers, and driven by the OpenAI Agents
//! SDK (tests/server/responses_tools_client.py); and the shapes refused
//! with a 400 naming the field.

use crate::harness;

use harness::Server;
use serde_json::{json, Value};

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}})
}

#[test]
fn malformed_tool_requests_are_400s_naming_the_field() {
    let server = Server::start(&[]);
    let ask = json!([{"role": "user", "content": "hi"}]);
    let mut cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": ask, "tools": [tool("f")], "tool_choice": "always"}),
            "tool_choice",
            "use none, auto, required",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ask, "tools": [tool("f"), tool("f")]}),
            "tools[1].function.name",
            "offered twice",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ask, "tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
            "only `function` tools",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ask, "tool_choice": "required"}),
            "tool_choice",
            "`tools` offers none",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}),
            "messages[0].tool_calls",
            "only an assistant message carries tool calls",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}),
            "messages[0].tool_calls",
            "is not JSON",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "tools": [tool("f")]}),
            "tools",
            "/v1/chat/completions and /v1/responses only",
        ),
    ];
    // Thousands of tools: their description is prompt text, bounded as the
    // messages are (server.max_prompt_bytes, 1 MiB by default).
    let many: Vec<Value> = (0..12_000)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "description": "d".repeat(100)}}))
        .collect();
    let flat: Vec<Value> = many
        .iter()
        .map(|t| json!({"type": "function", "name": t["function"]["name"], "description": t["function"]["description"]}))
        .collect();
    cases.push((
        "/v1/chat/completions",
        json!({"messages": ask, "tools": many}),
        "tools",
        "max_prompt_bytes",
    ));
    cases.push((
        "/v1/responses",
        json!({"input": "hi", "tools": flat}),
        "tools",
        "max_prompt_bytes",
    ));
    for (path, body, param, needle) in cases {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{param}: {}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["param"], param, "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(needle), "{param}: {message}");
    }
    // `none` with tools is an ordinary answer.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": ask, "tools": [tool("f")], "tool_choice": "none", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["choices"][0]["message"]["tool_calls"].is_null());
}

#[test]
fn the_openai_client_calls_tools_with_arguments_that_follow_their_schema() {
    let server = Server::start_with_structured_outputs(&["--api-key", "sesame"]);
    server.run_openai_script("tools_client.py", &json!({}));
}

#[test]
fn the_responses_api_and_the_agents_sdk_call_tools_as_chat_does() {
    let server = Server::start_with_structured_outputs(&["--api-key", "sesame"]);
    server.run_openai_script("responses_tools_client.py", &json!({}));
}
