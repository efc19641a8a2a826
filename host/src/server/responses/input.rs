//! A `/v1/responses` request's `input` as chat messages: message items,
//! `function_call` items (written as the model writes calls) and
//! `function_call_output` items (the user turns that give their results),
//! as `/v1/chat/completions` renders the same conversation.

use serde_json::Value;

use super::super::error::ApiError;
use super::super::fields;
use super::super::tools::{self, ToolCall};
use crate::tokenizer::ChatMessage;

/// `input` as chat messages: a string is one user message; a list holds
/// message items (`{"role", "content"}`, `type` absent or `message`)
/// whose content is a string or `input_text` / `output_text` parts,
/// `function_call` items (a run of them is one assistant turn, written as
/// the model writes calls) and `function_call_output` items (a user turn
/// naming the function, found by `call_id` among the input's calls and
/// `earlier`, the calls of the response it continues).
pub fn input_messages(input: &Value, earlier: &[ToolCall]) -> Result<Vec<ChatMessage>, ApiError> {
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
    let mut messages = Vec::with_capacity(items.len());
    // Calls so far, by `call_id`, for the outputs that answer them.
    let mut called: Vec<(&str, &str)> = earlier
        .iter()
        .map(|c| (c.id.as_str(), c.name.as_str()))
        .collect();
    // The run of function calls being read, one assistant turn.
    let mut run: Vec<(&str, Value)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let kind = item.get("type").and_then(Value::as_str);
        if kind == Some("function_call") {
            let (call_id, name, args) = function_call(i, item)?;
            called.push((call_id, name));
            run.push((name, args));
            continue;
        }
        if !run.is_empty() {
            let text = tools::calls_text(std::mem::take(&mut run));
            messages.push(ChatMessage::new("assistant", text));
        }
        messages.push(match kind {
            Some("function_call_output") => function_output(i, item, &called)?,
            _ => message(i, item)?,
        });
    }
    if !run.is_empty() {
        messages.push(ChatMessage::new("assistant", tools::calls_text(run)));
    }
    Ok(messages)
}

/// A string field of item `i`, required.
fn string<'a>(i: usize, item: &'a Value, key: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::field(&format!("input[{i}].{key}"), "must be a string"))
}

/// A `function_call` item: its `call_id`, `name` and arguments object.
fn function_call(i: usize, item: &Value) -> Result<(&str, &str, Value), ApiError> {
    let call_id = string(i, item, "call_id")?;
    let name = string(i, item, "name")?;
    let args = tools::arguments(item.get("arguments")).map_err(|why| {
        ApiError::field(
            &format!("input[{i}].arguments"),
            format!("`arguments` {why}"),
        )
    })?;
    Ok((call_id, name, args))
}

/// A `function_call_output` item as the user turn that gives the result.
fn function_output(
    i: usize,
    item: &Value,
    called: &[(&str, &str)],
) -> Result<ChatMessage, ApiError> {
    let call_id = string(i, item, "call_id")?;
    let output = match item.get("output") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(&format!("input[{i}].output"), parts)?,
        _ => {
            return Err(ApiError::field(
                &format!("input[{i}].output"),
                "must be a string or a list of input_text parts",
            ))
        }
    };
    let name = called
        .iter()
        .rev()
        .find(|(id, _)| *id == call_id)
        .map(|&(_, name)| name);
    let text = tools::render_result(name, Some(call_id), &output);
    Ok(ChatMessage::new("user", text))
}

/// Text content parts (`input_text`, `output_text`, `text`) joined.
fn text_parts(field: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        match (kind, part.get("text").and_then(Value::as_str)) {
            (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
            (Some("input_text" | "output_text" | "text"), None) => {
                return Err(ApiError::field(
                    &format!("{field}[{j}].text"),
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
                    &format!("{field}[{j}].type"),
                    format!("is `{other}`; this model takes `input_text` parts only"),
                ));
            }
        }
    }
    Ok(text)
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
                format!("is `{other}`; the items accepted are message, function_call and function_call_output"),
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
        Some(Value::Array(parts)) => text_parts(&field("content"), parts)?,
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
            input_messages(&json!("hi"), &[]).unwrap(),
            vec![ChatMessage::new("user", "hi")]
        );
        let items = json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "you"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi", "annotations": []}]},
        ]);
        assert_eq!(
            input_messages(&items, &[]).unwrap(),
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hello, you"),
                ChatMessage::new("assistant", "Hi"),
            ]
        );
    }

    #[test]
    fn function_calls_and_outputs_read_as_chat_renders_them() {
        let call = |id: &str, name: &str, args: &str| {
            json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": id,
                "name": name, "arguments": args, "status": "completed"})
        };
        let items = json!([
            {"role": "user", "content": "Weather in Paris and Rome?"},
            call("c1", "get_weather", r#"{"city": "Paris"}"#),
            call("c2", "get_weather", r#"{"city":"Rome"}"#),
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "c2",
                "output": [{"type": "input_text", "text": "Rain"}]},
            {"type": "function_call_output", "call_id": "c0", "output": "12:00"},
            {"type": "function_call_output", "call_id": "c9", "output": "?"},
        ]);
        let earlier = [ToolCall {
            id: "c0".into(),
            name: "now".into(),
            arguments: "{}".into(),
        }];
        // What chat makes of the same conversation: the calls as one
        // assistant turn in the call format, each result a user turn
        // naming the function.
        let chat_calls = json!([
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": r#"{"city": "Paris"}"#}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": r#"{"city":"Rome"}"#}},
        ]);
        let want = vec![
            ChatMessage::new("user", "Weather in Paris and Rome?"),
            ChatMessage::new("assistant", tools::render_calls("m", &chat_calls).unwrap()),
            ChatMessage::new(
                "user",
                tools::render_result(Some("get_weather"), Some("c1"), "Sunny"),
            ),
            ChatMessage::new(
                "user",
                tools::render_result(Some("get_weather"), Some("c2"), "Rain"),
            ),
            ChatMessage::new(
                "user",
                tools::render_result(Some("now"), Some("c0"), "12:00"),
            ),
            ChatMessage::new("user", tools::render_result(None, Some("c9"), "?")),
        ];
        assert_eq!(input_messages(&items, &earlier).unwrap(), want);
        assert_eq!(
            want[1].content,
            r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_weather","arguments":{"city":"Rome"}}]}"#
        );
        // A run of calls at the end is a turn too.
        let last = input_messages(&json!([call("c1", "now", "{}")]), &[]).unwrap();
        assert_eq!(
            last,
            vec![ChatMessage::new(
                "assistant",
                r#"{"tool_calls":[{"name":"now","arguments":{}}]}"#
            )]
        );
    }

    #[test]
    fn other_items_and_parts_are_refused_by_path() {
        let cases = [
            (
                json!([{"type": "reasoning", "summary": []}]),
                "input[0].type",
            ),
            (
                json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
                "input[0].call_id",
            ),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
                "input[0].arguments",
            ),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
                "input[0].arguments",
            ),
            (
                json!([{"type": "function_call_output", "call_id": "c"}]),
                "input[0].output",
            ),
            (
                json!([{"type": "function_call_output", "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "u"}]}]),
                "input[0].output[0].type",
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
            let e = input_messages(&input, &[]).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{input}: {e:?}");
        }
    }
}
