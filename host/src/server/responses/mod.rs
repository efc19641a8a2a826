//! `/v1/responses` (OpenAI's Responses API) on the chat path: `input` and
//! `instructions` become chat messages rendered with the model's chat
//! template, one engine request generates the answer, and the result is
//! a `response` object, or a stream of the documented events.
//!
//! - `POST /v1/responses`: create; `stream`, `background`, `store`,
//!   `previous_response_id` (the stored conversation and answer come
//!   first), `max_output_tokens`, the sampling fields, logprobs
//!   (`include` and `top_logprobs`), and function `tools` (chat's tool
//!   calling, `tools.rs`, in this API's shapes: the answer's
//!   `function_call` items, answered by `function_call_output` items),
//!   `truncation: "auto"` (the prompt leaves the oldest items out until
//!   it fits, `truncate.rs`).
//! - `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
//!   `DELETE /v1/responses/{id}`: the in-memory store (`store.rs`).
//!
//! `request.rs` reads the body and `input.rs` its `input`, `run.rs` drives
//! the engine request and the events, `object.rs` words the `response`
//! object.

mod input;
mod object;
mod request;
mod run;
mod store;
mod truncate;

use std::collections::hash_map::RandomState;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde_json::json;
use tokio::sync::{mpsc, oneshot, watch};

use super::error::ApiError;
use super::generate;
use super::limits;
use super::params;
use super::structured;
use super::tools::{Api, ToolRequest};
use super::AppState;
use crate::tokenizer::ChatMessage;
use object::{Echo, Record, Status};
use request::Truncation;
use run::Sink;
use store::Refusal;
pub use store::Store;

/// Events buffered between the run and a slow client.
const CHANNEL_EVENTS: usize = 256;

