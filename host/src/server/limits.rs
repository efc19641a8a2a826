//! Bounds on every size a client controls, each a `[server]` key
//! (`docs/config.md`). They are checked on the parsed JSON body, before any
//! field is copied into typed form, tokenized or fanned out into engine
//! requests: `"n": 4294967295` must be a 400, not an allocation of
//! `prompts × n` sequences. A refusal names the field, the value, the limit
//! and the key that sets it.
//!
//! Values of the wrong type pass through untouched: the typed reading that
//! follows refuses them with its own message.

use serde_json::Value;

use super::error::ApiError;
use crate::config::ServerConfig;
use crate::sampling::{MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, MAX_TOKEN_ID_LIST};
use crate::tokenizer::ChatMessage;

/// Most `bad_words` in one request: each may become two banned sequences
/// (with and without a leading space), which makes the sampler's limit.
pub const MAX_BAD_WORDS: usize = MAX_BAD_WORD_SEQUENCES / 2;

/// Most bytes of `bad_words` text in one request, checked before it is
/// tokenized. A byte-level tokenizer makes at most one token per byte, and
/// each word is tokenized twice, once after an added space, so words within
/// this budget always fit the sampler's token limit.
pub const MAX_BAD_WORDS_BYTES: usize = (MAX_BAD_WORD_TOKENS - MAX_BAD_WORDS) / 2;

// Words within both bounds fit the sampler's token budget even at a token
// per byte, tokenized with and without a space.
const _: () = assert!(2 * MAX_BAD_WORDS_BYTES + MAX_BAD_WORDS <= MAX_BAD_WORD_TOKENS);

/// Most bytes of a `cache_salt`: a salt is a secret of a tenant (a key's
/// worth of random text), and each engine request keeps a copy.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// Most bytes of a client's request id (vLLM's `request_id` field or
/// `X-Request-Id` header): every chunk of the answer repeats it.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// 400 unless a client's request id, from `field`, fits
/// [`MAX_REQUEST_ID_BYTES`].
pub fn request_id(field: &str, id: &str) -> Result<(), ApiError> {
    let why = "a request id names a request, it does not carry data; a UUID takes 36 bytes";
    at_most_fixed(field, len(id.len()), "bytes", MAX_REQUEST_ID_BYTES, why)
}

/// 400 unless `value <= limit`, naming the field, both numbers and the
/// `[server]` key that sets the limit.
pub fn at_most(
    field: &str,
    value: u64,
    unit: &str,
    limit: usize,
    key: &str,
) -> Result<(), ApiError> {
    if value <= limit as u64 {
        return Ok(());
    }
    Err(ApiError::field(
        field,
        format!("{value} {unit}, but this server allows at most {limit} (its `server.{key}`)"),
    ))
}

/// 400 unless `value <= limit` for a bound that is not a setting; `why`
/// says where it comes from.
fn at_most_fixed(
    field: &str,
    value: u64,
    unit: &str,
    limit: usize,
    why: &str,
) -> Result<(), ApiError> {
    if value <= limit as u64 {
        return Ok(());
    }
    Err(ApiError::field(
        field,
        format!("{value} {unit}, but at most {limit} are allowed ({why})"),
    ))
}

/// Deepest nesting of lists and objects in `extra_args` (itself counted)
/// that the plugins read: they parse it with serde_json, which stops at
/// this depth. A body is parsed under the same limit, but a constraint the
/// server wraps goes deeper where it lands (a tool's parameters sit six
/// levels below where the client wrote them), so the final `extra_args`
/// is held to it.
pub const MAX_EXTRA_ARGS_NESTING: usize = 127;

/// 400 naming `field` (where the constraint came from) unless the final
/// `extra_args` nests at most [`MAX_EXTRA_ARGS_NESTING`] levels deep.
pub fn check_nesting(field: &str, extra_args: &Value) -> Result<(), ApiError> {
    let why = "the plugins read extra_args, where the constraint travels, at most that deep; \
               flatten the schema";
    let unit = "levels of nesting in extra_args as the plugins receive it";
    at_most_fixed(
        field,
        len(nesting(extra_args)),
        unit,
        MAX_EXTRA_ARGS_NESTING,
        why,
    )
}

/// Lists and objects nested in `value`, itself counted (0 for a scalar).
/// Recursive: a value here comes from a body parsed under serde_json's
/// nesting limit, plus the few levels the server wraps around it.
fn nesting(value: &Value) -> usize {
    let inner = match value {
        Value::Array(items) => items.iter().map(nesting).max(),
        Value::Object(map) => map.values().map(nesting).max(),
        _ => return 0,
    };
    1 + inner.unwrap_or(0)
}

/// A JSON schema nesting `levels` objects (arrays of arrays of ...
/// integers), for the tests of [`check_nesting`]'s callers.
#[cfg(test)]
pub(super) fn nested_schema(levels: usize) -> Value {
    (1..levels).fold(
        serde_json::json!({"type": "integer"}),
        |inner, _| serde_json::json!({"type": "array", "items": inner}),
    )
}

