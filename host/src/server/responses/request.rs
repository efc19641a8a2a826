//! Reading a `POST /v1/responses` body: which fields are honoured,
//! refused or harmless, and every size bounded before anything is copied
//! (`input.rs` reads `input` itself).

use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::error::ApiError;
use super::super::fields::{self, unset, Unsupported};
use super::super::limits;
use super::super::protocol::SamplingRequest;
use crate::config::ServerConfig;
use crate::sampling::MAX_LOGPROBS;

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
    /// Extra output: only `message.output_text.logprobs` exists here.
    #[serde(default)]
    pub include: Option<Vec<String>>,
    /// Alternatives given beside each generated token's logprob (0 to 20).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// `disabled` (the default: a conversation longer than the context is
    /// refused) or `auto` (its oldest items are left out of the prompt
    /// until it fits).
    #[serde(default)]
    pub truncation: Option<Truncation>,
}

/// OpenAI's `truncation` of a response's conversation.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    /// A conversation longer than the context is a 400.
    #[default]
    Disabled,
    /// The oldest items are left out of the prompt until it fits.
    Auto,
}

impl Truncation {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Truncation::Disabled => "disabled",
            Truncation::Auto => "auto",
        }
    }
}

/// The one `include` value: logprobs on the output text.
pub const LOGPROBS_INCLUDE: &str = "message.output_text.logprobs";

impl ResponsesRequest {
    /// The alternatives per token when logprobs are asked for (by
    /// `include` or a positive `top_logprobs`), as `sampling_params` takes
    /// them.
    pub fn logprobs(&self) -> Option<u32> {
        let included = self.include.iter().flatten().any(|i| i == LOGPROBS_INCLUDE);
        let k = self.top_logprobs.unwrap_or(0);
        (included || k > 0).then_some(k)
    }
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

/// `null` or 1.
fn unset_or_one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}

/// Fields OpenAI (or vLLM) define for this endpoint that are not
/// implemented: refused unless neutral.
const UNSUPPORTED: &[Unsupported] = &[
    ("text", format_only, "only `text.format` is supported (not `verbosity`: ask for the length you want in the instructions)"),
    ("reasoning", no_reasoning, "reasoning options are not supported: this model does not reason"),
    ("conversation", unset, "conversations are not supported; chain responses with previous_response_id"),
    ("prompt", unset, "prompt templates are not supported; send input and instructions"),
    ("n", unset_or_one, "one answer per response; send several requests for more"),
    ("max_tokens", unset, "is the chat API's name; use max_output_tokens"),
    ("max_completion_tokens", unset, "is the chat API's name; use max_output_tokens"),
    ("logprobs", unset, "is the chat API's name; ask with `include: [\"message.output_text.logprobs\"]` and `top_logprobs`"),
    ("prompt_logprobs", unset, "prompt logprobs are not supported on /v1/responses; /v1/completions returns them"),
    ("use_beam_search", unset, "beam search is not supported on /v1/responses; /v1/chat/completions and /v1/completions take it"),
    ("length_penalty", unset, "applies to beam search, which /v1/responses does not take"),
    ("request_id", unset, "client-chosen ids are not supported on /v1/responses, where the id names the stored response; /v1/chat/completions and /v1/completions take it"),
    ("truncate_prompt_tokens", unset, "is the completions APIs' name; /v1/responses takes `truncation: \"auto\"`, which leaves the oldest items out"),
];

/// The tool fields, read by `tools::ToolRequest::from_body`.
const TOOL_FIELDS: &[&str] = &["tools", "tool_choice", "parallel_tool_calls"];

/// Fields that cannot change the answer here (`max_tool_calls` bounds calls
/// of OpenAI's built-in tools, of which there are none here).
const HARMLESS: &[&str] = &[
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
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
        .chain(TOOL_FIELDS)
        .chain(HARMLESS)
        .copied()
        .collect();
    fields::check_endpoint_fields(body, &known, UNSUPPORTED)?;
    let req: ResponsesRequest = super::super::params::typed(body)?;
    let sampling: SamplingRequest = super::super::params::typed(body)?;
    if let Some(metadata) = &req.metadata {
        check_metadata(metadata)?;
    }
    for (i, item) in req.include.iter().flatten().enumerate() {
        if item != LOGPROBS_INCLUDE {
            let item: String = item.chars().take(fields::IGNORED_NAME_CHARS).collect();
            return Err(ApiError::field(
                &format!("include[{i}]"),
                format!("is `{item}`; only `{LOGPROBS_INCLUDE}` can be included here (there are no reasoning, tool or file search outputs)"),
            ));
        }
    }
    if let Some(k) = req.top_logprobs.filter(|&k| k > MAX_LOGPROBS) {
        return Err(ApiError::field(
            "top_logprobs",
            format!("must be in [0, {MAX_LOGPROBS}], got {k}"),
        ));
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
            let key_name = "max_messages";
            limits::at_most("input", items.len() as u64, "items", limit, key_name)?;
            let mut parts = 0u64;
            for (i, item) in items.iter().enumerate() {
                // A message's `content`, a call's `arguments`, a call
                // output's `output`: each a string or a list of text parts.
                for key in ["content", "arguments", "output"] {
                    match item.get(key) {
                        Some(Value::String(s)) => bytes += s.len() as u64,
                        Some(Value::Array(list)) => {
                            parts += list.len() as u64;
                            let field = format!("input[{i}].{key}");
                            let unit = "content parts in all items together";
                            limits::at_most(&field, parts, unit, limit, key_name)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
                json!({"input": "x", "conversation": "conv_1"}),
                "conversation",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "x".repeat(11)}]}),
                "input",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                    "arguments": format!("{{\"a\": \"{}\"}}", "x".repeat(5))}]}),
                "input",
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
            (json!({"input": "x", "truncation": "middle"}), "truncation"),
            (
                json!({"input": "x", "include": [LOGPROBS_INCLUDE, "reasoning.encrypted_content"]}),
                "include[1]",
            ),
            (json!({"input": "x", "include": [3]}), "include[0]"),
            (json!({"input": "x", "top_logprobs": 21}), "top_logprobs"),
            (json!({"input": "x", "logprobs": true}), "logprobs"),
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
