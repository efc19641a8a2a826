//! The client-controlled sizes' unit tests: each bound refused naming its
//! key, each value within it let through.

use super::*;
use serde_json::json;

/// Small limits, so the bodies that go past them stay small.
fn config() -> ServerConfig {
    ServerConfig {
        max_n: 4,
        max_prompts: 3,
        max_prompt_bytes: 10,
        max_messages: 2,
        max_stop_strings: 2,
        max_stop_string_bytes: 5,
        max_stop_token_ids: 3,
        max_logit_bias: 2,
        max_extra_args_bytes: 20,
        ..ServerConfig::default()
    }
}

const MAX_MODEL_LEN: usize = 8;

fn completion(body: Value) -> Result<(), ApiError> {
    check_completion(&body, &config(), MAX_MODEL_LEN)
}

fn chat(body: Value) -> Result<(), ApiError> {
    check_chat(&body, &config())
}

/// Asserts `result` is a 400 on `field` whose message names the value,
/// the limit and the key.
fn refused(result: Result<(), ApiError>, field: &str, value: u64, limit: usize, key: &str) {
    let e = result.expect_err(field);
    assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    assert_eq!(e.param.as_deref(), Some(field), "{e:?}");
    for needle in [
        format!("`{field}`: {value} "),
        format!("at most {limit} "),
        format!("`server.{key}`"),
    ] {
        assert!(
            e.message.contains(&needle),
            "{needle:?} not in {:?}",
            e.message
        );
    }
}

fn strings(n: usize, each: &str) -> Vec<String> {
    vec![each.to_string(); n]
}

#[test]
fn n_is_bounded() {
    assert!(completion(json!({"prompt": "x", "n": 4})).is_ok());
    refused(
        completion(json!({"prompt": "x", "n": 5})),
        "n",
        5,
        4,
        "max_n",
    );
    let huge = u64::from(u32::MAX);
    refused(
        completion(json!({"prompt": "x", "n": huge})),
        "n",
        huge,
        4,
        "max_n",
    );
    refused(chat(json!({"messages": [], "n": 5})), "n", 5, 4, "max_n");
}

#[test]
fn prompts_are_bounded_in_number_and_bytes() {
    assert!(completion(json!({"prompt": ["a", "b", "c"]})).is_ok());
    refused(
        completion(json!({"prompt": ["a", "b", "c", "d"]})),
        "prompt",
        4,
        3,
        "max_prompts",
    );
    assert!(completion(json!({"prompt": [[1], [2], [3]]})).is_ok());
    refused(
        completion(json!({"prompt": [[1], [2], [3], [4]]})),
        "prompt",
        4,
        3,
        "max_prompts",
    );
    // Bytes: one string, and several counted together.
    assert!(completion(json!({"prompt": "x".repeat(10)})).is_ok());
    refused(
        completion(json!({"prompt": "x".repeat(11)})),
        "prompt",
        11,
        10,
        "max_prompt_bytes",
    );
    assert!(completion(json!({"prompt": ["xxxxx", "yyyyy"]})).is_ok());
    refused(
        completion(json!({"prompt": ["xxxxx", "yyyyyy"]})),
        "prompt",
        11,
        10,
        "max_prompt_bytes",
    );
}

