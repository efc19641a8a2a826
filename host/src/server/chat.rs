//! `POST /v1/chat/completions`: messages rendered with the model's chat
//! template, `chat.completion` objects or `chat.completion.chunk`s out.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::beam::BeamSearch;
use super::error::ApiError;
use super::fields::{self, Endpoint};
use super::generate::{self, Choice, TokenNames};
use super::limits;
use super::params;
use super::prediction;
use super::protocol::{AnswerRequest, ChatCompletionRequest, SamplingRequest, Usage};
use super::sse::{self, ChunkFormat};
use super::structured;
use super::tools::{call_id, Answer, Api, CallEvent, Piece, StreamedAnswer, ToolCall, ToolRequest};
use super::AppState;
use crate::engine::{Delta, Finish};
use crate::sampling::MAX_LOGPROBS;
use crate::step::Logprobs;
use crate::tokenizer::ChatMessage;

/// The handler; an error becomes its OpenAI-style response.
pub async fn create(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = super::request_object(body)?;
    limits::check_chat(&body, &app.config)?;
    fields::check_fields(&body, Endpoint::Chat)?;
    let req: ChatCompletionRequest = params::typed(&body)?;
    let answer: AnswerRequest = params::typed(&body)?;
    app.check_model(answer.model.as_deref())?;
    let id = app.answer_id("chatcmpl", &headers, answer.request_id.as_deref())?;
    let tools = ToolRequest::from_body(&body, Api::Chat)?;
    let constraint = structured::from_fields(
        answer.response_format.as_ref(),
        answer.structured_outputs.as_ref(),
    )?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if k > MAX_LOGPROBS => {
            return Err(ApiError::field(
                "top_logprobs",
                format!("must be in [0, {MAX_LOGPROBS}], got {k}"),
            ))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::field("top_logprobs", "needs `logprobs: true`"))
        }
        (true, k) => Some(k.unwrap_or(0)),
        (false, _) => None,
    };
    let mut messages = params::chat_messages(&req.messages)?;
    let echo = match req.echo {
        true => echoed(&messages, req.add_generation_prompt),
        false => String::new(),
    };
    if let Some(t) = &tools {
        t.describe_to(&mut messages);
        limits::described_tools(&messages, &app.config)?;
    }
    let constraint = structured::or_tool_calls(constraint, tools.as_ref())?;
    let mut prompt = req.rendering().prompt(&app.tokenizer, &messages)?;
    let mut prediction = prediction::tokens(req.prediction.as_ref(), &app.tokenizer, &app.config)?;
    let sampling: SamplingRequest = params::typed(&body)?;
    if answer.stream && sampling.prompt_logprobs.is_some() {
        return Err(ApiError::field(
            "prompt_logprobs",
            "is not available with `stream: true` (as in vLLM)",
        ));
    }
    // As in vLLM, an unset max_tokens lets the answer run to the context's end.
    let defaulted = sampling.max_tokens.is_none() && sampling.max_completion_tokens.is_none();
    let mut params = params::sampling_params(
        &sampling,
        logprobs,
        app.default_max_tokens(prompt.len()),
        &app.tokenizer,
    )?;
    let features = [
        (tools.as_ref().is_some_and(ToolRequest::may_call), "tools"),
        (constraint.is_some(), "response_format"),
        (!prediction.is_empty(), "prediction"),
    ];
    let beam = BeamSearch::requested(&answer, &params, &features)?;
    let max_model_len = app.client.max_model_len();
    // Truncation keeps the prompt's end: the last messages and the
    // assistant's turn the template opens.
    let keep = params::truncation(&sampling, max_model_len)?;
    params::truncate_prompt(&mut prompt, keep);
    let max_tokens = (sampling.max_tokens_field(), params.max_tokens);
    let field = match keep {
        Some(_) => "truncate_prompt_tokens",
        None => "messages",
    };
    limits::check_context(field, prompt.len(), max_tokens, max_model_len)?;
    // No answer reaches past max_tokens, so neither does a draft: each of
    // the `n` engine requests gets a copy of no more than it can use.
    prediction.truncate(params.max_tokens as usize);
    app.constrain(&mut params, constraint, &sampling).await?;
    let extras = generate::Extras {
        prediction: &prediction,
        ..generate::Extras::of(&sampling)
    };
    let returned_prompt = answer
        .return_token_ids
        .unwrap_or(false)
        .then(|| prompt.clone());
    // The engine requests get ids of the server's own, unique even when
    // clients reuse a name.
    let engine_id = app.next_request_id("chatcmpl");
    let format = Format {
        id,
        created: super::unix_now(),
        app: app.clone(),
        tools: tools.filter(ToolRequest::may_call),
        streams: Vec::new(),
        prompt_token_ids: returned_prompt,
        as_ids: answer.return_tokens_as_token_ids.unwrap_or(false),
        unsent_ids: Vec::new(),
        echo,
    };
    if let Some(beam) = beam {
        let (choices, usage) = beam.run(&app, &engine_id, vec![prompt], extras).await?;
        return Ok(Json(format.answer(&choices, usage, None)).into_response());
    }
    let seqs = generate::start(&app, &engine_id, vec![prompt], &params, extras)
        .await
        .map_err(|mut e| {
            // The engine may refuse the rest of the context (a KV cache smaller
            // than max_model_len); say where the number came from.
            if defaulted && e.status == axum::http::StatusCode::BAD_REQUEST {
                e.message.push_str(&format!(
                    " (max_tokens was not set, so it defaulted to the rest of the context, {}; set max_tokens)",
                    params.max_tokens
                ));
                e.param = Some("max_tokens".into());
            }
            e
        })?;
    if answer.stream {
        let options = answer.stream_options.unwrap_or_default();
        return Ok(sse::stream(app.clone(), seqs, format, options));
    }
    let (choices, usage) = generate::collect(&app, seqs).await?;
    // vLLM gives the prompt's logprobs once, beside the choices.
    let prompt_logprobs = params.prompt_logprobs.map(|k| {
        let entries = choices.first().and_then(|c| c.prompt_logprobs.as_deref());
        generate::prompt_logprobs_json(&app.tokenizer, entries.unwrap_or_default(), k)
    });
    Ok(Json(format.answer(&choices, usage, prompt_logprobs)).into_response())
}

