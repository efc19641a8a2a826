//! The `response` object as OpenAI words it: what a create answers, what
//! the store keeps and retrieve returns, and what the stream's events
//! carry.

use serde_json::{json, Map, Value};

use super::super::limits;
use super::super::protocol::PromptTokens;
use super::super::tools::ToolCall;
use super::request::Truncation;

/// Where a response stands (OpenAI's `status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Generating.
    InProgress,
    /// Ended on its own (end of sequence, a stop string or token).
    Completed,
    /// Ended by `max_output_tokens` (or the context's end).
    Incomplete,
    /// Cancelled by `POST /v1/responses/{id}/cancel` (or its client left).
    Cancelled,
    /// The engine failed it.
    Failed,
}

impl Status {
    /// OpenAI's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Cancelled => "cancelled",
            Status::Failed => "failed",
        }
    }
}

/// The request's settings a response object repeats back.
#[derive(Clone, Debug, Default)]
pub struct Echo {
    /// `instructions` (the system message).
    pub instructions: Option<String>,
    /// `max_output_tokens` as asked (`null` when unset).
    pub max_output_tokens: Option<u32>,
    /// The response this one continues.
    pub previous_response_id: Option<String>,
    /// The temperature sampled with.
    pub temperature: f32,
    /// The nucleus mass sampled with.
    pub top_p: f32,
    /// Whether it is stored.
    pub store: bool,
    /// Whether it runs detached from its request.
    pub background: bool,
    /// The caller's key-value pairs.
    pub metadata: Map<String, Value>,
    /// The caller's end-user id.
    pub user: Option<String>,
    /// `text.format` as asked; `None` for plain text.
    pub text_format: Option<Value>,
    /// `tools` as sent; `None` when none are.
    pub tools: Option<Value>,
    /// `tool_choice` as sent; `None` for OpenAI's default, `auto`.
    pub tool_choice: Option<Value>,
    /// Whether an answer may call more than one function.
    pub parallel_tool_calls: bool,
    /// Alternatives per token in the logprobs (`0` when unset).
    pub top_logprobs: u32,
    /// How a conversation longer than the context was to be treated.
    pub truncation: Truncation,
}

/// One response: its identity, its settings, and what it produced so far.
#[derive(Clone, Debug)]
pub struct Record {
    /// `resp_…`.
    pub id: String,
    /// Unix time it was created.
    pub created_at: u64,
    /// Where it stands.
    pub status: Status,
    /// The served model's id.
    pub model: String,
    /// The id of its one output message (`msg_…`).
    pub message_id: String,
    /// The text generated (a call's too, as the model wrote it).
    pub text: String,
    /// The functions the answer calls; empty when it is text.
    pub calls: Vec<ToolCall>,
    /// The generated tokens' logprobs (`generate::token_logprobs` entries),
    /// when asked for; otherwise empty.
    pub logprobs: Vec<Value>,
    /// Prompt tokens (input) and generated tokens (output).
    pub usage: Option<(PromptTokens, usize)>,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// The request's settings.
    pub echo: Echo,
}

impl Record {
    /// Bytes of text it holds, for the store's budget.
    pub fn text_bytes(&self) -> usize {
        let e = &self.echo;
        let calls: usize = self
            .calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum();
        self.text.len()
            + calls
            + self
                .logprobs
                .iter()
                .map(|l| limits::json_len(l) as usize)
                .sum::<usize>()
            + e.instructions.as_ref().map_or(0, String::len)
            + [&e.text_format, &e.tools, &e.tool_choice]
                .into_iter()
                .flatten()
                .map(|v| limits::json_len(v) as usize)
                .sum::<usize>()
    }

    /// The output message item as it stands.
    pub fn message(&self) -> Value {
        self.message_with(&self.text, &self.logprobs)
    }

    /// The message item as a stream opens it: its text empty (the deltas
    /// carry it).
    pub fn opening_message(&self) -> Value {
        self.message_with("", &[])
    }

    fn message_with(&self, text: &str, logprobs: &[Value]) -> Value {
        let status = match self.status {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            _ => "incomplete",
        };
        json!({
            "id": self.message_id, "type": "message", "status": status, "role": "assistant",
            "content": [part(text, logprobs)],
        })
    }

    /// The one `output_text` content part as it stands.
    pub fn part(&self) -> Value {
        part(&self.text, &self.logprobs)
    }

    /// The id of call `n`'s output item (`fc_…`).
    pub fn call_item_id(&self, n: usize) -> String {
        format!("fc_{}_{n}", self.id.trim_start_matches("resp_"))
    }

    /// `call` as output item `n` (OpenAI's `function_call`) once it
    /// ended: `completed`, or `incomplete` when the answer was cut short
    /// inside it (its arguments are not whole JSON).
    pub fn ended_call_item(&self, n: usize, call: &ToolCall) -> Value {
        let whole = serde_json::from_str::<serde::de::IgnoredAny>(&call.arguments).is_ok();
        let status = if whole { "completed" } else { "incomplete" };
        self.function_call_item(n, call, status)
    }

