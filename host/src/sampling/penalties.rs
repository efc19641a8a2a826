//! The logits processors that run before temperature, in vLLM's order
//! (after `token_filters`): min_tokens masking, then repetition, frequency
//! and presence penalties.
//!
//! Both only touch the few tokens a request has seen, so they work on sparse
//! sets instead of vocabulary-sized masks. They record each logit's original
//! value before changing it, so the sampler can still report logprobs of the
//! raw model output.

use std::collections::{HashMap, HashSet, VecDeque};

use super::params::SamplingParams;

/// The tokens one request has seen, as the penalties need them.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    /// Every distinct prompt or output token (repetition penalty).
    seen: HashSet<u32>,
    /// How often each output token occurred (frequency/presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Number of output tokens so far (min_tokens).
    num_output: usize,
    /// The last output tokens, at most `tail_len` of them (bad words match
    /// their earlier tokens against the end of the output).
    tail: VecDeque<u32>,
    /// How many output tokens `tail` keeps.
    tail_len: usize,
}

impl TokenHistory {
    /// A history holding the prompt and no output yet, that keeps the last
    /// `tail_len` output tokens for [`Self::output_ends_with`].
    pub fn new(prompt_token_ids: &[u32], tail_len: usize) -> Self {
        Self {
            seen: prompt_token_ids.iter().copied().collect(),
            tail: VecDeque::with_capacity(tail_len),
            tail_len,
            ..Self::default()
        }
    }

    /// Records one generated token.
    pub fn push_output(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.num_output += 1;
        if self.tail_len > 0 {
            if self.tail.len() == self.tail_len {
                self.tail.pop_front();
            }
            self.tail.push_back(token);
        }
    }

    /// Whether the output so far ends with `suffix` (always, when it is
    /// empty). A suffix longer than the kept tail never matches: the tail is
    /// sized for the longest one the request asks about.
    pub fn output_ends_with(&self, suffix: &[u32]) -> bool {
        suffix.len() <= self.tail.len()
            && self
                .tail
                .range(self.tail.len() - suffix.len()..)
                .eq(suffix.iter())
    }

    /// Number of generated tokens recorded so far.
    pub fn num_output(&self) -> usize {
        self.num_output
    }

    /// How often `token` was generated.
    pub fn output_count(&self, token: u32) -> u32 {
        self.output_counts.get(&token).copied().unwrap_or(0)
    }
}

/// Sets `logits[token]` to `value`, first saving the original in `saved`.
/// Token ids outside the row are ignored: a stop token id larger than the
/// model's vocabulary can never be sampled, so there is nothing to mask.
pub(super) fn overwrite(
    logits: &mut [f32],
    token: u32,
    value: impl FnOnce(f32) -> f32,
    saved: &mut Vec<(u32, f32)>,
) {
    if let Some(l) = logits.get_mut(token as usize) {
        saved.push((token, *l));
        *l = value(*l);
    }
}

/// Masks the end-of-sequence token (unless `ignore_eos`) and every
/// `stop_token_ids` entry to -inf while fewer than `min_tokens` tokens have
/// been generated, as vLLM's `MinTokensLogitsProcessor` does.
pub fn apply_min_tokens(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &TokenHistory,
    eos_token_id: Option<u32>,
    saved: &mut Vec<(u32, f32)>,
) {
    if history.num_output >= params.min_tokens as usize {
        return;
    }
    let eos = eos_token_id.filter(|_| !params.ignore_eos);
    for &token in params.stop_token_ids.iter().chain(eos.iter()) {
        overwrite(logits, token, |_| f32::NEG_INFINITY, saved);
    }
}

/// Applies vLLM's penalties in its order: the repetition penalty divides the
/// positive (multiplies the negative) logit of every prompt or output token;
/// then `frequency_penalty * count + presence_penalty` is subtracted from the
/// logit of every output token.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &TokenHistory,
    saved: &mut Vec<(u32, f32)>,
) {
    let rep = params.repetition_penalty;
    if rep != 1.0 {
        for &token in &history.seen {
            overwrite(
                logits,
                token,
                |l| if l > 0.0 { l / rep } else { l * rep },
                saved,
            );
        }
    }
    let (freq, presence) = (params.frequency_penalty, params.presence_penalty);
    if freq != 0.0 || presence != 0.0 {
        for (&token, &count) in &history.output_counts {
            overwrite(logits, token, |l| l - freq * count as f32 - presence, saved);
        }
    }
}
