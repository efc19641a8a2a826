//! One HTTP request's engine requests: its prompts × `n` choices each become
//! an engine-core request (`<id>-<choice>`), read back through the
//! frontend's `RequestState` (detokenizer + stop strings) into text deltas.
//!
//! A `Sequence` owns its engine output stream, so dropping it (the client
//! went away, or the HTTP request failed) aborts the engine request and
//! frees its KV blocks.
//!
//! The scheduler accepts or refuses a request on the engine core's thread,
//! so a refusal arrives on the stream. `start` waits for each request's
//! first output before answering, so a refused request is an HTTP 400 even
//! when it asked to be streamed (the stream's headers are not sent yet).

use crate::engine::{
    Delta, EngineCoreError, EngineCoreOutput, EngineCoreRequest, Finish, OutputStream,
    PredictionTokens, RequestState,
};
use crate::sampling::SamplingParams;
use crate::step::{Logprobs, PromptLogprob};
use crate::tokenizer::Tokenizer;

use serde_json::{json, Value};

use super::error::ApiError;
use super::protocol::{PromptTokens, SamplingRequest, Usage};
use super::AppState;

/// What every engine request of one API request carries besides its
/// prompt and sampling parameters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    /// Scheduling priority under the priority policy (smaller runs first).
    pub priority: i32,
    /// The client's predicted output (chat's `prediction`), drafted from by
    /// every choice; empty for none.
    pub prediction: &'a [u32],
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<&'a str>,
}

impl<'a> Extras<'a> {
    /// The priority and cache salt of a request's sampling fields, without
    /// a prediction (`limits::check_sampling` refused an empty or
    /// oversized salt).
    pub fn of(sampling: &'a SamplingRequest) -> Self {
        Extras {
            priority: sampling.priority.unwrap_or(0),
            prediction: &[],
            cache_salt: sampling.cache_salt.as_deref(),
        }
    }
}

/// One choice of an answer in flight.
pub struct Sequence {
    /// The choice's index in the answer (`prompt * n + sample`).
    pub index: usize,
    /// Tokens of its prompt.
    pub num_prompt_tokens: usize,
    /// Of those, the ones the prefix cache served, known once the engine
    /// took the request (`start` returned).
    pub num_cached_tokens: usize,
    /// Which of its prompt's `n` samples it is.
    sample: usize,
    stream: OutputStream,
    state: RequestState,
    /// The first output, read by `start` to learn whether the engine took
    /// the request.
    first: Option<EngineCoreOutput>,
    /// Inter-token latencies already handed to the metrics.
    itl_seen: usize,
    done: bool,
    /// Runs the prompt only (`max_tokens: 0` with `echo`): the one token
    /// the engine generates is dropped and the choice ends as `length`.
    prompt_only: bool,
}

/// Queues one engine request per prompt and choice, each with `extras`,
/// and waits until the engine produced the first output of each (or
/// refused one). On error the requests already queued are dropped, which
/// aborts them. Refused with 429 when the requests would not fit
/// `server.max_waiting_requests`.
pub async fn start(
    app: &AppState,
    request_id: &str,
    prompts: Vec<Vec<u32>>,
    params: &SamplingParams,
    extras: Extras<'_>,
) -> Result<Vec<Sequence>, ApiError> {
    app.check_serving()?;
    let n = params.n as usize;
    // Admission: every engine request about to be queued holds a slot
    // until its first output, so past `server.max_waiting_requests` this
    // is a 429 before anything reaches the engine.
    let mut waiting = app.admission.admit(prompts.len().saturating_mul(n))?;
    let mut seqs = Vec::with_capacity(prompts.len() * n);
    for (p, prompt) in prompts.into_iter().enumerate() {
        for j in 0..n {
            let index = p * n + j;
            let sampling_params = params.child(j as u32);
            let state = RequestState::new(&app.tokenizer, &sampling_params);
            let num_prompt_tokens = prompt.len();
            let stream = app.client.add_request(EngineCoreRequest {
                request_id: format!("{request_id}-{index}"),
                prompt_token_ids: prompt.clone(),
                sampling_params,
                priority: extras.priority,
                output_token_ids: Vec::new(),
                prediction: extras.prediction.to_vec(),
                cache_salt: extras.cache_salt.map(str::to_string),
            })?;
            seqs.push(Sequence {
                index,
                num_prompt_tokens,
                num_cached_tokens: 0,
                sample: j,
                stream,
                state,
                first: None,
                itl_seen: 0,
                done: false,
                prompt_only: false,
            });
        }
    }
    for seq in &mut seqs {
        seq.first = Some(match seq.stream.next().await {
            Some(Ok(out)) => {
                seq.num_cached_tokens = out.num_cached_tokens as usize;
                out
            }
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::from(EngineCoreError::Dead(
                    "the request's stream closed".into(),
                )))
            }
        });
        waiting.release_one();
    }
    Ok(seqs)
}