    /// `call` as output item `n` with `status` (`in_progress` while its
    /// arguments stream).
    pub fn function_call_item(&self, n: usize, call: &ToolCall, status: &str) -> Value {
        json!({
            "id": self.call_item_id(n),
            "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments,
        })
    }

    /// The output items: the calls, or the one message; none while
    /// generating (the stream's events carry the text as it comes).
    pub fn output(&self) -> Vec<Value> {
        if self.status == Status::InProgress {
            return Vec::new();
        }
        if self.calls.is_empty() {
            return vec![self.message()];
        }
        self.calls
            .iter()
            .enumerate()
            .map(|(n, c)| self.ended_call_item(n, c))
            .collect()
    }

    /// The whole `response` object.
    pub fn render(&self) -> Value {
        let e = &self.echo;
        let usage = self.usage.map(|(input, output)| {
            json!({
                "input_tokens": input.total,
                "input_tokens_details": {"cached_tokens": input.cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input.total + output,
            })
        });
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status.as_str(),
            "background": e.background,
            "error": self.error.as_ref().map(|m| json!({"code": "server_error", "message": m})),
            "incomplete_details": (self.status == Status::Incomplete)
                .then(|| json!({"reason": "max_output_tokens"})),
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "metadata": e.metadata,
            "model": self.model,
            "output": self.output(),
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": e.store,
            "temperature": e.temperature,
            "text": {"format": e.text_format.clone().unwrap_or_else(|| json!({"type": "text"}))},
            "tool_choice": e.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "top_logprobs": e.top_logprobs,
            "tools": e.tools.clone().unwrap_or_else(|| json!([])),
            "top_p": e.top_p,
            "truncation": e.truncation.as_str(),
            "usage": usage,
            "user": e.user,
        })
    }
}

/// An `output_text` content part.
pub fn part(text: &str, logprobs: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: Status) -> Record {
        Record {
            id: "resp_1".into(),
            created_at: 7,
            status,
            model: "m".into(),
            message_id: "msg_1".into(),
            text: "Hello".into(),
            calls: Vec::new(),
            logprobs: Vec::new(),
            usage: Some((
                PromptTokens {
                    total: 3,
                    cached: 1,
                },
                2,
            )),
            error: None,
            echo: Echo {
                max_output_tokens: Some(2),
                ..Echo::default()
            },
        }
    }

    #[test]
    fn a_finished_response_carries_its_message_and_usage() {
        let v = record(Status::Incomplete).render();
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(v["output"][0]["status"], "incomplete");
        assert_eq!(v["usage"]["total_tokens"], 5);
        assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 1);
        let v = record(Status::Completed).render();
        assert!(v["incomplete_details"].is_null());
        assert_eq!(v["output"][0]["status"], "completed");
    }

    #[test]
    fn an_answer_that_calls_is_one_function_call_item_per_call() {
        let mut r = record(Status::Completed);
        r.calls = (0..2)
            .map(|n| ToolCall {
                id: format!("call_{n}"),
                name: "get_weather".into(),
                arguments: format!(r#"{{"day":{n}}}"#),
            })
            .collect();
        r.echo.tools = Some(json!([{"type": "function", "name": "get_weather"}]));
        let v = r.render();
        let output = v["output"].as_array().unwrap();
        assert_eq!(output.len(), 2);
        for (n, item) in output.iter().enumerate() {
            assert_eq!(item["type"], "function_call");
            assert_eq!(item["call_id"], format!("call_{n}"));
            assert_eq!(item["arguments"], format!(r#"{{"day":{n}}}"#));
            assert_eq!(item["status"], "completed");
        }
        assert_ne!(output[0]["id"], output[1]["id"]);
        assert!(output[0]["id"].as_str().unwrap().starts_with("fc_"));
        // A call the answer was cut short inside is incomplete.
        r.calls[1].arguments = r#"{"day":"#.into();
        assert_eq!(r.render()["output"][1]["status"], "incomplete");
        assert_eq!(v["tools"], r.echo.tools.clone().unwrap());
        assert_eq!(v["tool_choice"], "auto");
    }

    #[test]
    fn an_unfinished_response_has_no_output_yet() {
        let v = record(Status::InProgress).render();
        assert_eq!(v["status"], "in_progress");
        assert_eq!(v["output"], json!([]));
    }

    #[test]
    fn the_text_format_is_repeated_back_and_counted() {
        let mut r = record(Status::Completed);
        assert_eq!(r.render()["text"], json!({"format": {"type": "text"}}));
        let format = json!({"type": "json_object"});
        r.echo.text_format = Some(format.clone());
        assert_eq!(r.render()["text"], json!({"format": format}));
        assert_eq!(
            r.text_bytes(),
            "Hello".len() + r#"{"type":"json_object"}"#.len()
        );
    }
}
