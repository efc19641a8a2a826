//! Which request fields this server honours, refuses or ignores. Every
//! field OpenAI or vLLM defines on the generation endpoints is either read
//! by the `protocol` structs (honoured) or listed here: refused with a 400
//! unless sent at its neutral value, or accepted because it cannot change
//! the answer. Anything else is unknown to both and, as vLLM does, ignored
//! with a warning naming it.

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;
use super::protocol::{
    AnswerRequest, ChatCompletionRequest, CompletionRequest, RequestMessage, SamplingRequest,
};
use super::tools;

/// Which endpoint a body was sent to: each reads its own fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Whether a field's value asks for nothing, so that a field this server
/// does not implement may still be sent at it.
pub(super) type Neutral = fn(&Value) -> bool;

/// `null`, `false`, `""`, `[]` or `{}`: the field is not used.
pub(super) fn unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

/// `null` or 1, the neutral value of a count or factor.
fn unset_or_one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}

/// `null`, `[]` or `["text"]`: text output, what every answer is.
fn text_modalities(v: &Value) -> bool {
    unset(v) || v.as_array().is_some_and(|m| m.len() == 1 && m[0] == "text")
}

/// `null`, `"none"` or `"auto"`: no tool call is forced, and with `tools`
/// refused there is none the model could choose.
pub(super) fn no_forced_call(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("none" | "auto"))
}

/// Why each of vLLM's `guided_*` fields (removed in vLLM 0.12) is refused:
/// the `structured_outputs` key that replaced it.
const GUIDED_JSON: &str = "was removed in vLLM 0.12 and is not supported; send `structured_outputs: {\"json\": <schema>}` (or `response_format` of type json_schema)";
const GUIDED_REGEX: &str =
    "was removed in vLLM 0.12 and is not supported; send `structured_outputs: {\"regex\": <pattern>}`";
const GUIDED_CHOICE: &str =
    "was removed in vLLM 0.12 and is not supported; send `structured_outputs: {\"choice\": [...]}`";
const GUIDED_GRAMMAR: &str = "was removed in vLLM 0.12 and is not supported; send `structured_outputs: {\"grammar\": <Lark grammar>}`";
const GUIDED_BACKEND: &str = "was removed in vLLM 0.12 and is not supported; drop it: `structured_outputs` is served by the structured-output plugin";
const GUIDED_WHITESPACE: &str = "was removed in vLLM 0.12 and is not supported; send `structured_outputs: {..., \"whitespace_pattern\": <pattern>}`";
/// Why the tool-calling fields are refused on completions and /tokenize.
pub(super) const TOOLS_ELSEWHERE: &str =
    "tool calls are served on /v1/chat/completions and /v1/responses only (docs/structured-outputs.md)";
/// Why the deprecated function-calling fields are refused.
pub(super) const FUNCTIONS: &str =
    "the deprecated function-calling fields are not supported; send `tools` and `tool_choice`";

/// Fields OpenAI or vLLM define that this server does not implement: a
/// request that sets one to anything but its neutral value is refused,
/// never answered as if it had not asked. Both endpoints share the table;
/// a field only the other endpoint defines is refused the same way.
const UNSUPPORTED: &[(&str, Neutral, &str)] = &[
    ("guided_json", unset, GUIDED_JSON),
    ("guided_regex", unset, GUIDED_REGEX),
    ("guided_choice", unset, GUIDED_CHOICE),
    ("guided_grammar", unset, GUIDED_GRAMMAR),
    ("guided_decoding_backend", unset, GUIDED_BACKEND),
    ("guided_whitespace_pattern", unset, GUIDED_WHITESPACE),
    ("structural_tag", unset, "structural tags are not supported; send `structured_outputs` with json, regex, choice or grammar"),
    ("functions", unset, FUNCTIONS),
    ("function_call", no_forced_call, FUNCTIONS),
    ("suffix", unset, "suffixes (fill in the middle) are not supported"),
    ("prompt_embeds", unset, "prompt embeddings are not supported; send text or token ids"),
    ("best_of", unset_or_one, "best_of other than 1 is not supported; use n for more choices"),
    (
        "logits_processors",
        unset,
        "per-request logits processors are not supported; load a plugin (docs/plugins.md) and pass its arguments in extra_args",
    ),
    ("chat_template", unset, "per-request chat templates are not supported; the model's own template is used"),
    ("mm_processor_kwargs", unset, "multimodal processor arguments are not supported; this model takes text only"),
    ("audio", unset, "audio output is not supported; this model answers in text"),
    ("modalities", text_modalities, "modalities other than `text` are not supported"),
    ("web_search_options", unset, "web search is not supported"),
    ("reasoning_effort", unset, "is not supported: this model does not reason"),
    ("verbosity", unset, "is not supported; ask for the length you want in the prompt"),
    ("kv_transfer_params", unset, "KV transfer (disaggregated serving) is not supported"),
    ("store", unset, "stored completions are not supported"),
];