impl Sequence {
    /// Drops what the engine generates: the choice is its prompt only
    /// (completions' `echo` with `max_tokens: 0`; the engine runs one
    /// token, the least it runs).
    pub fn set_prompt_only(&mut self) {
        self.prompt_only = true;
    }

    /// The next non-empty delta; `None` after the one that finished the
    /// choice. Latencies go to the metrics as they are measured.
    pub async fn next_delta(&mut self, app: &AppState) -> Option<Result<Delta, ApiError>> {
        while !self.done {
            let next = match self.first.take() {
                Some(out) => Some(Ok(out)),
                None => self.stream.next().await,
            };
            let out = match next {
                Some(Ok(out)) => out,
                Some(Err(e)) => return Some(Err(self.fail(e.into()))),
                None => {
                    let e = ApiError::internal(
                        "the engine closed the request's output stream before it finished",
                    );
                    return Some(Err(self.fail(e)));
                }
            };
            let mut delta = match self.state.process(&out) {
                Ok(delta) => delta,
                Err(e) => {
                    return Some(Err(
                        self.fail(ApiError::internal(format!("detokenizing: {e}")))
                    ))
                }
            };
            if self.prompt_only {
                delta.text.clear();
                delta.token_ids.clear();
                delta.logprobs.clear();
                if let Some(f) = delta.finish.as_mut().filter(|f| f.error.is_none()) {
                    f.finish_reason = "length".into();
                    f.stop_reason = None;
                }
            }
            let itls = &self.state.metrics().inter_token_latencies_s;
            app.metrics
                .observe_itl(self.stream.rank(), &itls[self.itl_seen..]);
            self.itl_seen = itls.len();
            if let Some(finish) = &delta.finish {
                if let Some(error) = &finish.error {
                    // The engine failed this request (a plugin fault): a 500,
                    // or an error event once a stream's headers are sent.
                    app.metrics.observe_finished(
                        self.stream.rank(),
                        self.state.metrics(),
                        &finish.finish_reason,
                    );
                    return Some(Err(self.fail(ApiError::internal(error.clone()))));
                }
                self.done = true;
                app.metrics.observe_finished(
                    self.stream.rank(),
                    self.state.metrics(),
                    &finish.finish_reason,
                );
                if out.finish_reason.is_none() {
                    // A stop string ended it here; the engine core still runs it.
                    app.client
                        .abort_requests(vec![self.stream.request_id().to_string()]);
                }
            }
            if !delta.text.is_empty()
                || !delta.token_ids.is_empty()
                || delta.finish.is_some()
                || delta.prompt_logprobs.is_some()
            {
                return Some(Ok(delta));
            }
        }
        None
    }

    fn fail(&mut self, e: ApiError) -> ApiError {
        self.done = true;
        e
    }
}

/// Prompt tokens of an answer: each prompt counted once, by its first
/// sample, however many samples were drawn from it.
pub fn prompt_tokens(seqs: &[Sequence]) -> PromptTokens {
    seqs.iter()
        .filter(|s| s.sample == 0)
        .fold(PromptTokens::default(), |sum, s| PromptTokens {
            total: sum.total + s.num_prompt_tokens,
            cached: sum.cached + s.num_cached_tokens,
        })
}

/// A finished choice.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    /// Its index in the answer.
    pub index: usize,
    /// The text (stop string removed unless asked to keep it).
    pub text: String,
    /// The tokens generated.
    pub token_ids: Vec<u32>,
    /// Their logprobs, when asked for.
    pub logprobs: Vec<Logprobs>,
    /// Logprobs of prompt tokens 1.., once they arrived (with the first
    /// delta), when asked for.
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    /// Why it ended.
    pub finish: Option<Finish>,
    /// How its predicted output fared (`None` without one).
    pub prediction_tokens: Option<PredictionTokens>,
}

