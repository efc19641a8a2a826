//! Reading a `POST /v1/responses` body: which fields are honoured,
//! refused or harmless, `input` (a string or message items) into chat
//! messages, and every size bounded before anything is copied.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::error::ApiError;
use super::super::fields::{self, no_forced_call, unset, Neutral, Unsupported};
use super::super::limits;
use super::super::protocol::SamplingRequest;
use crate::config::ServerConfig;
use crate::tokenizer::ChatMessage;

/// The endpoint's own fields this server honours (the sampling fields of
/// [`SamplingRequest`] are read from the same body).
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesRequest {
    /// The served model's id; optional (the one model is meant).
    #[serde(default)]
    pub model: Option<String>,
    /// A string (one user message) or a list of message items.
    #[serde(default)]
    pub input: Value,
    /// A system message put first; not carried over to continuations.
    #[serde(default)]
    pub instructions: Option<String>,
    /// A stored response whose conversation and answer come before `input`.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Most tokens to generate; unset runs to the context's end.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Answer with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Keep the response for retrieve, continuation and cancel (default
    /// true, as OpenAI).
    #[serde(default = "yes")]
    pub store: Option<bool>,
    /// Answer at once and generate detached from the request (poll with
    /// `GET /v1/responses/{id}`).
    #[serde(default)]
    pub background: bool,
    /// Key-value pairs repeated back and stored.
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    /// The caller's end-user id, repeated back.
    #[serde(default)]
    pub user: Option<String>,
}

fn yes() -> Option<bool> {
    Some(true)
}

/// `null`, or an object that sets nothing but `format` (which
/// `structured::from_text_format` reads).
fn format_only(v: &Value) -> bool {
    let Some(o) = v.as_object() else {
        return v.is_null();
    };
    o.iter().all(|(k, v)| k == "format" || v.is_null())
}

/// `null` or an object whose every value is `null`.
fn no_reasoning(v: &Value) -> bool {
    v.is_null()
        || v.as_object()
            .is_some_and(|o| o.values().all(Value::is_null))
}

/// `null`, `0`.
fn unset_or_zero(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(0)
}

/// `null`, `"disabled"`.
fn no_truncation(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("disabled")
}

/// `null` or 1.
fn unset_or_one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}

/// Fields OpenAI (or vLLM) define for this endpoint that are not
/// implemented: refused unless neutral.
const UNSUPPORTED: &[Unsupported] = &[
    ("tools", unset as Neutral, fields::TOOLS_ON_CHAT),
    ("tool_choice", no_forced_call, fields::TOOLS_ON_CHAT),
    ("text", format_only, "only `text.format` is supported (not `verbosity`: ask for the length you want in the instructions)"),
    ("reasoning", no_reasoning, "reasoning options are not supported: this model does not reason"),
    ("include", unset, "extra output data (`include`) is not supported"),
    ("conversation", unset, "conversations are not supported; chain responses with previous_response_id"),
    ("prompt", unset, "prompt templates are not supported; send input and instructions"),
    ("top_logprobs", unset_or_zero, "logprobs are not supported on /v1/responses; /v1/chat/completions returns them"),
    ("truncation", no_truncation, "`auto` truncation is not supported; a conversation longer than the context is refused"),
    ("n", unset_or_one, "one answer per response; send several requests for more"),
    ("max_tokens", unset, "is the chat API's name; use max_output_tokens"),
    ("max_completion_tokens", unset, "is the chat API's name; use max_output_tokens"),
    ("logprobs", unset, "logprobs are not supported on /v1/responses; /v1/chat/completions returns them"),
    ("prompt_logprobs", unset, "prompt logprobs are not supported on /v1/responses; /v1/completions returns them"),
];

/// Fields that cannot change the answer here.
const HARMLESS: &[&str] = &[
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "parallel_tool_calls",
    "max_tool_calls",
    "stream_options",
];

/// OpenAI's bounds on `metadata`.
const METADATA_PAIRS: usize = 16;
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;

