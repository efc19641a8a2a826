//! `/v1/responses` through the official `openai` Python client
//! (`client.responses.create`, streamed and not, retrieve, cancel,
//! delete, background, `previous_response_id`) against `host serve` with an
//! API key. The expected texts are the offline engine's greedy chat answers
//! for the same conversations, computed without any HTTP.

use crate::harness;

use std::time::Duration;

use harness::Server;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use host::tokenizer::ChatMessage;
use serde_json::json;

/// The offline engine's greedy answers (16 tokens) to each conversation.
fn offline(conversations: Vec<Vec<ChatMessage>>) -> Vec<String> {
    let config = e2e::default_config();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 16,
        ..SamplingParams::default()
    };
    let reqs: Vec<_> = conversations
        .into_iter()
        .map(|c| GenerateRequest::new(Prompt::Chat(c), params.clone()))
        .collect();
    Llm::new(&config)
        .unwrap()
        .generate(&reqs, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|c| c.unwrap().text)
        .collect()
}

#[test]
fn the_openai_client_drives_the_responses_api() {
    let question = "Name three colours.";
    let instructions = "Answer in French.";
    let follow_up = "Now name three animals.";
    let user = |s: &str| ChatMessage::new("user", s);
    let first = offline(vec![vec![user(question)]]).remove(0);
    let mut want = offline(vec![
        vec![ChatMessage::new("system", instructions), user(question)],
        vec![
            user(question),
            ChatMessage::new("assistant", first.clone()),
            user(follow_up),
        ],
    ]);
    let expected = json!({
        "question": question,
        "answer": first,
        "instructions": instructions,
        "answer_with_instructions": want.remove(0),
        "follow_up": follow_up,
        "follow_up_answer": want.remove(0),
    });

    let server = Server::start(&["--api-key", "sesame"]);
    server.run_openai_script("responses_client.py", &expected);
    // The cancelled response's engine request was aborted: nothing runs and
    // no KV block stays in use.
    server.wait_idle(Duration::from_secs(10));
}

#[test]
fn the_store_is_bounded_and_a_client_that_leaves_cancels() {
    let server = Server::start(&["--set", "server.max_stored_responses=2"]);
    let create = |input: &str| {
        let r = server.post(
            "/v1/responses",
            &json!({"input": input, "max_output_tokens": 2, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_string()
    };
    let ids: Vec<String> = ["a", "b", "c"].iter().map(|s| create(s)).collect();
    // Only the two newest are kept.
    assert_eq!(server.get(&format!("/v1/responses/{}", ids[0])).status, 404);
    for id in &ids[1..] {
        let v = server.get(&format!("/v1/responses/{id}")).json();
        assert_eq!(v["id"], *id, "{v}");
    }
    let r = server.post(
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": ids[0]}),
    );
    assert_eq!(r.json()["error"]["param"], "previous_response_id");

    // A streamed response whose client goes away mid-answer is cancelled
    // and its engine request aborted.
    let body = json!({"input": "Count to a thousand.", "stream": true, "max_output_tokens": 1000,
                      "ignore_eos": true, "temperature": 0});
    let mut stream = server.send("POST", "/v1/responses", &[], body.to_string().as_bytes());
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("response.output_text.delta") {
        let n = std::io::Read::read(&mut stream, &mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let id = seen
        .split("\"id\":\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap()
        .to_string();
    drop(stream);
    server.wait_idle(Duration::from_secs(10));
    let v = server.get(&format!("/v1/responses/{id}")).json();
    assert_eq!(v["status"], "cancelled", "{v}");
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() < 1000, "{v}");
}

/// OpenAI's `truncation: "auto"`: a conversation longer than the context
/// answers as the conversation without its oldest items does, leaving out
/// the fewest that make the prompt fit (counted here with `/tokenize`);
/// with `disabled` (the default) it is a 400 naming `input`.
#[test]
fn auto_truncation_leaves_the_oldest_items_out() {
    let server = Server::start(&["--max-model-len", "256"]);
    let max_output_tokens = 16;
    let mut items: Vec<serde_json::Value> = (0..6)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let text = format!("Turn {i}: ") + &"the river runs to the sea and back. ".repeat(6);
            json!({"role": role, "content": text})
        })
        .collect();
    items.push(json!({"role": "user", "content": "Name three colours."}));
    let tokens = |items: &[serde_json::Value]| {
        let r = server.post("/tokenize", &json!({"messages": items}));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["count"].as_u64().unwrap()
    };
    let dropped = (0..items.len())
        .find(|&k| tokens(&items[k..]) + max_output_tokens <= 256)
        .unwrap();
    assert!(dropped >= 2, "the conversation must overflow: {dropped}");
    let respond = |input: &[serde_json::Value], truncation: &str| {
        server.post(
            "/v1/responses",
            &json!({"input": input, "truncation": truncation, "temperature": 0,
                "max_output_tokens": max_output_tokens}),
        )
    };
    let r = respond(&items, "disabled");
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "input");

    let auto = respond(&items, "auto");
    assert_eq!(auto.status, 200, "{}", auto.text());
    let by_hand = respond(&items[dropped..], "disabled");
    assert_eq!(by_hand.status, 200, "{}", by_hand.text());
    let (auto, by_hand) = (auto.json(), by_hand.json());
    assert_eq!(auto["truncation"], "auto");
    assert_eq!(
        auto["usage"]["input_tokens"].as_u64(),
        Some(tokens(&items[dropped..]))
    );
    assert_eq!(
        auto["output"][0]["content"][0]["text"],
        by_hand["output"][0]["content"][0]["text"]
    );
}