/// `usize` lengths as the `u64` values [`at_most`] compares.
fn len(n: usize) -> u64 {
    n as u64
}

/// The bounds of `/v1/completions`: the number of prompts, their text's
/// bytes, each token-id prompt's length, then the sampling fields'.
pub fn check_completion(
    body: &Value,
    config: &ServerConfig,
    max_model_len: usize,
) -> Result<(), ApiError> {
    // A prompt cut to its last tokens may be longer than the context: its
    // ids are held to the body's size alone.
    let max_model_len = match body.get("truncate_prompt_tokens") {
        Some(v) if !v.is_null() => usize::MAX,
        _ => max_model_len,
    };
    match body.get("prompt") {
        Some(Value::String(s)) => prompt_bytes("prompt", len(s.len()), config)?,
        // A flat list of numbers is one prompt of token ids.
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
            prompt_tokens("prompt", items.len(), max_model_len)?
        }
        // Otherwise a batch: of strings or of token-id lists.
        Some(Value::Array(items)) => {
            let count = len(items.len());
            at_most(
                "prompt",
                count,
                "prompts",
                config.max_prompts,
                "max_prompts",
            )?;
            let bytes = items
                .iter()
                .filter_map(Value::as_str)
                .map(|s| len(s.len()))
                .sum();
            prompt_bytes("prompt", bytes, config)?;
            for (i, ids) in items.iter().enumerate() {
                if let Some(ids) = ids.as_array() {
                    prompt_tokens(&format!("prompt[{i}]"), ids.len(), max_model_len)?;
                }
            }
        }
        _ => {}
    }
    check_sampling(body, config)
}

/// The bounds of `/v1/chat/completions`: the number of messages and of
/// content parts (both bounded by `server.max_messages`: a part costs what
/// a message does), the text's bytes, then the sampling fields'.
pub fn check_chat(body: &Value, config: &ServerConfig) -> Result<(), ApiError> {
    check_messages(body, config)?;
    check_sampling(body, config)
}

/// The bounds of a body's chat `messages` alone (chat completions and
/// `/tokenize`): their number, their content parts', their text's bytes.
pub fn check_messages(body: &Value, config: &ServerConfig) -> Result<(), ApiError> {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let limit = config.max_messages;
        at_most(
            "messages",
            len(messages.len()),
            "messages",
            limit,
            "max_messages",
        )?;
        let (mut parts, mut bytes) = (0u64, 0u64);
        for (i, m) in messages.iter().enumerate() {
            match m.get("content") {
                Some(Value::String(s)) => bytes += len(s.len()),
                Some(Value::Array(list)) => {
                    parts += len(list.len());
                    let field = format!("messages[{i}].content");
                    at_most(
                        &field,
                        parts,
                        "content parts in all messages together",
                        limit,
                        "max_messages",
                    )?;
                    bytes += list
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(|s| len(s.len()))
                        .sum::<u64>();
                }
                _ => {}
            }
        }
        prompt_bytes("messages", bytes, config)?;
    }
    // A template may write its variables into the prompt.
    for field in ["chat_template_kwargs", "documents"] {
        if let Some(value) = body.get(field) {
            at_most(
                field,
                json_len(value),
                "bytes as compact JSON",
                config.max_prompt_bytes,
                "max_prompt_bytes",
            )?;
        }
    }
    Ok(())
}

/// Prompt text is bounded in bytes (`server.max_prompt_bytes`) before it
/// is tokenized.
pub fn prompt_bytes(field: &str, bytes: u64, config: &ServerConfig) -> Result<(), ApiError> {
    at_most(
        field,
        bytes,
        "bytes of prompt text",
        config.max_prompt_bytes,
        "max_prompt_bytes",
    )
}

/// The chat prompt's text once the tools are described in it (a system
/// message the client's bytes do not count), held to
/// `server.max_prompt_bytes` as the messages alone were, before it is
/// rendered and tokenized.
pub fn described_tools(messages: &[ChatMessage], config: &ServerConfig) -> Result<(), ApiError> {
    let bytes = messages.iter().map(|m| len(m.content.len())).sum();
    prompt_bytes("tools", bytes, config)
}

/// A prompt given as token ids is refused at the context's length before it
/// is copied: a longer one could never run.
fn prompt_tokens(field: &str, tokens: usize, max_model_len: usize) -> Result<(), ApiError> {
    if tokens < max_model_len {
        return Ok(());
    }
    Err(prompt_too_long(field, tokens, max_model_len))
}