/// Checks the body's fields and sizes, then reads the endpoint's and the
/// sampling fields.
pub fn read(
    body: &Value,
    config: &ServerConfig,
) -> Result<(ResponsesRequest, SamplingRequest), ApiError> {
    check_input_size(body, config)?;
    limits::check_sampling(body, config)?;
    if let Some(text) = body.get("text") {
        // Its format (a JSON schema) travels to the plugins in extra_args.
        let unit = "bytes as compact JSON";
        let limit = config.max_extra_args_bytes;
        limits::at_most(
            "text",
            limits::json_len(text),
            unit,
            limit,
            "max_extra_args_bytes",
        )?;
    }
    let known: Vec<&str> = fields::field_names::<ResponsesRequest>()
        .iter()
        .chain(fields::field_names::<SamplingRequest>())
        .chain(HARMLESS)
        .copied()
        .collect();
    fields::check_endpoint_fields(body, &known, UNSUPPORTED)?;
    let req: ResponsesRequest = super::super::params::typed(body)?;
    let sampling: SamplingRequest = super::super::params::typed(body)?;
    if let Some(metadata) = &req.metadata {
        check_metadata(metadata)?;
    }
    if req.background && req.stream {
        return Err(ApiError::field(
            "background",
            "background responses are not streamed here; create it, then poll GET /v1/responses/{id}",
        ));
    }
    if req.background && req.store == Some(false) {
        return Err(ApiError::field(
            "background",
            "needs `store: true`: a background response is only reachable from the store",
        ));
    }
    Ok((req, sampling))
}

