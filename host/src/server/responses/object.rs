//! The `response` object as OpenAI words it: what a create answers, what
//! the store keeps and retrieve returns, and what the stream's events
//! carry.

use serde_json::{json, Map, Value};

use super::super::limits;

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
    /// The text generated.
    pub text: String,
    /// Prompt tokens (input) and generated tokens (output).
    pub usage: Option<(usize, usize)>,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// The request's settings.
    pub echo: Echo,
}

impl Record {
    /// Bytes of text it holds, for the store's budget.
    pub fn text_bytes(&self) -> usize {
        let format = self.echo.text_format.as_ref().map_or(0, limits::json_len) as usize;
        self.text.len() + self.echo.instructions.as_ref().map_or(0, String::len) + format
    }

    /// The output message item as it stands.
    pub fn message(&self) -> Value {
        let status = match self.status {
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            _ => "incomplete",
        };
        json!({
            "id": self.message_id, "type": "message", "status": status, "role": "assistant",
            "content": [self.part()],
        })
    }

    /// The one `output_text` content part as it stands.
    pub fn part(&self) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
    }

    /// The whole `response` object. While generating, `output` is empty
    /// (the stream's events carry the text as it comes).
    pub fn render(&self) -> Value {
        let e = &self.echo;
        let output = if self.status == Status::InProgress {
            Vec::new()
        } else {
            vec![self.message()]
        };
        let usage = self.usage.map(|(input, output)| {
            json!({
                "input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
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
            "output": output,
            "parallel_tool_calls": false,
            "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": e.store,
            "temperature": e.temperature,
            "text": {"format": e.text_format.clone().unwrap_or_else(|| json!({"type": "text"}))},
            "tool_choice": "none",
            "tools": [],
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": e.user,
        })
    }
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
            usage: Some((3, 2)),
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
        let v = record(Status::Completed).render();
        assert!(v["incomplete_details"].is_null());
        assert_eq!(v["output"][0]["status"], "completed");
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