/// The bounds of the sampling fields both endpoints share: `n`, `stop`,
/// `stop_token_ids`, `logit_bias`, `allowed_token_ids`, `bad_words` and what
/// travels to plugins in `extra_args`: `extra_args`, `vllm_xargs`,
/// `response_format` and `structured_outputs`.
pub fn check_sampling(body: &Value, config: &ServerConfig) -> Result<(), ApiError> {
    if let Some(n) = body.get("n").and_then(Value::as_u64) {
        at_most("n", n, "choices", config.max_n as usize, "max_n")?;
    }
    let stop_bytes = |field: &str, s: &str| {
        let key = "max_stop_string_bytes";
        at_most(
            field,
            len(s.len()),
            "bytes in one stop string",
            config.max_stop_string_bytes,
            key,
        )
    };
    match body.get("stop") {
        Some(Value::String(s)) => stop_bytes("stop", s)?,
        Some(Value::Array(list)) => {
            at_most(
                "stop",
                len(list.len()),
                "stop strings",
                config.max_stop_strings,
                "max_stop_strings",
            )?;
            for (i, s) in list.iter().enumerate() {
                if let Some(s) = s.as_str() {
                    stop_bytes(&format!("stop[{i}]"), s)?;
                }
            }
        }
        _ => {}
    }
    if let Some(ids) = body.get("stop_token_ids").and_then(Value::as_array) {
        let key = "max_stop_token_ids";
        at_most(
            "stop_token_ids",
            len(ids.len()),
            "stop token ids",
            config.max_stop_token_ids,
            key,
        )?;
    }
    if let Some(salt) = body.get("cache_salt").and_then(Value::as_str) {
        if salt.is_empty() {
            return Err(ApiError::field(
                "cache_salt",
                "must be a non-empty string; leave it out to share the prefix cache with unsalted requests",
            ));
        }
        let why = "a salt is a secret, not a text; a random 32 bytes is plenty";
        at_most_fixed(
            "cache_salt",
            len(salt.len()),
            "bytes",
            MAX_CACHE_SALT_BYTES,
            why,
        )?;
    }
    if let Some(bias) = body.get("logit_bias").and_then(Value::as_object) {
        at_most(
            "logit_bias",
            len(bias.len()),
            "entries",
            config.max_logit_bias,
            "max_logit_bias",
        )?;
    }
    if let Some(ids) = body.get("allowed_token_ids").and_then(Value::as_array) {
        let why = "every vocabulary in use is smaller, so a longer list only repeats ids";
        at_most_fixed(
            "allowed_token_ids",
            len(ids.len()),
            "token ids",
            MAX_TOKEN_ID_LIST,
            why,
        )?;
    }
    if let Some(words) = body.get("bad_words").and_then(Value::as_array) {
        let why = "each word may become two banned token sequences, and the sampler matches every \
                   one at each step";
        at_most_fixed("bad_words", len(words.len()), "words", MAX_BAD_WORDS, why)?;
        let bytes = words
            .iter()
            .filter_map(Value::as_str)
            .map(|w| len(w.len()))
            .sum();
        let why = "the words are tokenized twice, and their tokens are matched at each step";
        let unit = "bytes in all words together";
        at_most_fixed("bad_words", bytes, unit, MAX_BAD_WORDS_BYTES, why)?;
    }
    // The two are merged into one `extra_args`, and the structured-output
    // constraint (a schema, regex, choice list or grammar) travels in it
    // too: they share the bound.
    let mut extra = 0;
    for field in [
        "extra_args",
        "vllm_xargs",
        "response_format",
        "structured_outputs",
    ] {
        if let Some(v) = body.get(field) {
            extra += json_len(v);
            let unit = "bytes of extra_args, vllm_xargs, response_format and structured_outputs \
                together, as compact JSON";
            at_most(
                field,
                extra,
                unit,
                config.max_extra_args_bytes,
                "max_extra_args_bytes",
            )?;
        }
    }
    Ok(())
}

/// Bytes of `value` as compact JSON, counted without building the text.
pub fn json_len(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += len(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Neither a `Value` nor a counter can fail to serialize.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// The tokenized prompt must hold a token, leave room in the context for
/// at least one generated token, and with `max_tokens` (read from
/// `max_tokens_field`) fit in it. The scheduler checks the same; here the
/// error names the request field to change.
pub fn check_context(
    prompt_field: &str,
    prompt_len: usize,
    (max_tokens_field, max_tokens): (&str, u32),
    max_model_len: usize,
) -> Result<(), ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::field(
            prompt_field,
            "has no tokens (once tokenized); give at least one",
        ));
    }
    if prompt_len >= max_model_len {
        return Err(prompt_too_long(prompt_field, prompt_len, max_model_len));
    }
    let total = len(prompt_len) + u64::from(max_tokens);
    if total > len(max_model_len) {
        return Err(ApiError::field(
            max_tokens_field,
            format!(
                "{max_tokens} tokens after a prompt of {prompt_len} make {total}, more than the \
                 model's context (max_model_len) of {max_model_len} tokens; set it to at most {}",
                max_model_len - prompt_len
            ),
        ));
    }
    Ok(())
}

fn prompt_too_long(field: &str, tokens: usize, max_model_len: usize) -> ApiError {
    ApiError::field(
        field,
        format!(
            "{tokens} tokens, but the model's context (max_model_len) is {max_model_len} tokens \
             and must also hold at least one generated token; shorten the prompt below {max_model_len} tokens"
        ),
    )
}

#[cfg(test)]
mod tests;