#[test]
fn token_id_prompts_are_bounded_by_the_context() {
    let ids = |n: usize| vec![1u32; n];
    assert!(completion(json!({"prompt": ids(MAX_MODEL_LEN - 1)})).is_ok());
    let e = completion(json!({"prompt": ids(MAX_MODEL_LEN)})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt"));
    assert!(
        e.message.contains("8 tokens") && e.message.contains("max_model_len"),
        "{e:?}"
    );
    let e = completion(json!({"prompt": [ids(1), ids(MAX_MODEL_LEN)]})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt[1]"), "{e:?}");
}

#[test]
fn chat_is_bounded_in_messages_parts_and_bytes() {
    let msg = |c: Value| json!({"role": "user", "content": c});
    assert!(chat(json!({"messages": [msg(json!("a")), msg(json!("b"))]})).is_ok());
    refused(
        chat(json!({"messages": [msg(json!("a")), msg(json!("b")), msg(json!("c"))]})),
        "messages",
        3,
        2,
        "max_messages",
    );
    let part = json!({"type": "text", "text": "p"});
    assert!(chat(json!({"messages": [msg(json!([part, part]))]})).is_ok());
    refused(
        chat(json!({"messages": [msg(json!([part])), msg(json!([part, part]))]})),
        "messages[1].content",
        3,
        2,
        "max_messages",
    );
    // Strings and text parts count toward the same byte budget.
    let text = |s: &str| json!({"type": "text", "text": s});
    assert!(chat(
        json!({"messages": [msg(json!("12345")), msg(json!([text("678"), text("90")]))]})
    )
    .is_ok());
    refused(
        chat(json!({"messages": [msg(json!("12345")), msg(json!([text("678"), text("901")]))]})),
        "messages",
        11,
        10,
        "max_prompt_bytes",
    );
}

#[test]
fn stop_fields_are_bounded() {
    assert!(completion(json!({"prompt": "x", "stop": strings(2, "12345")})).is_ok());
    refused(
        completion(json!({"prompt": "x", "stop": strings(3, "a")})),
        "stop",
        3,
        2,
        "max_stop_strings",
    );
    refused(
        completion(json!({"prompt": "x", "stop": ["a", "123456"]})),
        "stop[1]",
        6,
        5,
        "max_stop_string_bytes",
    );
    assert!(completion(json!({"prompt": "x", "stop": "12345"})).is_ok());
    refused(
        completion(json!({"prompt": "x", "stop": "123456"})),
        "stop",
        6,
        5,
        "max_stop_string_bytes",
    );
    assert!(completion(json!({"prompt": "x", "stop_token_ids": [1, 2, 3]})).is_ok());
    refused(
        completion(json!({"prompt": "x", "stop_token_ids": [1, 2, 3, 4]})),
        "stop_token_ids",
        4,
        3,
        "max_stop_token_ids",
    );
}

#[test]
fn allowed_token_ids_and_bad_words_are_bounded() {
    let ids = vec![0; MAX_TOKEN_ID_LIST];
    assert!(completion(json!({"prompt": "x", "allowed_token_ids": ids})).is_ok());
    let ids = vec![0; MAX_TOKEN_ID_LIST + 1];
    let e = completion(json!({"prompt": "x", "allowed_token_ids": ids})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("allowed_token_ids"));
    assert!(
        e.message.contains("262145 token ids, but at most 262144"),
        "{e:?}"
    );

    let words = vec!["a"; MAX_BAD_WORDS];
    assert!(chat(json!({"bad_words": words})).is_ok());
    let words = vec!["a"; MAX_BAD_WORDS + 1];
    let e = chat(json!({"bad_words": words})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("bad_words"));
    assert!(e.message.contains("65 words, but at most 64"), "{e:?}");
    // 480 bytes in all: two words of 240 fit, 241 does not.
    let word = "b".repeat(240);
    assert!(chat(json!({"bad_words": [word, word]})).is_ok());
    let e = chat(json!({"bad_words": [word, format!("{word}b")]})).unwrap_err();
    assert!(
        e.message
            .contains("481 bytes in all words together, but at most 480"),
        "{e:?}"
    );
}

#[test]
fn cache_salts_are_non_empty_and_bounded() {
    let salt = "s".repeat(MAX_CACHE_SALT_BYTES);
    assert!(completion(json!({"prompt": "x", "cache_salt": salt})).is_ok());
    let e = chat(json!({"cache_salt": format!("{salt}s")})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("cache_salt"));
    assert!(e.message.contains("1025 bytes, but at most 1024"), "{e:?}");
    let e = completion(json!({"prompt": "x", "cache_salt": ""})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("cache_salt"));
    assert!(e.message.contains("non-empty"), "{e:?}");
}

#[test]
fn logit_bias_entries_are_counted() {
    assert!(completion(json!({"prompt": "x", "logit_bias": {"1": 1, "2": 1}})).is_ok());
    refused(
        completion(json!({"prompt": "x", "logit_bias": {"1": 1, "2": 1, "3": 1}})),
        "logit_bias",
        3,
        2,
        "max_logit_bias",
    );
}

#[test]
fn extra_args_are_bounded_together() {
    // {"k":"123456789012"} is 20 bytes as compact JSON.
    let twenty = json!({"k": "123456789012"});
    assert!(completion(json!({"prompt": "x", "extra_args": twenty})).is_ok());
    assert!(completion(json!({"prompt": "x", "vllm_xargs": twenty})).is_ok());
    let e = json!({"k": "1234567890123"});
    refused(
        completion(json!({"prompt": "x", "extra_args": e})),
        "extra_args",
        21,
        20,
        "max_extra_args_bytes",
    );
    refused(
        completion(json!({"prompt": "x", "extra_args": {"a": 1}, "vllm_xargs": {"b": "123456"}})),
        "vllm_xargs",
        21,
        20,
        "max_extra_args_bytes",
    );
    // A schema or regex travels in extra_args too, so it counts.
    let regex = json!({"regex": "12345"});
    assert!(chat(json!({"structured_outputs": regex})).is_ok());
    refused(
        chat(json!({"extra_args": {"a": 1}, "structured_outputs": regex})),
        "structured_outputs",
        24,
        20,
        "max_extra_args_bytes",
    );
    let format = json!({"type": "json_schema", "json_schema": {"name": "n", "schema": {}}});
    refused(
        chat(json!({"response_format": format})),
        "response_format",
        61,
        20,
        "max_extra_args_bytes",
    );
}

#[test]
fn mistyped_fields_are_left_to_the_typed_reading() {
    assert!(
        completion(json!({"prompt": 7, "n": "many", "stop": 3, "stop_token_ids": "x"})).is_ok()
    );
    assert!(chat(json!({"messages": "hi"})).is_ok());
}

#[test]
fn the_context_bounds_prompt_and_max_tokens() {
    let max_tokens = |n| ("max_tokens", n);
    assert!(check_context("prompt", 7, max_tokens(1), 8).is_ok());
    let e = check_context("prompt[1]", 0, max_tokens(1), 8).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt[1]"));
    assert!(e.message.contains("no tokens"), "{}", e.message);
    let e = check_context("messages", 8, max_tokens(1), 8).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages"));
    assert!(
        e.message.contains("8 tokens") && e.message.contains("below 8"),
        "{e:?}"
    );
    let e = check_context("prompt", 3, max_tokens(u32::MAX), 8).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    assert!(
        e.message.contains("4294967295") && e.message.contains("at most 5"),
        "{e:?}"
    );
    assert!(check_context("prompt", 3, max_tokens(5), 8).is_ok());
    let e = check_context("prompt", 3, ("max_completion_tokens", 6), 8).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
}
