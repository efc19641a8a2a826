//! `prediction` on chat completions (OpenAI's predicted outputs): text the
//! client expects most of the answer to repeat, such as a file it asks to
//! have edited. The engine verifies it as speculative draft tokens (see
//! `scheduler/prediction.rs`), so the answer is the model's own either way
//! and arrives sooner where it follows the prediction; `usage` says how
//! many predicted tokens were kept and how many were not.

use std::borrow::Cow;

use serde_json::Value;

use super::error::ApiError;
use super::limits;
use crate::config::ServerConfig;
use crate::tokenizer::Tokenizer;

/// The prediction's tokens: none for `null` or empty content. Its text is
/// bounded like a prompt's (`server.max_prompt_bytes`, and
/// `server.max_messages` content parts) before it is tokenized.
pub fn tokens(
    value: Option<&Value>,
    tokenizer: &Tokenizer,
    config: &ServerConfig,
) -> Result<Vec<u32>, ApiError> {
    let Some(object) = value.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Some(object) = object.as_object() else {
        return Err(ApiError::field(
            "prediction",
            "must be an object: {\"type\": \"content\", \"content\": <the text the answer is expected to repeat>}",
        ));
    };
    if let Some(key) = object
        .keys()
        .find(|k| !matches!(k.as_str(), "type" | "content"))
    {
        return Err(ApiError::field(
            &format!("prediction.{key}"),
            "is not a field of a prediction; send only `type` and `content`",
        ));
    }
    if object.get("type").and_then(Value::as_str) != Some("content") {
        return Err(ApiError::field(
            "prediction.type",
            "must be \"content\", the one kind of prediction",
        ));
    }
    let text = content_text(object.get("content"), config)?;
    limits::prompt_bytes("prediction.content", text.len() as u64, config)?;
    tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::field("prediction.content", e))
}

/// The content as one text: a string, or the concatenated `text` of a
/// list of `{"type": "text", "text": ...}` parts.
fn content_text<'a>(
    content: Option<&'a Value>,
    config: &ServerConfig,
) -> Result<Cow<'a, str>, ApiError> {
    const SHAPE: &str =
        "must be a string or a list of {\"type\": \"text\", \"text\": <string>} parts";
    match content {
        Some(Value::String(s)) => Ok(Cow::Borrowed(s)),
        Some(Value::Array(parts)) => {
            limits::at_most(
                "prediction.content",
                parts.len() as u64,
                "content parts",
                config.max_messages,
                "max_messages",
            )?;
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                let field = format!("prediction.content[{i}]");
                if part.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(ApiError::field(&field, SHAPE));
                }
                let Some(t) = part.get("text").and_then(Value::as_str) else {
                    return Err(ApiError::field(&field, SHAPE));
                };
                limits::prompt_bytes("prediction.content", (text.len() + t.len()) as u64, config)?;
                text.push_str(t);
            }
            Ok(Cow::Owned(text))
        }
        _ => Err(ApiError::field("prediction.content", SHAPE)),
    }
}