/// `input` and `instructions` are bounded like chat messages: items and
/// content parts by `server.max_messages`, text by
/// `server.max_prompt_bytes`.
fn check_input_size(body: &Value, config: &ServerConfig) -> Result<(), ApiError> {
    let mut bytes = body
        .get("instructions")
        .and_then(Value::as_str)
        .map_or(0, |s| s.len() as u64);
    match body.get("input") {
        Some(Value::String(s)) => bytes += s.len() as u64,
        Some(Value::Array(items)) => {
            let limit = config.max_messages;
            let key = "max_messages";
            limits::at_most("input", items.len() as u64, "items", limit, key)?;
            let mut parts = 0u64;
            for (i, item) in items.iter().enumerate() {
                match item.get("content") {
                    Some(Value::String(s)) => bytes += s.len() as u64,
                    Some(Value::Array(list)) => {
                        parts += list.len() as u64;
                        let field = format!("input[{i}].content");
                        let unit = "content parts in all items together";
                        limits::at_most(&field, parts, unit, limit, key)?;
                        bytes += list
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .map(|s| s.len() as u64)
                            .sum::<u64>();
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
    limits::prompt_bytes("input", bytes, config)
}

fn check_metadata(metadata: &Map<String, Value>) -> Result<(), ApiError> {
    if metadata.len() > METADATA_PAIRS {
        return Err(ApiError::field(
            "metadata",
            format!(
                "{} pairs, but at most {METADATA_PAIRS} are allowed",
                metadata.len()
            ),
        ));
    }
    for (k, v) in metadata {
        let key: String = k.chars().take(METADATA_KEY_CHARS).collect();
        if k.chars().count() > METADATA_KEY_CHARS {
            return Err(ApiError::field(
                "metadata",
                format!("the key `{key}…` is longer than {METADATA_KEY_CHARS} characters"),
            ));
        }
        match v.as_str() {
            Some(s) if s.chars().count() <= METADATA_VALUE_CHARS => {}
            Some(_) => {
                return Err(ApiError::field(
                    &format!("metadata.{key}"),
                    format!("is longer than {METADATA_VALUE_CHARS} characters"),
                ))
            }
            None => {
                return Err(ApiError::field(
                    &format!("metadata.{key}"),
                    "must be a string",
                ))
            }
        }
    }
    Ok(())
}

/// `input` as chat messages: a string is one user message; a list holds
/// message items (`{"role", "content"}`, `type` absent or `message`)
/// whose content is a string or `input_text` / `output_text` parts.
pub fn input_messages(input: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        Value::Null => return Ok(Vec::new()),
        Value::String(s) => return Ok(vec![ChatMessage::new("user", s.clone())]),
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::field(
                "input",
                "must be a string or a list of message items",
            ))
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| message(i, item))
        .collect()
}

fn message(i: usize, item: &Value) -> Result<ChatMessage, ApiError> {
    let field = |name: &str| format!("input[{i}].{name}");
    let Some(item) = item.as_object() else {
        return Err(ApiError::field(
            &format!("input[{i}]"),
            "must be a message item, an object with `role` and `content`",
        ));
    };
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {}
        Some("item_reference") => {
            return Err(ApiError::field(
                &field("type"),
                "item references are not supported; continue a stored response with previous_response_id",
            ))
        }
        Some(other) => {
            let other: String = other.chars().take(fields::IGNORED_NAME_CHARS).collect();
            return Err(ApiError::field(
                &field("type"),
                format!("is `{other}`; only message items are supported (tool calls and reasoning items are not)"),
            ));
        }
    }
    let role = match item.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some(other) => {
            let other: String = other.chars().take(fields::IGNORED_NAME_CHARS).collect();
            return Err(ApiError::field(
                &field("role"),
                format!("is `{other}`; the roles accepted are user, assistant, system and developer (taken as system)"),
            ));
        }
        None => return Err(ApiError::field(&field("role"), "is missing")),
    };
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (Some("input_text" | "output_text" | "text"), None) => {
                        return Err(ApiError::field(
                            &format!("input[{i}].content[{j}].text"),
                            "is missing or not a string",
                        ))
                    }
                    (other, _) => {
                        let other: String = other
                            .unwrap_or("(none)")
                            .chars()
                            .take(fields::IGNORED_NAME_CHARS)
                            .collect();
                        return Err(ApiError::field(
                            &format!("input[{i}].content[{j}].type"),
                            format!("is `{other}`; this model takes `input_text` parts only"),
                        ));
                    }
                }
            }
            text
        }
        Some(Value::Null) | None => String::new(),
        Some(_) => {
            return Err(ApiError::field(
                &field("content"),
                "must be a string or a list of input_text parts",
            ))
        }
    };
    Ok(ChatMessage::new(role, content))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_is_text_or_message_items() {
        assert_eq!(
            input_messages(&json!("hi")).unwrap(),
            vec![ChatMessage::new("user", "hi")]
        );
        let items = json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "you"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
        ]);
        assert_eq!(
            input_messages(&items).unwrap(),
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hello, you"),
                ChatMessage::new("assistant", "Hi"),
            ]
        );
    }

    #[test]
    fn other_items_and_parts_are_refused_by_path() {
        let cases = [
            (
                json!([{"type": "function_call", "name": "f"}]),
                "input[0].type",
            ),
            (json!([{"role": "tool", "content": "x"}]), "input[0].role"),
            (json!([{"content": "x"}]), "input[0].role"),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
                "input[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_text"}]}]),
                "input[0].content[0].text",
            ),
            (json!(5), "input"),
            (json!([3]), "input[0]"),
        ];
        for (input, param) in cases {
            let e = input_messages(&input).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{input}: {e:?}");
        }
    }

    fn config() -> ServerConfig {
        ServerConfig {
            max_messages: 2,
            max_prompt_bytes: 10,
            ..ServerConfig::default()
        }
    }

    #[test]
    fn fields_and_sizes_are_checked() {
        let ok = json!({"input": "hi", "instructions": "be", "text": {"format": {"type": "text"}},
            "reasoning": {"effort": null}, "tool_choice": "auto", "truncation": "disabled",
            "metadata": {"k": "v"}, "temperature": 0, "max_output_tokens": 4, "store": false});
        let (req, sampling) = read(&ok, &config()).unwrap();
        assert_eq!(req.store, Some(false));
        assert_eq!(sampling.temperature, Some(0.0));
        for (body, param) in [
            (
                json!({"input": "x", "tools": [{"type": "function"}]}),
                "tools",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}}),
                "text",
            ),
            (
                json!({"input": "x", "reasoning": {"effort": "high"}}),
                "reasoning",
            ),
            (json!({"input": "x", "max_tokens": 3}), "max_tokens"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (
                json!({"input": "x", "include": ["reasoning.encrypted_content"]}),
                "include",
            ),
            (
                json!({"input": "x", "background": true, "stream": true}),
                "background",
            ),
            (
                json!({"input": "x", "background": true, "store": false}),
                "background",
            ),
            (json!({"input": "x", "metadata": {"k": 1}}), "metadata.k"),
            (json!({"input": "x".repeat(11)}), "input"),
            (json!({"input": "123456", "instructions": "12345"}), "input"),
            (
                json!({"input": vec![json!({"role": "user", "content": "a"}); 3]}),
                "input",
            ),
        ] {
            let e = read(&body, &config()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }
}