/// Fields vLLM defines on the completions endpoint that only the chat
/// endpoint implements here: refused unless neutral.
const UNSUPPORTED_IN_COMPLETIONS: &[Unsupported] = &[
    ("tools", unset, TOOLS_ELSEWHERE),
    ("tool_choice", no_forced_call, TOOLS_ELSEWHERE),
    (
        "prediction",
        unset,
        "predicted outputs are not supported on completions; /v1/chat/completions takes them",
    ),
    (
        "continue_final_message",
        unset,
        "applies to chat messages; /v1/chat/completions takes it (a completion prompt is open already)",
    ),
    (
        "chat_template_kwargs",
        unset,
        "applies to the chat template; /v1/chat/completions takes it (a completion prompt is not templated)",
    ),
    (
        "documents",
        unset,
        "are given to the chat template; /v1/chat/completions takes them (put them in a completion's prompt)",
    ),
];

/// Fields OpenAI or vLLM define that cannot change the answer here, so any
/// value is accepted: identifiers of the caller, a caching hint, a billing
/// tier, and the switch about reasoning, which this model does not do
/// (`parallel_tool_calls` is honoured on chat, meaningless elsewhere).
const HARMLESS: &[&str] = &[
    "user",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
    "parallel_tool_calls",
    "include_reasoning",
];

/// Message fields OpenAI or vLLM define that the chat template here is not
/// given; refused unless unset.
const UNSUPPORTED_IN_MESSAGE: &[(&str, &str)] = &[
    (
        "name",
        "participant names are not supported (the chat template is not given them); put the name in the content",
    ),
    ("function_call", FUNCTIONS),
    ("audio", "audio is not supported; this model takes text"),
    (
        "refusal",
        "refusals are not supported (the chat template is not given them); put the text in the content",
    ),
    (
        "reasoning_content",
        "reasoning content is not supported (the chat template is not given it); put it in the content",
    ),
];

/// At most this many ignored field names are logged, each cut to
/// [`IGNORED_NAME_CHARS`]: the log line must not grow with the body.
const IGNORED_LOGGED: usize = 16;
/// See [`IGNORED_LOGGED`].
pub(super) const IGNORED_NAME_CHARS: usize = 64;

/// Refuses fields this server does not implement unless they are at their
/// neutral value, then logs the fields neither OpenAI nor vLLM defines (and
/// that are therefore ignored), as vLLM does.
pub fn check_fields(body: &Value, endpoint: Endpoint) -> Result<(), ApiError> {
    for (field, neutral, why) in UNSUPPORTED {
        if body.get(*field).is_some_and(|v| !neutral(v)) {
            return Err(ApiError::field(field, why));
        }
    }
    // As in vLLM (and OpenAI): options of a stream that is not asked for
    // are a mistake to point out, not to ignore.
    let streamed = body.get("stream") == Some(&Value::Bool(true));
    if !streamed && body.get("stream_options").is_some_and(|v| !unset(v)) {
        return Err(ApiError::field(
            "stream_options",
            "applies to streamed answers only; set `stream: true` or leave it out",
        ));
    }
    if endpoint == Endpoint::Completions {
        for (field, neutral, why) in UNSUPPORTED_IN_COMPLETIONS {
            if body.get(*field).is_some_and(|v| !neutral(v)) {
                return Err(ApiError::field(field, why));
            }
        }
    }
    if endpoint == Endpoint::Chat {
        check_message_fields(body)?;
    }
    let (names, count) = ignored_fields(body, endpoint);
    warn_ignored(&names, count);
    Ok(())
}

