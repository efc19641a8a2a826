//! `POST /v1/completions`: prompts (text or token ids, one or a batch) in,
//! `text_completion` objects or their stream chunks out.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::fields::{self, Endpoint};
use super::generate::{self, token_text, Choice};
use super::limits;
use super::params::{self, PromptInput};
use super::protocol::{CompletionRequest, SamplingRequest, Usage};
use super::sse::{self, ChunkFormat};
use super::AppState;
use crate::engine::Delta;
use crate::step::Logprobs;
use crate::tokenizer::Tokenizer;

/// vLLM's and OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

/// The handler; an error becomes its OpenAI-style response.
pub async fn create(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = super::request_object(body)?;
    let max_model_len = app.client.max_model_len();
    limits::check_completion(&body, &app.config, max_model_len)?;
    fields::check_fields(&body, Endpoint::Completions)?;
    let req: CompletionRequest = params::typed(&body)?;
    app.check_model(req.model.as_deref())?;
    let sampling: SamplingRequest = params::typed(&body)?;
    let params = params::sampling_params(&sampling, req.logprobs, DEFAULT_MAX_TOKENS)?;
    let prompts = params::prompts_of(&req.prompt)?
        .into_iter()
        .map(|p| app.tokenize_prompt(p, req.add_special_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let one = prompts.len() == 1;
    let max_tokens = (sampling.max_tokens_field(), params.max_tokens);
    for (i, prompt) in prompts.iter().enumerate() {
        let field = if one {
            "prompt".to_string()
        } else {
            format!("prompt[{i}]")
        };
        limits::check_context(&field, prompt.len(), max_tokens, max_model_len)?;
    }
    let id = app.next_request_id("cmpl");
    let seqs = generate::start(&app, &id, prompts, &params, sampling.priority.unwrap_or(0)).await?;
    let format = Format {
        id,
        created: super::unix_now(),
        app: app.clone(),
    };
    if req.stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse::stream(app.clone(), seqs, format, include_usage));
    }
    let (choices, usage) = generate::collect(&app, seqs).await?;
    let choices: Vec<Value> = choices.iter().map(|c| format.choice(c)).collect();
    Ok(Json(format.object(choices, Some(usage))).into_response())
}

impl AppState {
    /// A completion prompt's token ids (text tokenized with the special
    /// tokens when `add_special_tokens`); ids outside the vocabulary are
    /// refused.
    fn tokenize_prompt(
        &self,
        prompt: PromptInput,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        match prompt {
            PromptInput::Text(text) => self
                .tokenizer
                .encode(&text, add_special_tokens)
                .map_err(|e| ApiError::field("prompt", e)),
            PromptInput::Tokens(ids) => {
                let vocab = self.tokenizer.vocab_size();
                match ids.iter().find(|&&t| t as usize >= vocab) {
                    Some(t) => Err(ApiError::field(
                        "prompt",
                        format!("token id {t} is outside the vocabulary (ids 0..{vocab})"),
                    )),
                    None => Ok(ids),
                }
            }
        }
    }
}

/// Words the answer's objects.
struct Format {
    id: String,
    created: u64,
    app: Arc<AppState>,
}

impl Format {
    fn tokenizer(&self) -> &Tokenizer {
        &self.app.tokenizer
    }

    fn object(&self, choices: Vec<Value>, usage: Option<Usage>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.app.model_name,
            "choices": choices, "usage": usage,
        })
    }

    fn choice(&self, c: &Choice) -> Value {
        let finish = c.finish.as_ref();
        json!({
            "index": c.index,
            "text": c.text,
            "logprobs": (!c.logprobs.is_empty()).then(|| self.logprobs(&c.token_ids, &c.logprobs)),
            "finish_reason": finish.map(|f| f.finish_reason.clone()),
            "stop_reason": finish.and_then(|f| f.stop_reason.clone()),
        })
    }

    /// OpenAI's legacy logprobs object: parallel lists of tokens, their
    /// logprobs, the top alternatives (token → logprob) and text offsets.
    fn logprobs(&self, ids: &[u32], logprobs: &[Logprobs]) -> Value {
        let tokens: Vec<String> = ids
            .iter()
            .map(|&t| token_text(self.tokenizer(), t))
            .collect();
        let mut offset = 0;
        let text_offset: Vec<usize> = tokens
            .iter()
            .map(|t| {
                let at = offset;
                offset += t.len();
                at
            })
            .collect();
        let top: Vec<serde_json::Map<String, Value>> = logprobs
            .iter()
            .map(|lp| {
                lp.top
                    .iter()
                    .map(|&(t, l)| (token_text(self.tokenizer(), t), json!(l)))
                    .collect()
            })
            .collect();
        json!({
            "tokens": tokens,
            "token_logprobs": logprobs.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": text_offset,
        })
    }
}

impl ChunkFormat for Format {
    fn opening(&self, _index: usize) -> Option<Value> {
        None
    }

    fn delta(&self, index: usize, delta: &Delta) -> Value {
        let choice = Choice {
            index,
            text: delta.text.clone(),
            token_ids: delta.token_ids.clone(),
            logprobs: delta.logprobs.clone(),
            finish: delta.finish.clone(),
        };
        self.object(vec![self.choice(&choice)], None)
    }

    fn usage(&self, usage: Usage) -> Value {
        self.object(Vec::new(), Some(usage))
    }
}
