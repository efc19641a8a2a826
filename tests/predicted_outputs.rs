//! Predicted outputs (OpenAI's `prediction` on chat completions) on the
//! real model: the prediction is verified as speculative drafts, so the
//! answer must be the one the offline engine gives without drafts, while
//! `usage.completion_tokens_details` counts the predicted tokens kept;
//! refused with a 400 naming what to change where it cannot be honoured;
//! and read by the official `openai` client.

use crate::harness::Server;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use host::tokenizer::ChatMessage;
use serde_json::{json, Value};

/// A function the model is asked to rename and show again: most of the
/// answer repeats it.
const CODE: &str = "def parse_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n            if not line or line.startswith(\"#\"):\n                continue\n            key, value = line.split(\"=\", 1)\n            config[key.strip()] = value.strip()\n    return config\n";

fn question() -> String {
    format!(
        "Rename the function parse_config to load_config in this code and show the whole code:\n```python\n{CODE}```"
    )
}

const MAX_TOKENS: u32 = 96;

/// The offline engine's greedy answer, without drafts or prediction.
fn expected_answer() -> String {
    let config = e2e::default_config();
    let req = GenerateRequest::new(
        Prompt::Chat(vec![ChatMessage::new("user", question().as_str())]),
        SamplingParams {
            temperature: 0.0,
            max_tokens: MAX_TOKENS,
            ..SamplingParams::default()
        },
    );
    let mut done = Llm::new(&config)
        .unwrap()
        .generate(&[req], |_, _| {}, |_, _| {})
        .unwrap();
    done.remove(0).unwrap().text
}

fn chat(prediction: Value) -> Value {
    json!({"messages": [{"role": "user", "content": question()}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "prediction": prediction})
}

/// The answer with a prediction is the answer without one, sooner; the
/// tally says how much of the prediction was kept, streamed or not.
#[test]
fn a_prediction_keeps_the_answer_and_reports_what_was_kept() {
    let want = expected_answer();
    let server = Server::start(&["--speculative-config", r#"{"num_speculative_tokens": 4}"#]);
    let predicted = json!({"type": "content", "content": CODE});
    let r = server.post("/v1/chat/completions", &chat(predicted.clone()));
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["choices"][0]["message"]["content"], want.as_str());
    let usage = &body["usage"];
    let details = &usage["completion_tokens_details"];
    let kept = details["accepted_prediction_tokens"].as_u64().unwrap();
    let not_kept = details["rejected_prediction_tokens"].as_u64().unwrap();
    let answer = usage["completion_tokens"].as_u64().unwrap();
    // The answer repeats most of the code, and every step keeps at most
    // its drafts plus the token after them.
    assert!(kept >= answer / 3, "{usage}");
    assert!(kept < answer, "{usage}");
    println!("predicted tokens kept {kept}, not kept {not_kept}, of {answer}");

    // The answer itself as prediction: it covers every token but the end
    // of sequence, so every draft is kept, from the first token on (the
    // prefill verifies the prediction's first four): each step gives
    // four kept drafts and the token after them, the last step fewer.
    let r = server.post(
        "/v1/chat/completions",
        &chat(json!({"type": "content", "content": want})),
    );
    let exact = r.json();
    assert_eq!(exact["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(exact["choices"][0]["finish_reason"], "stop");
    let n = exact["usage"]["completion_tokens"].as_u64().unwrap();
    let steps = n.div_ceil(5);
    assert_eq!(
        exact["usage"]["completion_tokens_details"],
        json!({"accepted_prediction_tokens": n - steps, "rejected_prediction_tokens": 0})
    );

    // The same prediction as a list of text parts; streamed, with usage.
    let parts = json!({"type": "content", "content": [
        {"type": "text", "text": &CODE[..40]}, {"type": "text", "text": &CODE[40..]}]});
    let mut streamed = chat(parts);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    let events: Vec<Value> = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    let last = events.last().unwrap();
    for field in [
        "prompt_tokens",
        "completion_tokens",
        "completion_tokens_details",
    ] {
        // (Only the cached prompt tokens differ: the first run cached them.)
        assert_eq!(
            last["usage"][field], usage[field],
            "the same {field} as unstreamed"
        );
    }

    // Without a prediction: the same answer and no prediction details.
    let r = server.post("/v1/chat/completions", &chat(Value::Null));
    assert_eq!(r.json()["choices"][0]["message"]["content"], want.as_str());
    assert!(r.json()["usage"].get("completion_tokens_details").is_none());

    // Two choices, each drafting from the prediction: the tally is their sum.
    let mut two = chat(predicted.clone());
    two["n"] = json!(2);
    let r = server.post("/v1/chat/completions", &two);
    let body = r.json();
    for c in body["choices"].as_array().unwrap() {
        assert_eq!(c["message"]["content"], want.as_str());
    }
    let both = &body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"];
    assert!(both.as_u64().unwrap() > kept, "{}", body["usage"]);

    // The official client sends the field and reads the tally.
    server.run_openai_script(
        "prediction_client.py",
        &json!({"question": question(), "code": CODE, "answer": want, "max_tokens": MAX_TOKENS}),
    );
}

/// What cannot be honoured is refused, naming the field and the fix.
#[test]
fn a_prediction_that_cannot_be_honoured_is_refused_by_name() {
    let plain = Server::start(&[]);
    let r = plain.post(
        "/v1/chat/completions",
        &chat(json!({"type": "content", "content": CODE})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("--speculative-config"), "{}", r.text());
    // `null` asks for nothing.
    let mut none = chat(Value::Null);
    none["max_tokens"] = json!(2);
    assert_eq!(plain.post("/v1/chat/completions", &none).status, 200);
    for (prediction, param) in [
        (json!({"type": "text", "content": "x"}), "prediction.type"),
        (
            json!({"type": "content", "content": 7}),
            "prediction.content",
        ),
        (
            json!({"type": "content", "content": [{"type": "image_url"}]}),
            "prediction.content[0]",
        ),
        (
            json!({"type": "content", "content": "x", "extra": 1}),
            "prediction.extra",
        ),
        (json!("x"), "prediction"),
    ] {
        let r = plain.post("/v1/chat/completions", &chat(prediction.clone()));
        assert_eq!(r.status, 400, "{prediction}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{prediction}");
    }
    let r = plain.post(
        "/v1/completions",
        &json!({"prompt": "a", "prediction": {"type": "content", "content": "b"}}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "prediction");
    // Bounded like a prompt before it is tokenized.
    let big = "a".repeat((1 << 20) + 1);
    let r = plain.post(
        "/v1/chat/completions",
        &chat(json!({"type": "content", "content": big})),
    );
    assert_eq!(r.status, 400);
    assert!(r.text().contains("max_prompt_bytes"), "{}", r.text());
}