/// What vLLM's chat `echo` repeats: the last message's text when the
/// answer continues its role, which is the assistant's after a generation
/// prompt and the last message's own without one; else nothing.
fn echoed(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    match messages.last() {
        Some(last) if !add_generation_prompt || last.role == "assistant" => last.content.clone(),
        _ => String::new(),
    }
}

/// How an answer that calls functions finished: `tool_calls` when the
/// model ended it, as OpenAI says; a call cut short (by `max_tokens`, or a
/// stop string inside it) keeps its reason, so the client knows its
/// arguments are unfinished.
fn called_finish(finish: &Finish) -> Finish {
    let by_stop_string = finish.stop_reason.as_ref().is_some_and(Value::is_string);
    match finish.finish_reason.as_str() {
        "stop" if !by_stop_string => Finish {
            finish_reason: "tool_calls".to_string(),
            ..finish.clone()
        },
        _ => finish.clone(),
    }
}

/// Call events as the stream's `tool_calls` entries: a call's first
/// entry has its id, type and name; later ones add to its
/// `arguments`. `None` when there are none.
fn call_deltas(request_id: &str, events: Vec<CallEvent>) -> Option<Vec<Value>> {
    let mut entries: Vec<Value> = Vec::new();
    for event in events {
        match event {
            CallEvent::Begin { index, name } => entries.push(json!({
                "index": index, "id": call_id(request_id, index), "type": "function",
                "function": {"name": name, "arguments": ""},
            })),
            CallEvent::Arguments { index, text } => match entries.last_mut() {
                Some(e) if e["index"] == index => {
                    let mut arguments = e["function"]["arguments"]
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    arguments.push_str(&text);
                    e["function"]["arguments"] = arguments.into();
                }
                _ => entries.push(json!({"index": index, "function": {"arguments": text}})),
            },
            CallEvent::End { .. } => {}
        }
    }
    (!entries.is_empty()).then_some(entries)
}

/// Words the answer's objects.
struct Format {
    id: String,
    created: u64,
    app: Arc<AppState>,
    /// The tools the answer may call (none under `tool_choice: "none"`).
    tools: Option<ToolRequest>,
    /// Each streamed choice's tool-call state, by index.
    streams: Vec<StreamedAnswer>,
    /// The prompt's token ids, when the request asked for them (vLLM's
    /// `return_token_ids`): then each choice carries its `token_ids` too.
    prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's `return_tokens_as_token_ids`.
    as_ids: bool,
    /// Each streamed choice's tokens not yet sent in a chunk (held back
    /// with a tool answer's text), by index.
    unsent_ids: Vec<Vec<u32>>,
    /// The text every choice's content starts with (vLLM's `echo`; empty
    /// without it).
    echo: String,
}

