//! The plan of one step: which rows of the logits sample a token, and
//! which rows besides are kept for prompt logprobs or for verifying draft
//! tokens (filled during the forward pass, one row at a time).

use crate::model_runner::LogitsSpan;
use crate::sampling::select::{log_sum_exp, top_k_desc};
use crate::step::{ModelRunnerOutput, PromptLogprob, PromptLogprobs, ReqHandle};

/// The requests of the step being run, in `num_scheduled_tokens` order: which
/// rows of the logits get a token sampled.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Each scheduled request and whether it reached the end of its known
    /// tokens this step (a finished prefill or a decode), so it samples.
    pub(super) rows: Vec<(ReqHandle, bool)>,
    /// The tokens whose logits the step also computes, for prompt logprobs
    /// (one span per request that has prompt tokens to report) and for
    /// draft tokens (one span per speculating request).
    pub spans: Vec<LogitsSpan>,
    /// Parallel to `spans`: what each span's rows are for.
    pub(super) span_requests: Vec<SpanRequest>,
    /// What the prompt-logprobs spans gave, filled by
    /// [`Self::accept_logits_row`] during the forward pass.
    pub(super) prompt_logprobs: Vec<(ReqHandle, PromptLogprobs)>,
    /// The speculating requests' drafts and the logits of their positions.
    pub(super) drafts: Vec<DraftRows>,
    /// Requests this step could not run, with why (prompt logprobs on a
    /// device that does not compute them).
    pub(super) failed: Vec<(ReqHandle, String)>,
    /// Reused by the top-k selection of span rows.
    top_scratch: Vec<(u32, f32)>,
}

/// What a [`LogitsSpan`]'s rows are for.
#[derive(Debug)]
pub(super) enum SpanRequest {
    /// Prompt logprobs, written to `prompt_logprobs[entry]`.
    PromptLogprobs {
        /// `SamplingParams::prompt_logprobs`.
        k: usize,
        /// The prompt tokens the span's rows predict, row `i` predicting
        /// `tokens[i]`.
        tokens: Vec<u32>,
        /// Index in [`StepPlan::prompt_logprobs`].
        entry: usize,
    },
    /// The positions of draft tokens, kept in `drafts[entry]`.
    Drafts {
        /// Index in [`StepPlan::drafts`].
        entry: usize,
    },
}

/// One speculating request of the step: its draft tokens and the logits
/// that verify them, row `i` predicting the token after `i` drafts (row 0
/// the first draft, row `tokens.len()` the token after all of them).
#[derive(Debug)]
pub(super) struct DraftRows {
    /// The request.
    pub(super) handle: ReqHandle,
    /// Its row in [`StepPlan::rows`] (and in the step's last-row logits).
    pub(super) row: usize,
    /// Its draft tokens.
    pub(super) tokens: Vec<u32>,
    /// `tokens.len() + 1` rows of logits once the step is sampled (the
    /// forward pass fills the first `tokens.len()`).
    pub(super) logits: Vec<f32>,
}

impl StepPlan {
    /// A plan that starts with `failed`: the requests refused before the
    /// step was built.
    pub(super) fn new(failed: Vec<(ReqHandle, String)>) -> StepPlan {
        StepPlan {
            failed,
            ..StepPlan::default()
        }
    }

    /// The requests that sample this step, in row order.
    pub fn sampling_handles(&self) -> impl Iterator<Item = ReqHandle> + '_ {
        self.rows
            .iter()
            .filter(|(_, samples)| *samples)
            .map(|(h, _)| *h)
    }

    /// Whether the step computes no other logits than the sampled rows'.
    pub fn is_last_rows_only(&self) -> bool {
        self.spans.is_empty()
    }

    /// Takes row `row` of span `span`'s logits (the runner's sink): the
    /// logprob, rank and top tokens of the prompt token it predicts, or
    /// the row kept to verify a draft.
    pub fn accept_logits_row(&mut self, span: usize, row: usize, logits: &[f32]) {
        match &self.span_requests[span] {
            SpanRequest::PromptLogprobs { k, tokens, entry } => {
                let lp = prompt_logprob(logits, tokens[row], *k, &mut self.top_scratch);
                self.prompt_logprobs[*entry].1.entries.push(lp);
            }
            SpanRequest::Drafts { entry } => self.drafts[*entry].logits.extend_from_slice(logits),
        }
    }

    /// Moves what the step produced besides sampled tokens (prompt
    /// logprobs, the requests it could not run) into `out`.
    pub fn finish_output(&mut self, out: &mut ModelRunnerOutput) {
        out.failed.append(&mut self.failed);
        out.prompt_logprobs.append(&mut self.prompt_logprobs);
    }

    /// Whether the step has nothing to report but failures.
    pub fn has_failures(&self) -> bool {
        !self.failed.is_empty()
    }
}

/// The entry of prompt token `token` from the logits of the position
/// before it: its raw logprob, its rank (vLLM's: the tokens at least as
/// likely, itself included) and the `k` most likely tokens.
pub(super) fn prompt_logprob(
    logits: &[f32],
    token: u32,
    k: usize,
    scratch: &mut Vec<(u32, f32)>,
) -> PromptLogprob {
    let lse = log_sum_exp(logits);
    let logit = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let rank = logits.iter().filter(|&&l| l >= logit).count().max(1) as u32;
    let top = if k > 0 {
        top_k_desc(logits, k, scratch);
        scratch.iter().map(|&(t, l)| (t, l - lse)).collect()
    } else {
        Vec::new()
    };
    PromptLogprob {
        token,
        logprob: logit - lse,
        rank,
        top,
    }
}
