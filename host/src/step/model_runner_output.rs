//! What a worker hands back for one step (vLLM's `ModelRunnerOutput`): the
//! token each request sampled and, where asked for, its logprobs. It is
//! serde so it can cross the message queue from a worker process.

use serde::{Deserialize, Serialize};

use super::{NewTokens, ReqHandle};

/// The sampled token's logprob and the most likely alternatives, under the
/// raw model output (vLLM's `raw_logprobs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    /// `log_softmax(logits)[sampled token]`.
    pub logprob: f32,
    /// `(token, logprob)` of the `SamplingParams::logprobs` most likely
    /// tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One prompt token's logprob under the raw model output, with the most
/// likely tokens at its position (vLLM's `prompt_logprobs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptLogprob {
    /// The prompt token.
    pub token: u32,
    /// `log_softmax(logits of the previous position)[token]`.
    pub logprob: f32,
    /// 1 + the number of tokens more likely than `token` there.
    pub rank: u32,
    /// `(token, logprob)` of the `SamplingParams::prompt_logprobs` most
    /// likely tokens there, most likely first (rank `i + 1`).
    pub top: Vec<(u32, f32)>,
}

/// The prompt logprobs one step computed for one request: those of prompt
/// tokens `start..start + entries.len()` (never token 0, which has no
/// previous position). A prompt's arrive in order, over the steps of its
/// chunked prefill, each token once.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptLogprobs {
    /// Index in the prompt of the first token covered (at least 1).
    pub start: u32,
    /// One entry per prompt token, in order.
    pub entries: Vec<PromptLogprob>,
}

/// One step's sampled tokens.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRunnerOutput {
    /// Each request that reached the end of its known tokens, with the token
    /// it sampled, or the tokens a speculating request kept (its accepted
    /// drafts and the token sampled after them), in order.
    pub sampled: Vec<(ReqHandle, NewTokens)>,
    /// Parallel to `sampled`: one entry per sampled token for the requests
    /// that asked for logprobs, empty for the others.
    pub logprobs: Vec<Vec<Logprobs>>,
    /// Requests that could not be sampled this step, with why (a logits
    /// processor faulted on their rows under `plugins.on_error = "fail"`).
    /// The scheduler finishes them with an error; the others carry on.
    #[serde(default)]
    pub failed: Vec<(ReqHandle, String)>,
    /// The prompt logprobs computed this step, for the requests that asked
    /// for them (`SamplingParams::prompt_logprobs`) and prefilled part of
    /// their prompt; a request is listed at most once.
    #[serde(default)]
    pub prompt_logprobs: Vec<(ReqHandle, PromptLogprobs)>,
    /// Faults of the worker's plugins (logits processors, sampler) since
    /// its previous output, by qualified name; each fault recreated the
    /// instance. A plugin is listed once with 0 when it first runs, so the
    /// engine's counters know every plugin in use.
    #[serde(default)]
    pub plugin_faults: Vec<(String, u64)>,
}

impl ModelRunnerOutput {
    /// A step in which every request of `handles` failed with `message`.
    pub fn failed(handles: impl Iterator<Item = ReqHandle>, message: &str) -> ModelRunnerOutput {
        ModelRunnerOutput {
            failed: handles.map(|h| (h, message.to_string())).collect(),
            ..ModelRunnerOutput::default()
        }
    }

    /// Why `h` failed this step, if it did.
    pub fn failure_of(&self, h: ReqHandle) -> Option<&str> {
        self.failed
            .iter()
            .find(|(f, _)| *f == h)
            .map(|(_, m)| m.as_str())
    }

    /// The logprobs of the tokens sampled for `h` this step: one per token
    /// if it asked for them, else none.
    pub fn logprobs_of(&self, h: ReqHandle) -> &[Logprobs] {
        // Only requests that asked carry logprobs, so the scan is skipped
        // in the common case.
        if self.logprobs.iter().all(Vec::is_empty) {
            return &[];
        }
        match self.sampled.iter().position(|(s, _)| *s == h) {
            Some(i) => &self.logprobs[i],
            None => &[],
        }
    }
}