impl Format {
    fn object(&self, object: &str, choices: Vec<Value>, usage: Option<Usage>) -> Value {
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.app.model_name,
            "choices": choices, "usage": usage,
        })
    }

    /// The unstreamed answer: the choices, their usage, and the prompt's
    /// logprobs and token ids when asked for.
    fn answer(&self, choices: &[Choice], usage: Usage, prompt_logprobs: Option<Value>) -> Value {
        let choices: Vec<Value> = choices.iter().map(|c| self.choice(c)).collect();
        let mut object = self.object("chat.completion", choices, Some(usage));
        if let Some(p) = prompt_logprobs {
            object["prompt_logprobs"] = p;
        }
        if let Some(ids) = &self.prompt_token_ids {
            object["prompt_token_ids"] = json!(ids);
        }
        object
    }

    fn choice(&self, c: &Choice) -> Value {
        let mut finish = c.finish.clone();
        let message = match self.tools.as_ref().map(|t| t.parse(&c.text, &self.id)) {
            Some(Answer::Calls(calls)) => {
                finish = finish.as_ref().map(called_finish);
                let calls: Vec<Value> = calls.iter().map(ToolCall::to_json).collect();
                let content = Some(&self.echo).filter(|e| !e.is_empty());
                json!({"role": "assistant", "content": content, "tool_calls": calls})
            }
            _ => json!({"role": "assistant", "content": format!("{}{}", self.echo, c.text)}),
        };
        let mut choice = json!({
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(&c.token_ids, &c.logprobs),
            "finish_reason": finish.as_ref().map(|f| f.finish_reason.clone()),
            "stop_reason": finish.and_then(|f| f.stop_reason),
        });
        if self.prompt_token_ids.is_some() {
            choice["token_ids"] = json!(c.token_ids);
        }
        choice
    }

    /// A stream chunk of choice `index` with `delta`.
    fn chunk(&self, index: usize, delta: Value, logprobs: Value, finish: Option<&Finish>) -> Value {
        let choice = json!({
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish.map(|f| f.finish_reason.clone()),
            "stop_reason": finish.and_then(|f| f.stop_reason.clone()),
        });
        self.object("chat.completion.chunk", vec![choice], None)
    }

    /// The chat API's logprobs of tokens `ids` (`{"content": [...]}`,
    /// entries as [`generate::token_logprobs`]); `null` when none were
    /// asked for.
    fn logprobs(&self, ids: &[u32], logprobs: &[Logprobs]) -> Value {
        content_logprobs(generate::token_logprobs(self.names(), ids, logprobs))
    }

    /// How the logprobs name tokens.
    fn names(&self) -> TokenNames<'_> {
        TokenNames::new(&self.app.tokenizer, self.as_ids)
    }
}

/// Logprob entries as the chat API's `logprobs`: `null` when there are
/// none (none were asked for).
fn content_logprobs(entries: Vec<Value>) -> Value {
    if entries.is_empty() {
        return Value::Null;
    }
    json!({ "content": entries })
}

impl ChunkFormat for Format {
    fn opening(&self, index: usize) -> Option<Value> {
        let delta = json!({"role": "assistant", "content": self.echo});
        let choice =
            json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null});
        let mut chunk = self.object("chat.completion.chunk", vec![choice], None);
        if let Some(ids) = &self.prompt_token_ids {
            chunk["prompt_token_ids"] = json!(ids);
        }
        Some(chunk)
    }

    fn delta(&mut self, index: usize, delta: &Delta) -> Option<Value> {
        if self.prompt_token_ids.is_none() {
            return self.delta_chunk(index, delta);
        }
        if self.unsent_ids.len() <= index {
            self.unsent_ids.resize_with(index + 1, Vec::new);
        }
        self.unsent_ids[index].extend_from_slice(&delta.token_ids);
        let mut chunk = self.delta_chunk(index, delta)?;
        chunk["choices"][0]["token_ids"] = json!(std::mem::take(&mut self.unsent_ids[index]));
        Some(chunk)
    }

    fn usage(&self, usage: Usage) -> Value {
        self.object("chat.completion.chunk", Vec::new(), Some(usage))
    }
}

impl Format {
    /// The chunk carrying one delta of choice `index`, if it is sent now
    /// (see [`ChunkFormat::delta`]).
    fn delta_chunk(&mut self, index: usize, delta: &Delta) -> Option<Value> {
        let finish = delta.finish.as_ref();
        let Some(tools) = &self.tools else {
            let logprobs = self.logprobs(&delta.token_ids, &delta.logprobs);
            return Some(self.chunk(index, json!({"content": delta.text}), logprobs, finish));
        };
        if self.streams.len() <= index {
            self.streams.resize_with(index + 1, StreamedAnswer::default);
        }
        let entries = generate::token_logprobs(self.names(), &delta.token_ids, &delta.logprobs);
        let state = &mut self.streams[index];
        let (events, mut logprobs) = match state.push(tools, &delta.text, entries) {
            Piece::Text { text, logprobs } => {
                let logprobs = content_logprobs(logprobs);
                return Some(self.chunk(index, json!({"content": text}), logprobs, finish));
            }
            Piece::Calls { events, logprobs } => (events, logprobs),
        };
        let calls = call_deltas(&self.id, events);
        let Some(finish) = finish else {
            let calls = calls?;
            let logprobs = content_logprobs(logprobs);
            return Some(self.chunk(index, json!({"tool_calls": calls}), logprobs, None));
        };
        let called = state.called();
        let (answer, held) = state.finish(tools, &self.id);
        logprobs.extend(held);
        let delta = match (answer, calls) {
            (Answer::Text(text), _) if !called => json!({"content": text}),
            (_, Some(calls)) => json!({"tool_calls": calls}),
            (_, None) => json!({}),
        };
        let logprobs = content_logprobs(logprobs);
        let finish = if called {
            called_finish(finish)
        } else {
            finish.clone()
        };
        Some(self.chunk(index, delta, logprobs, Some(&finish)))
    }
}

impl ChatCompletionRequest {
    /// How its messages become its prompt.
    fn rendering(&self) -> params::ChatRendering<'_> {
        params::ChatRendering {
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            kwargs: self.chat_template_kwargs.as_ref(),
            documents: self.documents.as_deref(),
            add_special_tokens: self.add_special_tokens,
        }
    }
}
