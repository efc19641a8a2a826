//! One generation request as the scheduler tracks it (vLLM's `Request`).

use std::sync::Arc;

use super::prediction::{Prediction, PredictionTokens};
use crate::kv_cache::RequestBlocks;
use crate::sampling::SamplingParams;

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// The end-of-sequence token was sampled (and `ignore_eos` was off).
    Eos,
    /// One of the request's `stop_token_ids` was sampled.
    StopToken(u32),
    /// `max_tokens` was reached, or the sequence reached `max_model_len`.
    Length,
    /// The request was aborted by the client or the engine.
    Abort,
    /// The request failed (a sampler plugin faulted on its row under
    /// `plugins.on_error = "fail"`); the engine keeps serving the others.
    Error,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string: "stop", "length", "abort" or
    /// "error" (vLLM's `FinishReason.ERROR`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::StopToken(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued, never scheduled.
    Waiting,
    /// In the running batch.
    Running,
    /// Evicted from the running batch; queued again to be recomputed.
    Preempted,
    /// Done; its blocks are freed.
    Finished(FinishReason),
}

/// A request: its tokens, sampling parameters and scheduling state.
#[derive(Debug, Clone)]
pub struct Request {
    pub(super) request_id: Arc<str>,
    /// Prompt followed by output tokens, contiguous so full blocks spanning
    /// the boundary hash without copying.
    pub(super) all_token_ids: Vec<u32>,
    pub(super) num_prompt_tokens: usize,
    pub(super) sampling_params: SamplingParams,
    pub(super) arrival_time: f64,
    pub(super) priority: i32,
    pub(super) status: RequestStatus,
    pub(super) num_computed_tokens: usize,
    /// Tokens scheduled to be sampled by in-flight steps and not yet
    /// received (async scheduling: the next step is scheduled before the
    /// previous one's token is known, so it computes a placeholder the worker
    /// fills in).
    pub(super) num_output_placeholders: usize,
    /// Draft tokens the in-flight step verifies (speculative decoding):
    /// counted in `num_computed_tokens` until the step's tokens say how
    /// many were kept.
    pub(super) num_draft_tokens: usize,
    /// Prefix-cache hit at first admission; `None` before it.
    pub(super) num_cached_tokens: Option<usize>,
    /// The client's guess at the output, drafted from (speculative decoding).
    pub(super) prediction: Option<Box<Prediction>>,
    pub(super) num_preemptions: u32,
    pub(super) kv: RequestBlocks,
    /// Whether the worker has seen this request (it was scheduled at least
    /// once), which decides between "new" and "cached" in the output.
    pub(super) seen_by_worker: bool,
}

impl Request {
    /// A waiting request. `arrival_time` is in seconds on any monotonic
    /// clock the caller uses consistently; a lower `priority` value is served
    /// first by the priority policy (vLLM's convention).
    pub fn new(
        request_id: impl Into<Arc<str>>,
        prompt_token_ids: Vec<u32>,
        sampling_params: SamplingParams,
        arrival_time: f64,
        priority: i32,
    ) -> Self {
        let num_prompt_tokens = prompt_token_ids.len();
        Self {
            request_id: request_id.into(),
            all_token_ids: prompt_token_ids,
            num_prompt_tokens,
            sampling_params,
            arrival_time,
            priority,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            num_output_placeholders: 0,
            num_draft_tokens: 0,
            num_cached_tokens: None,
            prediction: None,
            num_preemptions: 0,
            kv: RequestBlocks::new(None),
            seen_by_worker: false,
        }
    }

    /// The request replayed with the tokens it already generated (its
    /// engine core died): it resumes as a preempted request would, its
    /// output recomputed rather than sampled again.
    pub fn with_output(mut self, output_token_ids: &[u32]) -> Self {
        self.all_token_ids.extend_from_slice(output_token_ids);
        self
    }

    /// The request with the client's guess at its output (OpenAI's
    /// predicted outputs): while the output follows it, its next tokens are
    /// verified as draft tokens. Only tokens within `max_tokens` are kept
    /// (no output reaches past them); an empty prediction is none. Needs
    /// speculative decoding on.
    pub fn with_prediction(mut self, mut tokens: Vec<u32>) -> Self {
        tokens.truncate(self.sampling_params.max_tokens as usize);
        self.prediction = (!tokens.is_empty()).then(|| Box::new(Prediction::new(tokens)));
        self
    }

    /// The request with its cache salt (vLLM's `cache_salt`): it shares
    /// prefix-cache blocks only with requests of the same salt.
    pub fn with_cache_salt(mut self, salt: Option<&str>) -> Self {
        self.kv = RequestBlocks::new(salt.map(crate::kv_cache::cache_salt_key));
        self
    }

    /// Predicted tokens the model kept and those it verified and did not
    /// keep (OpenAI's `accepted_prediction_tokens` and
    /// `rejected_prediction_tokens`); `None` without a prediction.
    pub fn prediction_tokens(&self) -> Option<PredictionTokens> {
        self.prediction.as_ref().map(|p| p.tally())
    }

    /// The caller's request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The prompt's token ids.
    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.all_token_ids[..self.num_prompt_tokens]
    }

    /// Tokens generated so far.
    pub fn output_token_ids(&self) -> &[u32] {
        &self.all_token_ids[self.num_prompt_tokens..]
    }

    /// Prompt and output tokens.
    pub fn all_token_ids(&self) -> &[u32] {
        &self.all_token_ids
    }

    /// Prompt plus output length.
    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    /// Generated token count.
    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.num_prompt_tokens
    }

    /// The sampling parameters.
    pub fn sampling_params(&self) -> &SamplingParams {
        &self.sampling_params
    }

    /// Arrival time in the caller's seconds.
    pub fn arrival_time(&self) -> f64 {
        self.arrival_time
    }

    /// Priority (lower is served first by `builtin:priority`).
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// Current status.
    pub fn status(&self) -> RequestStatus {
        self.status
    }

    /// Tokens whose KV is computed or scheduled to be computed by an
    /// in-flight step (advanced when a step is scheduled, as in vLLM).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    /// Tokens sampled by in-flight steps and not yet received.
    pub fn num_output_placeholders(&self) -> usize {
        self.num_output_placeholders
    }

    /// Whether every token this request may produce is already received or
    /// in flight: the placeholders reach `max_tokens` (admission keeps
    /// prompt + `max_tokens` within `max_model_len`), so scheduling it again
    /// would compute past its end.
    pub(super) fn is_fully_scheduled(&self) -> bool {
        let in_flight = self.num_output_placeholders;
        in_flight > 0
            && self.num_output_tokens() + in_flight >= self.sampling_params.max_tokens as usize
    }

    /// Prompt tokens found in the prefix cache at first admission (0 before).
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.unwrap_or(0)
    }

    /// How many times the request was preempted.
    pub fn num_preemptions(&self) -> u32 {
        self.num_preemptions
    }

    /// The KV block table.
    pub fn block_ids(&self) -> &[u32] {
        self.kv.block_ids()
    }
}
