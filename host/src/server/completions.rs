//! `POST /v1/completions`: prompts (text or token ids, one or a batch) in,
//! `text_completion` objects or their stream chunks out.
//!
//! `echo` prepends each choice's prompt to its text (in a stream, to its
//! first chunk) and, with `logprobs`, the prompt tokens' logprobs to its
//! logprobs (the first `null`, as OpenAI's legacy API has it); with
//! `max_tokens: 0` the choice is its prompt alone (a scoring request).
//! vLLM's `prompt_logprobs` adds a `prompt_logprobs` list to each choice.
//! Both come from the prefill the request runs anyway (the engine computes
//! the LM head on the prompt positions of the requests that ask).

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
use super::generate::{self, clamp_logprob, prompt_logprobs_json, Choice, TokenNames};
use super::limits;
use super::params::{self, PromptInput};
use super::protocol::{AnswerRequest, CompletionRequest, SamplingRequest, Usage};
use super::sse::{self, ChunkFormat};
use super::structured;
use super::AppState;
use crate::engine::Delta;
use crate::step::{Logprobs, PromptLogprob};
use crate::tokenizer::Tokenizer;

/// vLLM's and OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: u32 = 16;

/// The handler; an error becomes its OpenAI-style response.
pub async fn create(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = super::request_object(body)?;
    let max_model_len = app.client.max_model_len();
    limits::check_completion(&body, &app.config, max_model_len)?;
    fields::check_fields(&body, Endpoint::Completions)?;
    let req: CompletionRequest = params::typed(&body)?;
    let answer: AnswerRequest = params::typed(&body)?;
    app.check_model(answer.model.as_deref())?;
    let id = app.answer_id("cmpl", &headers, answer.request_id.as_deref())?;
    let constraint = structured::from_fields(
        answer.response_format.as_ref(),
        answer.structured_outputs.as_ref(),
    )?;
    let mut sampling: SamplingRequest = params::typed(&body)?;
    if answer.stream && sampling.prompt_logprobs.is_some() {
        return Err(ApiError::field(
            "prompt_logprobs",
            "is not available with `stream: true` (as in vLLM); `echo` with `logprobs` streams the prompt's",
        ));
    }
    // `max_tokens: 0` with `echo` scores the prompt: the engine runs one
    // token (its least) and the answer leaves it out.
    let prompt_only = req.echo && sampling.max_completion_tokens.or(sampling.max_tokens) == Some(0);
    if prompt_only {
        sampling.max_completion_tokens = None;
        sampling.max_tokens = Some(1);
    }
    let mut params =
        params::sampling_params(&sampling, req.logprobs, DEFAULT_MAX_TOKENS, &app.tokenizer)?;
    let features = [
        (req.echo, "echo"),
        (constraint.is_some(), "response_format"),
    ];
    let beam = BeamSearch::requested(&answer, &params, &features)?;
    // Echoed logprobs are the prompt logprobs, computed in the prefill.
    if let Some(k) = req.logprobs.filter(|_| req.echo) {
        params.prompt_logprobs = Some(params.prompt_logprobs.map_or(k, |p| p.max(k)));
    }
    let inputs = params::prompts_of(&req.prompt)?;
    let keep = params::truncation(&sampling, max_model_len)?;
    let mut echo_texts: Vec<String> = if req.echo {
        inputs
            .iter()
            .map(|p| match p {
                PromptInput::Text(text) => text.clone(),
                PromptInput::Tokens(ids) => app.tokenizer.decode(ids, false).unwrap_or_default(),
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut prompts = inputs
        .into_iter()
        .map(|p| app.tokenize_prompt(p, req.add_special_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, prompt) in prompts.iter_mut().enumerate() {
        if params::truncate_prompt(prompt, keep) && req.echo {
            // The echo is the prompt the model saw.
            echo_texts[i] = app.tokenizer.decode(prompt, false).unwrap_or_default();
        }
    }
    let one = prompts.len() == 1;
    let max_tokens = (sampling.max_tokens_field(), params.max_tokens);
    for (i, prompt) in prompts.iter().enumerate() {
        let field = match (keep, one) {
            (Some(_), _) => "truncate_prompt_tokens".to_string(),
            (None, true) => "prompt".to_string(),
            (None, false) => format!("prompt[{i}]"),
        };
        limits::check_context(&field, prompt.len(), max_tokens, max_model_len)?;
    }
    app.constrain(&mut params, constraint, &sampling).await?;
    let return_token_ids = answer.return_token_ids.unwrap_or(false);
    let prompt_ids = Prompts {
        token_ids: match req.echo || return_token_ids {
            true => prompts.clone(),
            false => Vec::new(),
        },
        n: params.n.max(1) as usize,
    };
    let echo = req.echo.then_some(echo_texts);
    let extras = generate::Extras::of(&sampling);
    // The engine requests get ids of the server's own, unique even when
    // clients reuse a name.
    let engine_id = app.next_request_id("cmpl");
    let format = Format {
        id,
        created: super::unix_now(),
        app: app.clone(),
        logprobs: req.logprobs,
        prompt_logprobs: sampling.prompt_logprobs,
        prompts: prompt_ids,
        echo,
        return_token_ids,
        as_ids: answer.return_tokens_as_token_ids.unwrap_or(false),
        first_sent: Vec::new(),
    };
    if let Some(beam) = beam {
        let (choices, usage) = beam.run(&app, &engine_id, prompts, extras).await?;
        let choices: Vec<Value> = choices.iter().map(|c| format.choice(c, true)).collect();
        return Ok(Json(format.object(choices, Some(usage))).into_response());
    }
    let mut seqs = generate::start(&app, &engine_id, prompts, &params, extras).await?;
    if prompt_only {
        seqs.iter_mut()
            .for_each(generate::Sequence::set_prompt_only);
    }
    if answer.stream {
        let options = answer.stream_options.unwrap_or_default();
        return Ok(sse::stream(app.clone(), seqs, format, options));
    }
    let (choices, usage) = generate::collect(&app, seqs).await?;
    let choices: Vec<Value> = choices.iter().map(|c| format.choice(c, true)).collect();
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

/// The prompts' tokens, kept when the answer shows them (`echo`,
/// `return_token_ids`).
struct Prompts {
    /// Each prompt's token ids; empty when not kept.
    token_ids: Vec<Vec<u32>>,
    /// Choices per prompt: choice `i` answers prompt `i / n`.
    n: usize,
}

impl Prompts {
    /// The token ids of the prompt choice `index` answers, if kept.
    fn of(&self, index: usize) -> Option<&Vec<u32>> {
        self.token_ids.get(index / self.n)
    }
}

/// Words the answer's objects.
struct Format {
    id: String,
    created: u64,
    app: Arc<AppState>,
    /// The request's `logprobs`.
    logprobs: Option<u32>,
    /// The request's `prompt_logprobs`.
    prompt_logprobs: Option<u32>,
    /// The prompts' tokens, when echoed or returned.
    prompts: Prompts,
    /// The prompts' texts (token-id prompts decoded), when echoed.
    echo: Option<Vec<String>>,
    /// vLLM's `return_token_ids`.
    return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`.
    as_ids: bool,
    /// Which choices' streams have sent their first chunk (the one that
    /// echoes and returns the prompt), by index.
    first_sent: Vec<bool>,
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

    /// Choice `c`; when `first` (the whole answer, or a stream's first
    /// chunk of the choice), its prompt echoed first and its prompt's
    /// token ids returned, where asked for.
    fn choice(&self, c: &Choice, first: bool) -> Value {
        let finish = c.finish.as_ref();
        let prompt_ids = self.prompts.of(c.index).filter(|_| first);
        let echo = self
            .echo
            .as_ref()
            .filter(|_| first)
            .and_then(|texts| texts.get(c.index / self.prompts.n));
        let text = match echo {
            Some(p) => format!("{p}{}", c.text),
            None => c.text.clone(),
        };
        let echoed_ids = prompt_ids.filter(|_| echo.is_some() && self.logprobs.is_some());
        let logprobs = (!c.logprobs.is_empty() || echoed_ids.is_some()).then(|| {
            let empty = Vec::new();
            let prompt_lps = c.prompt_logprobs.as_ref().unwrap_or(&empty);
            self.logprobs(echoed_ids, prompt_lps, &c.token_ids, &c.logprobs)
        });
        let mut choice = json!({
            "index": c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish.map(|f| f.finish_reason.clone()),
            "stop_reason": finish.and_then(|f| f.stop_reason.clone()),
        });
        if let (Some(k), Some(entries)) = (self.prompt_logprobs, &c.prompt_logprobs) {
            choice["prompt_logprobs"] = prompt_logprobs_json(self.tokenizer(), entries, k);
        }
        if self.return_token_ids {
            choice["prompt_token_ids"] = json!(prompt_ids);
            choice["token_ids"] = json!(c.token_ids);
        }
        choice
    }

    /// OpenAI's legacy logprobs object: parallel lists of tokens, their
    /// logprobs, the top alternatives (token → logprob) and text offsets.
    /// With an echoed prompt, its tokens come first: the first with `null`s
    /// (nothing precedes it), the others with their prompt logprobs and
    /// the prompt token itself among the alternatives (as vLLM gives them).
    fn logprobs(
        &self,
        prompt: Option<&Vec<u32>>,
        prompt_lps: &[PromptLogprob],
        ids: &[u32],
        logprobs: &[Logprobs],
    ) -> Value {
        let k = self.logprobs.unwrap_or(0) as usize;
        let names = TokenNames::new(self.tokenizer(), self.as_ids);
        let tok = |t: u32| names.name(t);
        let mut tokens = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top = Vec::new();
        if let Some(prompt) = prompt {
            for (i, &t) in prompt.iter().enumerate() {
                tokens.push(tok(t));
                // Entry j is prompt token j + 1's.
                let lp = i.checked_sub(1).and_then(|j| prompt_lps.get(j));
                token_logprobs.push(lp.map_or(Value::Null, |e| json!(clamp_logprob(e.logprob))));
                top.push(lp.map_or(Value::Null, |e| {
                    let mut m = serde_json::Map::with_capacity(k + 1);
                    m.insert(tok(e.token), json!(clamp_logprob(e.logprob)));
                    for &(t, l) in e.top.iter().take(k) {
                        m.entry(tok(t)).or_insert_with(|| json!(clamp_logprob(l)));
                    }
                    Value::Object(m)
                }));
            }
        }
        tokens.extend(ids.iter().map(|&t| tok(t)));
        token_logprobs.extend(logprobs.iter().map(|lp| json!(lp.logprob)));
        top.extend(
            logprobs
                .iter()
                .map(|lp| Value::Object(lp.top.iter().map(|&(t, l)| (tok(t), json!(l))).collect())),
        );
        let mut offset = 0;
        let text_offset: Vec<usize> = tokens
            .iter()
            .map(|t| {
                let at = offset;
                offset += t.len();
                at
            })
            .collect();
        json!({
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        })
    }
}

impl ChunkFormat for Format {
    fn opening(&self, _index: usize) -> Option<Value> {
        None
    }

    fn delta(&mut self, index: usize, delta: &Delta) -> Option<Value> {
        let choice = Choice {
            index,
            text: delta.text.clone(),
            token_ids: delta.token_ids.clone(),
            logprobs: delta.logprobs.clone(),
            prompt_logprobs: delta.prompt_logprobs.clone(),
            finish: delta.finish.clone(),
            prediction_tokens: delta.prediction_tokens,
        };
        // The prompt is echoed and returned in each choice's first chunk.
        if self.first_sent.len() <= index {
            self.first_sent.resize(index + 1, false);
        }
        let first = !std::mem::replace(&mut self.first_sent[index], true);
        Some(self.object(vec![self.choice(&choice, first)], None))
    }

    fn usage(&self, usage: Usage) -> Value {
        self.object(Vec::new(), Some(usage))
    }
}
