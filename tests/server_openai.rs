//! The official `openai` Python client against `host serve` (with an API
//! key, echoing `X-Request-Id`): completions, chat, streaming, logprobs,
//! seeds, vLLM's extra fields and headers, typed errors. The
//! expected texts come from the offline engine, so the client's view is
//! checked against an answer computed without any HTTP.

use crate::harness;

use harness::Server;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use host::tokenizer::ChatMessage;
use serde_json::json;

#[test]
fn the_openai_client_works_unchanged() {
    let prompt = "The capital of France is";
    let chat_user = "Name three colours.";
    let config = e2e::default_config();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 16,
        ..SamplingParams::default()
    };
    let reqs: Vec<_> = [
        Prompt::Text(prompt.into()),
        Prompt::Chat(vec![ChatMessage::new("user", chat_user)]),
    ]
    .into_iter()
    .map(|prompt| GenerateRequest::new(prompt, params.clone()))
    .collect();
    let want = Llm::new(&config)
        .unwrap()
        .generate(&reqs, |_, _| {}, |_, _| {})
        .unwrap();
    let expected = json!({
        "prompt": prompt,
        "completion": want[0].as_ref().unwrap().text,
        "chat_user": chat_user,
        "chat": want[1].as_ref().unwrap().text,
    });

    let server = Server::start(&["--api-key", "sesame", "--enable-request-id-headers"]);
    server.run_openai_script("openai_client.py", &expected);
}