/// The message fields of a chat body (`messages[i].name`, ...) this server
/// does not implement are refused unless unset.
pub(super) fn check_message_fields(body: &Value) -> Result<(), ApiError> {
    for (i, m) in objects_in(body, "messages").enumerate() {
        // A tool result's `name` is the function's (OpenAI's older form).
        let is_tool = m.get("role").and_then(Value::as_str) == Some("tool");
        for (field, why) in UNSUPPORTED_IN_MESSAGE {
            if *field == "name" && is_tool {
                continue;
            }
            if m.get(*field).is_some_and(|v| !unset(v)) {
                return Err(ApiError::field(&format!("messages[{i}].{field}"), why));
            }
        }
    }
    Ok(())
}

/// A field an endpoint does not implement: its name, its neutral values,
/// and why it is refused otherwise.
pub(super) type Unsupported = (&'static str, Neutral, &'static str);

/// The same rules for the endpoints beyond the two generation ones
/// (`/tokenize`, `/v1/responses`, ...): the `unsupported` fields are refused
/// unless neutral, `known` ones (honoured, or harmless) pass, and any other
/// is ignored and named in a warning in the log.
pub(super) fn check_endpoint_fields(
    body: &Value,
    known: &[&str],
    unsupported: &[Unsupported],
) -> Result<(), ApiError> {
    for (field, neutral, why) in unsupported {
        if body.get(*field).is_some_and(|v| !neutral(v)) {
            return Err(ApiError::field(field, why));
        }
    }
    let mut names = Vec::new();
    let mut count = 0;
    let unknown = body
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k.as_str())
        .filter(|k| !known.contains(k) && !unsupported.iter().any(|(f, ..)| f == k));
    for name in unknown {
        if names.len() < IGNORED_LOGGED {
            names.push(name.chars().take(IGNORED_NAME_CHARS).collect());
        }
        count += 1;
    }
    warn_ignored(&names, count);
    Ok(())
}

/// The log line naming the ignored fields (at most [`IGNORED_LOGGED`] of
/// `count`).
fn warn_ignored(names: &[String], count: usize) {
    if count == 0 {
        return;
    }
    let more = count - names.len();
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    tracing::warn!(
        "The following fields were present in the request but ignored: {}{more}",
        names.join(", ")
    );
}

/// The objects in the body's list `key` (`messages`, `tools`); entries of
/// another type are refused when the list is read.
fn objects_in<'a>(
    body: &'a Value,
    key: &str,
) -> impl Iterator<Item = &'a serde_json::Map<String, Value>> {
    body.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
}

/// The names of the fields neither OpenAI nor vLLM defines for `endpoint`
/// (message fields as `messages[i].name`, tool fields as `tools[i].name` and
/// `tools[i].function.name`), the first [`IGNORED_LOGGED`] of
/// them cut to [`IGNORED_NAME_CHARS`], and how many there are.
fn ignored_fields(body: &Value, endpoint: Endpoint) -> (Vec<String>, usize) {
    let own = match endpoint {
        Endpoint::Completions => field_names::<CompletionRequest>(),
        Endpoint::Chat => field_names::<ChatCompletionRequest>(),
    };
    let answer = field_names::<AnswerRequest>();
    let sampling = field_names::<SamplingRequest>();
    let known = |k: &str| {
        own.contains(&k)
            || answer.contains(&k)
            || sampling.contains(&k)
            || HARMLESS.contains(&k)
            || UNSUPPORTED.iter().any(|(f, ..)| *f == k)
            || (endpoint == Endpoint::Completions
                && UNSUPPORTED_IN_COMPLETIONS.iter().any(|(f, ..)| *f == k))
    };
    let top = body
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k.as_str())
        .filter(|k| !known(k))
        .map(|k| k.to_string());
    let message_fields = field_names::<RequestMessage>();
    let in_messages = objects_in(body, "messages").enumerate().flat_map(|(i, m)| {
        m.keys()
            .filter(|k| {
                !message_fields.contains(&k.as_str())
                    && !UNSUPPORTED_IN_MESSAGE.iter().any(|(f, _)| f == k)
            })
            .map(move |k| format!("messages[{i}].{k}"))
    });
    let in_tools = objects_in(body, "tools").enumerate().flat_map(|(i, t)| {
        let own = t
            .keys()
            .filter(|k| !tools::TOOL_FIELDS.contains(&k.as_str()))
            .map(move |k| format!("tools[{i}].{k}"));
        let function = t.get("function").and_then(Value::as_object).into_iter();
        let in_function = function.flat_map(move |f| {
            f.keys()
                .filter(|k| !tools::FUNCTION_FIELDS.contains(&k.as_str()))
                .map(move |k| format!("tools[{i}].function.{k}"))
        });
        own.chain(in_function)
    });
    let mut names = Vec::new();
    let mut count = 0;
    for name in top.chain(in_messages).chain(in_tools) {
        if names.len() < IGNORED_LOGGED {
            names.push(name.chars().take(IGNORED_NAME_CHARS).collect());
        }
        count += 1;
    }
    (names, count)
}

