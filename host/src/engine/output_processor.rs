//! The frontend's per-request text path (vLLM's `RequestState` in the
//! `OutputProcessor`): engine-core outputs in, text deltas out, through the
//! incremental detokenizer and the stop-string checker, with the request's
//! latency figures (time to first token, inter-token latencies) taken as the
//! outputs arrive. The offline API and the HTTP server both use it.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::core::EngineCoreOutput;
use crate::sampling::{SamplingParams, StopChecker};
use crate::scheduler::{FinishReason, PredictionTokens};
use crate::step::{Logprobs, PromptLogprob};
use crate::tokenizer::{IncrementalDetokenizer, Tokenizer, TokenizerError};

/// Why a completion ended, as the OpenAI API and vLLM report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finish {
    /// `"stop"`, `"length"`, `"abort"` or `"error"`.
    pub finish_reason: String,
    /// The stop string or stop token id that matched, if any.
    pub stop_reason: Option<serde_json::Value>,
    /// Why the request failed, when `finish_reason` is `"error"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What one engine-core output added to a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// New text (held back while it might be the start of a stop string).
    pub text: String,
    /// The tokens this output carried.
    pub token_ids: Vec<u32>,
    /// Their logprobs, when the request asked for them.
    pub logprobs: Vec<Logprobs>,
    /// Set on the request's last delta. A stop string ends the request here
    /// while the engine core still runs it: the caller aborts it there.
    pub finish: Option<Finish>,
    /// On the request's first delta, when it asked for prompt logprobs:
    /// those of prompt tokens 1.. (token 0 has none), in order.
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    /// How the request's predicted output fared so far (`None` without one).
    pub prediction_tokens: Option<PredictionTokens>,
}

/// Latency figures of one request, in seconds, for the metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestMetrics {
    /// From arrival to the first generated token.
    pub time_to_first_token_s: Option<f64>,
    /// Between consecutive outputs after the first (one token per step
    /// here). Kept out of serialized results, which would be mostly this.
    #[serde(skip)]
    pub inter_token_latencies_s: Vec<f64>,
    /// From arrival to the latest output: the end-to-end latency once the
    /// request finished.
    pub e2e_latency_s: Option<f64>,
}

/// The frontend's state of one live request.
pub struct RequestState {
    detok: IncrementalDetokenizer,
    stops: StopChecker,
    arrival: Instant,
    last_output: Option<Instant>,
    metrics: RequestMetrics,
    finished: bool,
    /// Prompt logprobs received so far, until the first delta takes them.
    prompt_logprobs: Option<Vec<PromptLogprob>>,
}

impl RequestState {
    /// The state of a request that arrives now.
    pub fn new(tokenizer: &Tokenizer, params: &SamplingParams) -> RequestState {
        RequestState {
            detok: tokenizer.detokenizer(params.skip_special_tokens),
            stops: StopChecker::from_params(params),
            arrival: Instant::now(),
            last_output: None,
            metrics: RequestMetrics::default(),
            finished: false,
            prompt_logprobs: None,
        }
    }

    /// Feeds the request's next output. A token the tokenizer does not know
    /// is an error (the model and tokenizer disagree).
    pub fn process(&mut self, out: &EngineCoreOutput) -> Result<Delta, TokenizerError> {
        self.record_times(out);
        let mut delta = Delta {
            prediction_tokens: out.prediction_tokens,
            ..Delta::default()
        };
        if let Some(chunk) = &out.new_prompt_logprobs {
            let got = self.prompt_logprobs.get_or_insert_with(Vec::new);
            // Entries arrive in order, each once; one already held (which
            // the engine never sends) is not taken twice.
            let skip = (got.len() + 1).saturating_sub(chunk.start as usize);
            got.extend(chunk.entries.iter().skip(skip).cloned());
        }
        if !out.new_token_ids.is_empty() || out.finish_reason.is_some() {
            delta.prompt_logprobs = self.prompt_logprobs.take();
        }
        for (i, &t) in out.new_token_ids.iter().enumerate() {
            delta.token_ids.push(t);
            delta.logprobs.extend(out.new_logprobs.get(i).cloned());
            let update = self.stops.push(self.detok.push(t)?);
            delta.text.push_str(&update.text);
            if let Some(stop) = update.stop {
                self.finished = true;
                delta.finish = Some(Finish {
                    finish_reason: "stop".into(),
                    stop_reason: Some(stop.into()),
                    error: None,
                });
                return Ok(delta);
            }
        }
        if let Some(reason) = out.finish_reason {
            self.finished = true;
            delta.text.push_str(&self.stops.finish());
            delta.text.push_str(self.detok.finish());
            let stop_reason = match reason {
                FinishReason::StopToken(t) => Some(t.into()),
                _ => None,
            };
            delta.finish = Some(Finish {
                finish_reason: reason.as_str().into(),
                stop_reason,
                error: out.error.clone(),
            });
        }
        Ok(delta)
    }

    /// True once a delta carried a finish.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The latency figures so far.
    pub fn metrics(&self) -> &RequestMetrics {
        &self.metrics
    }

    fn record_times(&mut self, out: &EngineCoreOutput) {
        let now = Instant::now();
        if !out.new_token_ids.is_empty() {
            match self.last_output {
                None => self.metrics.time_to_first_token_s = Some(secs(now - self.arrival)),
                Some(last) => self.metrics.inter_token_latencies_s.push(secs(now - last)),
            }
            self.last_output = Some(now);
        }
        self.metrics.e2e_latency_s = Some(secs(now - self.arrival));
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
