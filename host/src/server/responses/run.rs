//! One response's run: its engine request read to the end, the stream's
//! events sent as the text comes (with `sequence_number`), cancel and a
//! client that left both stopping it (dropping the sequence aborts the
//! engine request), and the record stored when it ends.
//!
//! Events, in order: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`,
//! `response.output_text.delta` (one per text delta),
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, then the terminal event named after the
//! status: `response.completed`, `response.incomplete` (also for a
//! cancelled response, whose `status` says `cancelled`) or
//! `response.failed`.

use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use super::object::{Record, Status};
use crate::server::generate::Sequence;
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
        let item = json!({"id": r.message_id, "output_index": 0});
        let at = json!({"item_id": r.message_id, "output_index": 0, "content_index": 0});
        self.send("response.created", json!({"response": r.render()}))
            .await
            && self
                .send("response.in_progress", json!({"response": r.render()}))
                .await
            && self
                .send(
                    "response.output_item.added",
                    with(&item, "item", r.message()),
                )
                .await
            && self
                .send("response.content_part.added", with(&at, "part", r.part()))
                .await
    }

    async fn closing(&mut self, r: &Record) {
        let at = json!({"item_id": r.message_id, "output_index": 0, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(r.text);
        done["logprobs"] = json!([]);
        let terminal = match r.status {
            Status::Completed => "response.completed",
            Status::Failed => "response.failed",
            _ => "response.incomplete",
        };
        let _ = self.send("response.output_text.done", done).await
            && self
                .send("response.content_part.done", with(&at, "part", r.part()))
                .await
            && self
                .send(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": r.message()}),
                )
                .await
            && self.send(terminal, json!({"response": r.render()})).await;
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
/// when the response is stored.
pub async fn drive(
    app: Arc<AppState>,
    mut record: Record,
    mut seq: Sequence,
    cancel: watch::Receiver<bool>,
    mut sink: Sink,
) {
    let input_tokens = seq.num_prompt_tokens;
    let mut output_tokens = 0;
    let mut emitter = match &sink {
        Sink::Stream(tx) => Some(Emitter {
            tx: tx.clone(),
            next: 0,
        }),
        _ => None,
    };
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
                    if let Some(finish) = &delta.finish {
                        record.status = match finish.finish_reason.as_str() {
                            "length" => Status::Incomplete,
                            _ => Status::Completed,
                        };
                    }
                    if let (Some(e), false) = (&mut emitter, delta.text.is_empty()) {
                        let at = json!({"item_id": record.message_id, "output_index": 0,
                            "content_index": 0, "delta": delta.text, "logprobs": []});
                        if !e.send("response.output_text.delta", at).await {
                            break End::Gone;
                        }
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
    if record.echo.store {
        app.responses.finish(record.clone());
    }
    match sink {
        Sink::Stream(_) => {
            if let (Some(e), false) = (&mut emitter, matches!(end, End::Gone)) {
                e.closing(&record).await;
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