/// The JSON field names a derived `Deserialize` struct reads, as
/// `serde_derive` hands them to `deserialize_struct`: the structs in
/// `protocol` are the one list of the fields this server honours.
pub(super) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{Error, Visitor};
    struct Probe(&'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for &mut Probe {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(Error::custom("only structs are probed"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(Error::custom("probed"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut probe = Probe(&[]);
    // The probe always errs: it only records the names.
    let _ = T::deserialize(&mut probe);
    probe.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Every field of the table, at a value that asks for something and
    /// at its neutral value, on both endpoints.
    #[test]
    fn unsupported_fields_are_refused_unless_neutral() {
        let cases: &[(&str, Value, Value)] = &[
            ("guided_json", json!({"type": "object"}), json!(null)),
            ("guided_regex", json!("[a-z]+"), json!(null)),
            ("guided_choice", json!(["yes", "no"]), json!(null)),
            ("guided_grammar", json!("root ::= \"a\""), json!(null)),
            ("guided_decoding_backend", json!("xgrammar"), json!(null)),
            ("guided_whitespace_pattern", json!(" *"), json!(null)),
            ("structural_tag", json!("{}"), json!(null)),
            ("functions", json!([{"name": "f"}]), json!(null)),
            ("function_call", json!({"name": "f"}), json!("none")),
            ("suffix", json!("end"), json!("")),
            ("prompt_embeds", json!("AAAA"), json!(null)),
            ("best_of", json!(2), json!(1)),
            ("logits_processors", json!(["m.P"]), json!(null)),
            ("chat_template", json!("{{ x }}"), json!(null)),
            ("mm_processor_kwargs", json!({"k": 1}), json!(null)),
            ("audio", json!({"voice": "alloy"}), json!(null)),
            ("modalities", json!(["text", "audio"]), json!(["text"])),
            ("web_search_options", json!({"k": 1}), json!(null)),
            ("reasoning_effort", json!("high"), json!(null)),
            ("verbosity", json!("low"), json!(null)),
            ("kv_transfer_params", json!({"k": 1}), json!(null)),
            ("store", json!(true), json!(false)),
        ];
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            for (field, asks, neutral) in cases {
                let e = check_fields(&json!({ *field: asks }), endpoint).unwrap_err();
                assert_eq!(e.param.as_deref(), Some(*field), "{field}: {e:?}");
                assert!(e.message.contains("not supported"), "{field}: {e:?}");
                let body = json!({ *field: neutral });
                assert!(check_fields(&body, endpoint).is_ok(), "{body}");
            }
        }
        let mut body = json!({"stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
        assert!(check_fields(&body, Endpoint::Chat).is_ok());
        body["stream"] = json!(false);
        let e = check_fields(&body, Endpoint::Completions).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        body["stream_options"] = Value::Null;
        assert!(check_fields(&body, Endpoint::Completions).is_ok());
    }

    #[test]
    fn tools_are_chats_alone() {
        let tools = json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"});
        let e = check_fields(&tools, Endpoint::Completions).unwrap_err();
        assert!(e.message.contains("/v1/chat/completions"), "{e:?}");
        assert!(check_fields(&tools, Endpoint::Chat).is_ok());
        let body = json!({"tools": null, "tool_choice": "none"});
        assert!(check_fields(&body, Endpoint::Completions).is_ok());
        let body = json!({"messages": [{"role": "tool", "content": "1", "name": "f", "tool_call_id": "c"}]});
        assert!(check_fields(&body, Endpoint::Chat).is_ok());
    }

    #[test]
    fn predictions_and_template_fields_are_chats_alone() {
        for (field, value) in [
            ("prediction", json!({"type": "content", "content": "x = 1"})),
            ("continue_final_message", json!(true)),
            ("chat_template_kwargs", json!({"enable_thinking": false})),
        ] {
            let body = json!({ field: value });
            let e = check_fields(&body, Endpoint::Completions).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.contains("/v1/chat/completions"), "{e:?}");
            assert!(check_fields(&body, Endpoint::Chat).is_ok());
            assert_eq!(
                ignored_fields(&body, Endpoint::Chat).1,
                0,
                "{field}: honoured, not ignored"
            );
        }
        // Sent at its neutral value it asks for nothing, and is known, so
        // not logged as ignored either (nor are the tool fields).
        let neutral = json!({"prediction": null, "tools": null, "tool_choice": "none",
            "continue_final_message": false, "chat_template_kwargs": {}});
        assert!(check_fields(&neutral, Endpoint::Completions).is_ok());
        assert_eq!(ignored_fields(&neutral, Endpoint::Completions).1, 0);
    }

    #[test]
    fn removed_guided_fields_name_their_structured_outputs_key() {
        for (field, key) in [
            ("guided_json", "{\"json\": <schema>}"),
            ("guided_regex", "{\"regex\": <pattern>}"),
            ("guided_choice", "{\"choice\": [...]}"),
            ("guided_grammar", "{\"grammar\": <Lark grammar>}"),
            (
                "guided_whitespace_pattern",
                "\"whitespace_pattern\": <pattern>",
            ),
            ("guided_decoding_backend", "drop it"),
        ] {
            let e = check_fields(&json!({ field: "x" }), Endpoint::Chat).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.contains("structured_outputs"), "{e:?}");
            assert!(e.message.contains(key), "{field}: {e:?}");
        }
        // The fields that replace them are honoured, not refused nor ignored.
        let body = json!({"response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}});
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            assert!(check_fields(&body, endpoint).is_ok());
            assert_eq!(ignored_fields(&body, endpoint).1, 0, "{endpoint:?}");
        }
    }

    #[test]
    fn unsupported_message_fields_are_refused_unless_neutral() {
        for field in [
            "name",
            "function_call",
            "audio",
            "refusal",
            "reasoning_content",
        ] {
            let body = json!({"messages": [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", field: "x"}]});
            let e = check_fields(&body, Endpoint::Chat).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                Some(format!("messages[1].{field}").as_str())
            );
            assert!(e.message.contains("not supported"), "{e:?}");
            let body = json!({"messages": [{"role": "user", "content": "a", field: null}]});
            assert!(check_fields(&body, Endpoint::Chat).is_ok(), "{body}");
        }
    }

    #[test]
    fn unknown_tool_fields_are_named_as_ignored() {
        let tool = |extra: Value, function: Value| {
            let mut t = json!({"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}, "strict": true}});
            for (k, v) in extra.as_object().unwrap() {
                t[k] = v.clone();
            }
            for (k, v) in function.as_object().unwrap() {
                t["function"][k] = v.clone();
            }
            t
        };
        let body = json!({"messages": [], "tools": [tool(json!({}), json!({}))]});
        assert_eq!(ignored_fields(&body, Endpoint::Chat), (vec![], 0));
        let body = json!({"messages": [], "tools": [
            tool(json!({}), json!({})),
            tool(json!({"banana": 1}), json!({"examples": []})),
        ]});
        assert_eq!(
            ignored_fields(&body, Endpoint::Chat),
            (
                vec![
                    "tools[1].banana".to_string(),
                    "tools[1].function.examples".to_string()
                ],
                2
            )
        );
    }

    #[test]
    fn echo_is_known_to_both_and_prompt_logprobs_a_sampling_one() {
        let body = json!({"prompt": "p", "echo": true, "prompt_logprobs": 2});
        assert!(check_fields(&body, Endpoint::Completions).is_ok());
        assert_eq!(ignored_fields(&body, Endpoint::Completions), (vec![], 0));
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "echo": true});
        assert!(check_fields(&chat, Endpoint::Chat).is_ok());
        assert_eq!(ignored_fields(&chat, Endpoint::Chat), (vec![], 0));
        let chat = json!({"messages": [], "echo": false, "prompt_logprobs": 0});
        assert!(check_fields(&chat, Endpoint::Chat).is_ok());
        assert_eq!(ignored_fields(&chat, Endpoint::Chat), (vec![], 0));
    }

    #[test]
    fn honoured_and_harmless_fields_are_not_reported_as_ignored() {
        let completion = json!({
            "model": "m", "prompt": "p", "stream": false, "stream_options": null, "logprobs": 1,
            "add_special_tokens": true, "n": 1, "temperature": 1, "top_p": 1, "top_k": 1, "min_p": 0,
            "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "seed": 1,
            "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0, "stop": [],
            "stop_token_ids": [], "ignore_eos": false, "include_stop_str_in_output": false,
            "skip_special_tokens": true, "extra_args": {}, "vllm_xargs": {}, "priority": 0, "cache_salt": "s", "truncate_prompt_tokens": 9,
            "user": "u", "metadata": {}, "safety_identifier": "s", "prompt_cache_key": "k",
            "service_tier": "auto", "parallel_tool_calls": false, "include_reasoning": true,
            "echo": false, "return_token_ids": false, "return_tokens_as_token_ids": true,
            "request_id": "r", "spaces_between_special_tokens": false,
        });
        assert!(check_fields(&completion, Endpoint::Completions).is_ok());
        assert_eq!(
            ignored_fields(&completion, Endpoint::Completions),
            (vec![], 0)
        );
        let chat = json!({
            "messages": [{"role": "user", "content": "hi", "name": null}], "logprobs": true,
            "top_logprobs": 1, "add_generation_prompt": true, "add_special_tokens": false,
            "max_completion_tokens": 3, "tool_choice": "none", "request_id": "r",
            "documents": [{"title": "t", "text": "d"}],
        });
        assert_eq!(ignored_fields(&chat, Endpoint::Chat), (vec![], 0));
    }

    #[test]
    fn unknown_fields_are_accepted_and_named_for_the_log() {
        let body = json!({"prompt": "p", "frobnicate": 1, "add_generation_prompt": true});
        assert!(check_fields(&body, Endpoint::Completions).is_ok());
        // add_generation_prompt is the chat endpoint's field, not this one's.
        // Named in the order the request gave them.
        assert_eq!(
            ignored_fields(&body, Endpoint::Completions),
            (
                vec![
                    "frobnicate".to_string(),
                    "add_generation_prompt".to_string()
                ],
                2
            )
        );
        let body =
            json!({"messages": [{"role": "user", "content": "hi", "mood": "sunny"}], "x": 1});
        assert!(check_fields(&body, Endpoint::Chat).is_ok());
        assert_eq!(
            ignored_fields(&body, Endpoint::Chat),
            (vec!["x".to_string(), "messages[0].mood".to_string()], 2)
        );
        // The log line stays bounded however many there are.
        let mut many = serde_json::Map::new();
        for i in 0..100 {
            many.insert(format!("{i:0>100}"), json!(1));
        }
        let (names, count) = ignored_fields(&Value::Object(many), Endpoint::Completions);
        assert_eq!((names.len(), count), (IGNORED_LOGGED, 100));
        assert!(names.iter().all(|n| n.len() == IGNORED_NAME_CHARS));
    }

    #[test]
    fn token_filter_fields_are_honoured() {
        let body = json!({"logit_bias": {"5": 1}, "allowed_token_ids": [1], "bad_words": ["x"]});
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            assert!(check_fields(&body, endpoint).is_ok());
            assert_eq!(ignored_fields(&body, endpoint).1, 0, "{endpoint:?}");
        }
    }

    #[test]
    fn the_field_names_come_from_the_structs() {
        let names = field_names::<SamplingRequest>();
        assert!(
            names.contains(&"max_tokens") && names.contains(&"vllm_xargs"),
            "{names:?}"
        );
        assert_eq!(
            field_names::<RequestMessage>(),
            &["role", "content", "tool_calls", "tool_call_id", "name"]
        );
        let answer = field_names::<AnswerRequest>();
        assert!(answer.contains(&"stream") && answer.contains(&"request_id"));
        // Each field is read by one of an endpoint's three structs: a name
        // in two would be two readings that could disagree.
        for own in [
            field_names::<CompletionRequest>(),
            field_names::<ChatCompletionRequest>(),
        ] {
            let shared: Vec<_> = own
                .iter()
                .filter(|f| answer.contains(f) || names.contains(f))
                .collect();
            assert!(shared.is_empty(), "{shared:?}");
        }
        assert!(answer.iter().all(|f| !names.contains(f)), "{answer:?}");
    }
}