impl Choice {
    /// Appends a delta.
    pub fn push(&mut self, delta: Delta) {
        self.text.push_str(&delta.text);
        self.token_ids.extend(delta.token_ids);
        self.logprobs.extend(delta.logprobs);
        if delta.prompt_logprobs.is_some() {
            self.prompt_logprobs = delta.prompt_logprobs;
        }
        if delta.finish.is_some() {
            self.finish = delta.finish;
        }
        if delta.prediction_tokens.is_some() {
            self.prediction_tokens = delta.prediction_tokens;
        }
    }
}

/// Runs every sequence to its end and returns the choices in index order
/// with the answer's token counts.
pub async fn collect(
    app: &AppState,
    seqs: Vec<Sequence>,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut choices = Vec::with_capacity(seqs.len());
    let prompt_tokens = prompt_tokens(&seqs);
    // The engine runs them all at once; awaiting them in turn only orders
    // the reading. Unread ones stay alive (not aborted) meanwhile.
    let mut seqs = seqs;
    for seq in &mut seqs {
        let mut choice = Choice {
            index: seq.index,
            ..Choice::default()
        };
        while let Some(delta) = seq.next_delta(app).await {
            choice.push(delta?);
        }
        choices.push(choice);
    }
    let completion_tokens = choices.iter().map(|c| c.token_ids.len()).sum();
    let usage = Usage::new(prompt_tokens, completion_tokens)
        .with_predictions(choices.iter().map(|c| c.prediction_tokens));
    Ok((choices, usage))
}

/// The text of one token as the logprobs fields show it.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer
        .decode(&[id], false)
        .unwrap_or_else(|_| format!("<token {id}>"))
}

/// How the logprobs fields name a token: by its text, or `token_id:<id>`
/// (vLLM's `return_tokens_as_token_ids`).
#[derive(Clone, Copy)]
pub struct TokenNames<'a> {
    tokenizer: &'a Tokenizer,
    as_ids: bool,
}

impl<'a> TokenNames<'a> {
    /// Names tokens by their text, or by id when `as_ids`.
    pub fn new(tokenizer: &'a Tokenizer, as_ids: bool) -> Self {
        TokenNames { tokenizer, as_ids }
    }

    /// Token `id`'s name.
    pub fn name(&self, id: u32) -> String {
        match self.as_ids {
            true => format!("token_id:{id}"),
            false => token_text(self.tokenizer, id),
        }
    }
}

/// Generated tokens' logprobs as the chat and Responses APIs give them:
/// per token its name, `logprob` and the name's UTF-8 `bytes`, and its
/// `top_logprobs` alternatives likewise.
pub fn token_logprobs(names: TokenNames, ids: &[u32], logprobs: &[Logprobs]) -> Vec<Value> {
    let entry = |id: u32, logprob: f32| {
        let token = names.name(id);
        json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
    };
    ids.iter()
        .zip(logprobs)
        .map(|(&id, lp)| {
            let mut e = entry(id, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect()
}

/// vLLM's `prompt_logprobs` of a choice: `null` for the first prompt token
/// (nothing precedes it), then for each later one an object keyed by token
/// id holding the prompt token and the `k` most likely tokens at its
/// position, each with its `logprob`, `rank` and `decoded_token`.
pub fn prompt_logprobs_json(tokenizer: &Tokenizer, entries: &[PromptLogprob], k: u32) -> Value {
    let entry = |t: u32, logprob: f32, rank: u32| {
        json!({
            "logprob": clamp_logprob(logprob),
            "rank": rank,
            "decoded_token": token_text(tokenizer, t),
        })
    };
    let mut out = Vec::with_capacity(entries.len() + 1);
    out.push(Value::Null);
    for e in entries {
        let mut m = serde_json::Map::with_capacity(k as usize + 1);
        m.insert(e.token.to_string(), entry(e.token, e.logprob, e.rank));
        for (i, &(t, l)) in e.top.iter().take(k as usize).enumerate() {
            m.entry(t.to_string())
                .or_insert_with(|| entry(t, l, i as u32 + 1));
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// A logprob as JSON can carry it: -inf (a masked or impossible token)
/// becomes -9999, as in vLLM and OpenAI.
pub fn clamp_logprob(l: f32) -> f32 {
    l.max(-9999.0)
}
