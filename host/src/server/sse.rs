//! Streaming answers as server-sent events: one `data: {chunk}` per text
//! delta of any choice, an optional usage chunk, then `data: [DONE]`.
//! With vLLM's `continuous_usage_stats`, every chunk of a choice carries
//! that choice's counts so far as well.
//!
//! A task reads the choices' engine outputs and feeds a bounded channel the
//! HTTP body drains. When the client disconnects, the body (and so the
//! channel's receiver) is dropped; the task sees the channel close at once,
//! even between tokens, and drops its sequences, which aborts their engine
//! requests and frees their KV blocks.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::generate::{prompt_tokens, Sequence};
use super::protocol::{PromptTokens, StreamOptions, Usage};
use super::AppState;
use crate::engine::Delta;

/// How one endpoint words its stream chunks.
pub trait ChunkFormat: Send + 'static {
    /// A chunk to send for choice `index` before its first delta (the chat
    /// API's `role`), if any.
    fn opening(&self, index: usize) -> Option<Value>;
    /// The chunk carrying one delta of choice `index`; `None` holds it
    /// back (while it is not known whether a tool answer is text or a
    /// call).
    fn delta(&mut self, index: usize, delta: &Delta) -> Option<Value>;
    /// The last chunk, with the token counts and no choices.
    fn usage(&self, usage: Usage) -> Value;
}

/// Chunks buffered between the engine and a slow client.
const CHANNEL_CHUNKS: usize = 256;

/// Streams `seqs` as server-sent events, with usage as `options` ask.
pub fn stream(
    app: Arc<AppState>,
    seqs: Vec<Sequence>,
    format: impl ChunkFormat,
    options: StreamOptions,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(CHANNEL_CHUNKS);
    tokio::spawn(produce(app, seqs, format, options, tx));
    let body = stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(body).into_response()
}

async fn produce(
    app: Arc<AppState>,
    seqs: Vec<Sequence>,
    mut format: impl ChunkFormat,
    options: StreamOptions,
    tx: mpsc::Sender<Event>,
) {
    let data = |v: &Value| Event::default().data(v.to_string());
    let prompt_tokens = prompt_tokens(&seqs);
    let num_choices = seqs.len();
    // Each choice's prompt and tokens so far, by index, for the counts
    // every chunk carries under `continuous_usage_stats` (as in vLLM, only
    // together with `include_usage`).
    let continuous = options.include_usage && options.continuous_usage_stats;
    let mut prompts = vec![PromptTokens::default(); num_choices];
    for seq in &seqs {
        prompts[seq.index] = PromptTokens {
            total: seq.num_prompt_tokens,
            cached: seq.num_cached_tokens,
        };
    }
    let mut generated = vec![0; num_choices];
    let with_usage = |mut chunk: Value, index: usize, generated: usize| {
        if continuous {
            chunk["usage"] = json!(Usage::new(prompts[index], generated));
        }
        chunk
    };
    for seq in &seqs {
        if let Some(chunk) = format.opening(seq.index) {
            if tx
                .send(data(&with_usage(chunk, seq.index, 0)))
                .await
                .is_err()
            {
                return;
            }
        }
    }
    let per_seq = seqs.into_iter().map(|seq| {
        let app = app.clone();
        Box::pin(stream::unfold(seq, move |mut seq| {
            let app = app.clone();
            async move {
                let item = seq.next_delta(&app).await?;
                Some(((seq.index, item), seq))
            }
        }))
    });
    let mut merged = stream::select_all(per_seq);
    let mut completion_tokens = 0;
    // Each choice's latest prediction tally, by index.
    let mut predictions = vec![None; num_choices];
    loop {
        let item = tokio::select! {
            // The client is gone: dropping `merged` aborts what still runs.
            _ = tx.closed() => return,
            item = merged.next() => item,
        };
        let event = match item {
            None => break,
            Some((index, Ok(delta))) => {
                completion_tokens += delta.token_ids.len();
                generated[index] += delta.token_ids.len();
                if delta.prediction_tokens.is_some() {
                    predictions[index] = delta.prediction_tokens;
                }
                match format.delta(index, &delta) {
                    Some(chunk) => data(&with_usage(chunk, index, generated[index])),
                    None => continue,
                }
            }
            Some((_, Err(e))) => {
                // Headers are sent; the error travels in the stream, as vLLM does it.
                let _ = tx
                    .send(data(&serde_json::to_value(e.body()).unwrap_or_default()))
                    .await;
                break;
            }
        };
        if tx.send(event).await.is_err() {
            return;
        }
    }
    drop(merged);
    if options.include_usage
        && tx
            .send(data(&format.usage(
                Usage::new(prompt_tokens, completion_tokens).with_predictions(predictions),
            )))
            .await
            .is_err()
    {
        return;
    }
    let _ = tx.send(Event::default().data("[DONE]")).await;
}
