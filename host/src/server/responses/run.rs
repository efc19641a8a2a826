//! One response's run: its engine request read to the end, the stream's
//! events sent as the text comes (with `sequence_number`), cancel and a
//! client that left both stopping it (dropping the sequence aborts the
//! engine request), and the record stored when it ends.
//!
//! Events, in order: `response.created`, `response.in_progress`; for a
//! text answer `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta` (one per text delta),
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`; for an answer that calls functions, per
//! call `response.output_item.added` once its name is written,
//! `response.function_call_arguments.delta` as its arguments are written,
//! `response.function_call_arguments.done` and `response.output_item.done`
//! once it is complete (at the end for a call cut short);
//! then the terminal event named after the status: `response.completed`,
//! `response.incomplete` (also for a cancelled response, whose `status`
//! says `cancelled`) or `response.failed`.

use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use super::object::{part, Record, Status};
use crate::server::generate::{token_logprobs, Sequence, TokenNames};
use crate::server::protocol::PromptTokens;
use crate::server::tools::{
    call_id, Answer, CallEvent, Piece, StreamedAnswer, ToolCall, ToolRequest,
};
use crate::server::AppState;

/// Where a run's results go.
pub enum Sink {
    /// A streamed request: events, until the client leaves.
    Stream(mpsc::Sender<Event>),
    /// A plain request waiting for the whole record, until it leaves.
    Wait(oneshot::Sender<Record>),
    /// A background response: only the store.
    Detached,
}

/// Numbers and sends the stream's events.
struct Emitter {
    tx: mpsc::Sender<Event>,
    next: u64,
    /// Whether the message item's opening events went out: only once the
    /// answer is known to be text.
    message_open: bool,
    /// The calls whose items opened, with the arguments sent so far.
    calls: Vec<ToolCall>,
    /// How many of them closed.
    closed: usize,
}

impl Emitter {
    /// Sends event `kind` with `fields`; false once the client is gone.
    async fn send(&mut self, kind: &str, mut fields: Value) -> bool {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.next);
        self.next += 1;
        let event = Event::default().event(kind).data(fields.to_string());
        self.tx.send(event).await.is_ok()
    }

    async fn opening(&mut self, r: &Record) -> bool {
        self.send("response.created", json!({"response": r.render()}))
            .await
            && self
                .send("response.in_progress", json!({"response": r.render()}))
                .await
    }

    /// Opens the message item, once.
    async fn open_message(&mut self, r: &Record) -> bool {
        if std::mem::replace(&mut self.message_open, true) {
            return true;
        }
        let item = json!({"id": r.message_id, "output_index": 0});
        let at = json!({"item_id": r.message_id, "output_index": 0, "content_index": 0});
        self.send(
            "response.output_item.added",
            with(&item, "item", r.opening_message()),
        )
        .await
            && self
                .send(
                    "response.content_part.added",
                    with(&at, "part", part("", &[])),
                )
                .await
    }

    /// Streams a piece of the message's text, with its tokens' logprobs.
    async fn text(&mut self, r: &Record, text: &str, logprobs: &[Value]) -> bool {
        let at = json!({"item_id": r.message_id, "output_index": 0,
            "content_index": 0, "delta": text, "logprobs": logprobs});
        self.open_message(r).await && self.send("response.output_text.delta", at).await
    }

    /// The message's closing events.
    async fn close_message(&mut self, r: &Record) -> bool {
        let at = json!({"item_id": r.message_id, "output_index": 0, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(r.text);
        done["logprobs"] = json!(r.logprobs);
        self.open_message(r).await
            && self.send("response.output_text.done", done).await
            && self
                .send("response.content_part.done", with(&at, "part", r.part()))
                .await
            && self
                .send(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": r.message()}),
                )
                .await
    }

    /// Streams what the calls said: a call's item opens when its name is
    /// known, its arguments follow as they are written, and it closes
    /// when it is complete.
    async fn call_events(&mut self, r: &Record, events: Vec<CallEvent>) -> bool {
        for event in events {
            let sent = match event {
                CallEvent::Begin { index, name } => {
                    let call = ToolCall {
                        id: call_id(&r.id, index),
                        name,
                        arguments: String::new(),
                    };
                    let item = r.function_call_item(index, &call, "in_progress");
                    self.calls.push(call);
                    self.send(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    )
                    .await
                }
                CallEvent::Arguments { index, text } => {
                    self.calls[index].arguments.push_str(&text);
                    let at = r.call_item_id(index);
                    self.send(
                        "response.function_call_arguments.delta",
                        json!({"item_id": at, "output_index": index, "delta": text}),
                    )
                    .await
                }
                CallEvent::End { index } => {
                    self.closed = index + 1;
                    let call = self.calls[index].clone();
                    self.close_call(r, index, &call).await
                }
            };
            if !sent {
                return false;
            }
        }
        true
    }

    /// Call `n`'s closing events, with its arguments as they ended.
    async fn close_call(&mut self, r: &Record, n: usize, call: &ToolCall) -> bool {
        let done = json!({"item_id": r.call_item_id(n), "output_index": n,
            "arguments": call.arguments, "name": call.name});
        self.send("response.function_call_arguments.done", done)
            .await
            && self
                .send(
                    "response.output_item.done",
                    json!({"output_index": n, "item": r.ended_call_item(n, call)}),
                )
                .await
    }

    /// The closing events of the calls still open at the end: a call
    /// cut short, with what was written of it.
    async fn finish_calls(&mut self, r: &Record) -> bool {
        for (n, call) in r.calls.iter().enumerate().skip(self.closed) {
            if !self.close_call(r, n, call).await {
                return false;
            }
        }
        true
    }

    /// The output's closing events (the held-back `rest` of a text answer
    /// first, with its tokens' logprob entries), then the terminal event.
    async fn closing(&mut self, r: &Record, rest: &str, logprobs: &[Value]) {
        let terminal = match r.status {
            Status::Completed => "response.completed",
            Status::Failed => "response.failed",
            _ => "response.incomplete",
        };
        let output = if r.calls.is_empty() {
            let sent =
                (rest.is_empty() && logprobs.is_empty()) || self.text(r, rest, logprobs).await;
            sent && self.close_message(r).await
        } else {
            self.finish_calls(r).await
        };
        let _ = output && self.send(terminal, json!({"response": r.render()})).await;
    }
}

/// `base` with `key` set to `value`.
fn with(base: &Value, key: &str, value: Value) -> Value {
    let mut v = base.clone();
    v[key] = value;
    v
}

/// What stopped the reading loop.
enum End {
    /// The sequence finished (or failed).
    Done,
    /// Cancelled through the store.
    Cancelled,
    /// The client left.
    Gone,
}

/// Runs `seq` to its end for `record`, feeding `sink`; stores the result
/// when the response is stored. With `tools` (that may be called) an
/// answer that parses as calls becomes the record's calls.
pub async fn drive(
    app: Arc<AppState>,
    mut record: Record,
    tools: Option<ToolRequest>,
    mut seq: Sequence,
    cancel: watch::Receiver<bool>,
    mut sink: Sink,
) {
    let input_tokens = PromptTokens {
        total: seq.num_prompt_tokens,
        cached: seq.num_cached_tokens,
    };
    let mut output_tokens = 0;
    let mut emitter = match &sink {
        Sink::Stream(tx) => Some(Emitter {
            tx: tx.clone(),
            next: 0,
            message_open: false,
            calls: Vec::new(),
            closed: 0,
        }),
        _ => None,
    };
    // What of the answer streams as text, under tools.
    let mut held = StreamedAnswer::default();
    let mut end = End::Done;
    if let Some(e) = &mut emitter {
        if !e.opening(&record).await {
            end = End::Gone;
        }
    }
    if !matches!(end, End::Gone) {
        let cancelled = cancelled(cancel);
        tokio::pin!(cancelled);
        let gone = gone(&mut sink);
        tokio::pin!(gone);
        end = loop {
            let next = tokio::select! {
                () = &mut cancelled => break End::Cancelled,
                () = &mut gone => break End::Gone,
                next = seq.next_delta(&app) => next,
            };
            match next {
                None => break End::Done,
                Some(Err(e)) => {
                    record.status = Status::Failed;
                    record.error = Some(e.message);
                    break End::Done;
                }
                Some(Ok(delta)) => {
                    output_tokens += delta.token_ids.len();
                    record.text.push_str(&delta.text);
                    let logprobs = token_logprobs(
                        TokenNames::new(&app.tokenizer, false),
                        &delta.token_ids,
                        &delta.logprobs,
                    );
                    record.logprobs.extend(logprobs.iter().cloned());
                    if let Some(finish) = &delta.finish {
                        record.status = match finish.finish_reason.as_str() {
                            "length" => Status::Incomplete,
                            _ => Status::Completed,
                        };
                    }
                    let Some(e) = &mut emitter else { continue };
                    let piece = match &tools {
                        Some(t) => held.push(t, &delta.text, logprobs),
                        None => Piece::Text {
                            text: delta.text,
                            logprobs,
                        },
                    };
                    let sent = match piece {
                        // Nothing to send; a delta whose text is held for
                        // a stop string still sends its tokens' logprobs.
                        Piece::Text { text, logprobs }
                            if text.is_empty() && logprobs.is_empty() =>
                        {
                            true
                        }
                        Piece::Text { text, logprobs } => e.text(&record, &text, &logprobs).await,
                        // The API gives calls' arguments no logprobs.
                        Piece::Calls { events, .. } => e.call_events(&record, events).await,
                    };
                    if !sent {
                        break End::Gone;
                    }
                }
            }
        };
    }
    // Aborts the engine request if it still runs.
    drop(seq);
    record.usage = Some((input_tokens, output_tokens));
    match end {
        End::Cancelled | End::Gone => record.status = Status::Cancelled,
        End::Done if record.status == Status::InProgress => {
            // The stream ended without a finish: say so rather than pretend.
            record.status = Status::Failed;
            record.error = Some("the engine ended the response without finishing it".into());
        }
        End::Done => {}
    }
    let mut rest = (String::new(), Vec::new());
    if let Some(t) = &tools {
        match t.parse(&record.text, &record.id) {
            Answer::Calls(calls) => record.calls = calls,
            // What the stream still holds back of a text answer goes last.
            Answer::Text(_) => rest = held.held_back(),
        }
    }
    if record.echo.store {
        app.responses.finish(record.clone());
    }
    match sink {
        Sink::Stream(_) => {
            if let (Some(e), false) = (&mut emitter, matches!(end, End::Gone)) {
                e.closing(&record, &rest.0, &rest.1).await;
            }
        }
        Sink::Wait(tx) => {
            let _ = tx.send(record);
        }
        Sink::Detached => {}
    }
}

/// Resolves when the store cancels the run (never once the store dropped
/// its handle, e.g. evicted it).
async fn cancelled(mut cancel: watch::Receiver<bool>) {
    loop {
        if *cancel.borrow_and_update() {
            return;
        }
        if cancel.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Resolves when the client the run answers went away (never for a
/// background run).
async fn gone(sink: &mut Sink) {
    match sink {
        Sink::Stream(tx) => tx.closed().await,
        Sink::Wait(tx) => tx.closed().await,
        Sink::Detached => std::future::pending().await,
    }
}