/// `POST /v1/responses`.
pub async fn create(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = super::request_object(body)?;
    let (req, sampling) = request::read(&body, &app.config)?;
    app.check_model(req.model.as_deref())?;
    let tools = ToolRequest::from_body(&body, Api::Responses)?;
    let text_format = body.pointer("/text/format").filter(|f| !f.is_null());
    let constraint = structured::from_text_format(text_format)?;
    let format_asked = constraint.is_some();
    let (mut conversation, earlier_calls) = match &req.previous_response_id {
        Some(id) => app.responses.conversation(id).map_err(|r| {
            let why = match r {
                Refusal::NotFound => format!(
                    "no stored response `{id}` (never stored, `store: false`, evicted past \
                     server.max_stored_responses, or deleted)"
                ),
                Refusal::Status(s) => format!(
                    "the response `{id}` is {}; only a completed or incomplete one can be continued",
                    s.as_str()
                ),
            };
            ApiError::field("previous_response_id", why)
        })?,
        None => (Vec::new(), Vec::new()),
    };
    conversation.extend(input::input_messages(&req.input, &earlier_calls)?);
    if conversation.is_empty() {
        return Err(ApiError::field(
            "input",
            "must hold at least one message (or continue a response with previous_response_id)",
        ));
    }
    // A chain of continuations is bounded as one chat request is.
    let bytes: usize = conversation.iter().map(|m| m.content.len()).sum::<usize>()
        + req.instructions.as_ref().map_or(0, String::len);
    let field = "previous_response_id";
    limits::prompt_bytes(field, bytes as u64, &app.config)?;
    let count = conversation.len() as u64 + u64::from(req.instructions.is_some());
    limits::at_most(
        field,
        count,
        "messages with the stored conversation",
        app.config.max_messages,
        "max_messages",
    )?;
    let constraint = structured::or_tool_calls(constraint, tools.as_ref())?;
    let truncation = req.truncation.unwrap_or_default();
    let max_model_len = app.client.max_model_len();
    let render = |dropped: usize| -> Result<Vec<u32>, ApiError> {
        let mut messages = Vec::with_capacity(conversation.len() + 1);
        messages.extend(
            req.instructions
                .as_ref()
                .map(|i| ChatMessage::new("system", i.clone())),
        );
        messages.extend(truncate::kept(&conversation, dropped).cloned());
        if let Some(t) = &tools {
            t.describe_to(&mut messages);
            limits::described_tools(&messages, &app.config)?;
        }
        let text = app
            .tokenizer
            .apply_chat_template(&messages, true)
            .map_err(|e| ApiError::field("input", e))?;
        app.tokenizer
            .encode(&text, false)
            .map_err(|e| ApiError::field("input", e))
    };
    let fits = |prompt: &[u32]| {
        let room = req.max_output_tokens.unwrap_or(1);
        limits::check_context(
            "input",
            prompt.len(),
            ("max_output_tokens", room),
            max_model_len,
        )
        .is_ok()
    };
    let prompt = match truncation {
        Truncation::Disabled => render(0)?,
        Truncation::Auto => truncate::fitting(&conversation, render, fits)?,
    };
    let mut sampling = sampling;
    sampling.max_tokens = req.max_output_tokens;
    let mut params = params::sampling_params(
        &sampling,
        req.logprobs(),
        app.default_max_tokens(prompt.len()),
        &app.tokenizer,
    )
    .map_err(|mut e| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
            e.message = e.message.replace("`max_tokens`", "`max_output_tokens`");
        }
        e
    })?;
    let max_tokens = ("max_output_tokens", params.max_tokens);
    limits::check_context("input", prompt.len(), max_tokens, max_model_len)?;
    app.constrain(&mut params, constraint, &sampling).await?;

    let id = random_id("resp");
    let store = req.store != Some(false);
    let record = Record {
        message_id: random_id("msg"),
        created_at: super::unix_now(),
        status: Status::InProgress,
        model: app.model_name.clone(),
        text: String::new(),
        calls: Vec::new(),
        logprobs: Vec::new(),
        usage: None,
        error: None,
        echo: Echo {
            instructions: req.instructions.clone(),
            max_output_tokens: req.max_output_tokens,
            previous_response_id: req.previous_response_id.clone(),
            temperature: params.temperature,
            top_p: params.top_p,
            store,
            background: req.background,
            metadata: req.metadata.clone().unwrap_or_default(),
            user: req.user.clone(),
            text_format: text_format.filter(|_| format_asked).cloned(),
            tools: body.get("tools").filter(|t| !t.is_null()).cloned(),
            tool_choice: body.get("tool_choice").filter(|t| !t.is_null()).cloned(),
            parallel_tool_calls: body["parallel_tool_calls"].as_bool().unwrap_or(true),
            top_logprobs: req.top_logprobs.unwrap_or(0),
            truncation,
        },
        id: id.clone(),
    };
    let tools = tools.filter(ToolRequest::may_call);
    let extras = generate::Extras::of(&sampling);
    let mut seqs = generate::start(&app, &id, vec![prompt], &params, extras).await?;
    let Some(seq) = seqs.pop() else {
        return Err(ApiError::internal("the engine request was not started"));
    };
    let (cancel_tx, cancel_rx) = watch::channel(false);
    if store {
        app.responses
            .insert(record.clone(), conversation, cancel_tx);
    }
    if req.stream {
        let (tx, rx) = mpsc::channel(CHANNEL_EVENTS);
        tokio::spawn(run::drive(
            app.clone(),
            record,
            tools.clone(),
            seq,
            cancel_rx,
            Sink::Stream(tx),
        ));
        let body = stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|e: Event| (Ok::<_, Infallible>(e), rx))
        });
        return Ok(Sse::new(body).into_response());
    }
    if req.background {
        let answer = record.render();
        tokio::spawn(run::drive(
            app.clone(),
            record,
            tools.clone(),
            seq,
            cancel_rx,
            Sink::Detached,
        ));
        return Ok(Json(answer).into_response());
    }
    let (tx, rx) = oneshot::channel();
    tokio::spawn(run::drive(
        app.clone(),
        record,
        tools,
        seq,
        cancel_rx,
        Sink::Wait(tx),
    ));
    let record = rx
        .await
        .map_err(|_| ApiError::internal("the response's run ended without an answer"))?;
    if record.status == Status::Failed {
        let why = record.error.unwrap_or_default();
        return Err(ApiError::internal(format!("the response failed: {why}")));
    }
    Ok(Json(record.render()).into_response())
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let record = app.responses.get(&id).ok_or_else(|| not_found(&id))?;
    Ok(Json(record.render()).into_response())
}

/// `POST /v1/responses/{id}/cancel`: stops a response that is still
/// generating; its object comes back with `status: cancelled`.
pub async fn cancel(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match app.responses.cancel(&id) {
        Ok(record) => Ok(Json(record.render()).into_response()),
        Err(Refusal::NotFound) => Err(not_found(&id)),
        Err(Refusal::Status(s)) => Err(ApiError::bad_request(
            None,
            format!(
                "the response `{id}` is {}; only one still in progress can be cancelled",
                s.as_str()
            ),
        )),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a stored response (cancelling it
/// if it still runs).
pub async fn delete(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !app.responses.delete(&id) {
        return Err(not_found(&id));
    }
    Ok(Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response())
}

fn not_found(id: &str) -> ApiError {
    let id: String = id.chars().take(64).collect();
    ApiError::with_status(
        StatusCode::NOT_FOUND,
        format!(
            "no stored response `{id}`: responses are kept in memory only when created with \
             `store: true` (the default), and the oldest go past server.max_stored_responses"
        ),
    )
}

/// `<prefix>_` and 24 hex digits: 64 random bits (the standard library's
/// per-process random hash keys) and a counter, so ids are unique and
/// not guessable from one another.
fn random_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(n);
    format!("{prefix}_{:016x}{:08x}", h.finish(), n as u32)
}

#[cfg(test)]
mod tests {
    use super::random_id;

    #[test]
    fn ids_are_prefixed_and_distinct() {
        let (a, b) = (random_id("resp"), random_id("resp"));
        assert!(a.starts_with("resp_") && a.len() == 5 + 24, "{a}");
        assert_ne!(a, b);
    }
}
