//! The per-request sampler: turns one row of model logits into the next token.
//!
//! Order of operations follows vLLM V1's `Sampler`:
//! 1. log-probabilities of the **raw** model output (vLLM's default
//!    `logprobs_mode = raw_logprobs`): the sampled token's logprob and the
//!    top-`logprobs` alternatives are taken before any processing below;
//! 2. the request's token filters (`token_filters.rs`): the
//!    `allowed_token_ids` mask, the `bad_words` bans, then `logit_bias`;
//! 3. min_tokens: mask EOS and stop tokens until `min_tokens` were generated;
//! 4. penalties: repetition, then frequency and presence;
//! 5. greedy (temperature < 1e-5): argmax of the penalised logits, ignoring
//!    top-k/top-p/min-p; otherwise
//! 6. temperature, then min-p (relative to the most likely token), then top-k,
//!    then top-p over what is left (see `nucleus.rs`), then one inverse-CDF
//!    draw. No step sorts the vocabulary.
//!
//! vLLM draws with exponential noise (`probs / Exp(1)` argmax) to avoid a GPU
//! sync; on the CPU one uniform and a cumulative scan give the same
//! distribution with one random number per token. Greedy rows draw nothing,
//! so a seeded request's stream does not depend on its neighbours in a batch.

use super::exp::{fill_weights, sum_f64};
use super::nucleus::apply_top_p;
use super::params::SamplingParams;
use super::penalties::{apply_min_tokens, apply_penalties, TokenHistory};
use super::rng::Xoshiro256StarStar;
use super::select::{argmax, log_sum_exp, max_value, top_k_desc, top_k_in_index_order};
use super::token_filters::{apply_allowed_token_ids, apply_bad_words, apply_logit_bias};

/// One sampled token with its log-probability under the raw model output.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The chosen token id.
    pub token: u32,
    /// `log_softmax(raw logits)[token]`.
    pub logprob: f32,
    /// The `params.logprobs` most likely tokens of the raw output with their
    /// logprobs, most likely first; empty when logprobs were not requested.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A row after [`RequestSampler::prepare`]: what [`RequestSampler::finish`]
/// needs to report the chosen token's raw logprob.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedRow {
    /// `log_sum_exp` of the raw row.
    raw_lse: f32,
    /// The requested top logprobs of the raw row.
    top_logprobs: Vec<(u32, f32)>,
}

/// Block size of the inverse-CDF scan: large enough that block sums
/// vectorise, small enough that the final element-wise walk is short.
const PICK_BLOCK: usize = 256;

/// Per-request sampling state: its random generator, the token history for
/// penalties and min_tokens, and scratch buffers reused across steps so the
/// hot path does not allocate.
#[derive(Debug, Clone)]
pub struct RequestSampler {
    rng: Xoshiro256StarStar,
    eos_token_id: Option<u32>,
    history: TokenHistory,
    /// Original values of logits changed by the token filters (but the allow
    /// mask), min_tokens or the penalties.
    saved: Vec<(u32, f32)>,
    /// The allowed tokens' logits while the allow mask fills the row.
    allowed_scratch: Vec<(u32, f32)>,
    /// Positive weights reordered by the top-p select.
    select_scratch: Vec<f32>,
    /// Candidates `(token, logit)`: top-k survivors or top logprobs.
    candidates: Vec<(u32, f32)>,
    /// The candidates' logits, contiguous for the vectorised weight pass.
    logit_scratch: Vec<f32>,
    /// Unnormalised probabilities of the tokens being drawn from.
    weights: Vec<f32>,
}

impl RequestSampler {
    /// State for a new request. The generator is seeded from `params.seed`, or
    /// from OS randomness when there is none. `eos_token_id` comes from the
    /// tokenizer; it is masked while fewer than `min_tokens` were generated.
    /// The history keeps as many output tokens as the longest `bad_words`
    /// sequence needs to match.
    pub fn new(
        params: &SamplingParams,
        prompt_token_ids: &[u32],
        eos_token_id: Option<u32>,
    ) -> Self {
        let rng = match params.seed {
            Some(seed) => Xoshiro256StarStar::from_seed(seed),
            None => Xoshiro256StarStar::from_entropy(),
        };
        Self {
            rng,
            eos_token_id,
            history: TokenHistory::new(prompt_token_ids, bad_words_tail(params)),
            saved: Vec::new(),
            allowed_scratch: Vec::new(),
            select_scratch: Vec::new(),
            candidates: Vec::new(),
            logit_scratch: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Records a generated token that did not come from [`Self::sample`]
    /// (e.g. restoring a preempted request's output); `sample` already
    /// records the tokens it returns.
    pub fn accept(&mut self, token: u32) {
        self.history.push_output(token);
    }

    /// Restores a replayed request's state after `output` (its workers
    /// died): the tokens join the history, and the generator skips the one
    /// uniform the host drew for each (none when greedy), so a seeded
    /// request goes on exactly as if nothing had happened. A sampler plugin
    /// may draw a different number per token; its requests resume with the
    /// generator at this count, deterministically but not identically.
    pub fn resume(&mut self, output: &[u32], params: &SamplingParams) {
        for &token in output {
            self.accept(token);
            if !params.is_greedy() {
                self.rng.next_f64();
            }
        }
    }

    /// Number of generated tokens recorded so far.
    pub fn num_output_tokens(&self) -> usize {
        self.history.num_output()
    }

    /// How often `token` has been generated so far.
    pub fn output_count(&self, token: u32) -> u32 {
        self.history.output_count(token)
    }

    /// Samples the next token from one row of logits (length = vocabulary
    /// size) and records it in the history.
    ///
    /// On return `logits` holds the row after the token filters, min_tokens
    /// masking and the penalties (temperature and the top-k/p/min-p cuts are not written back).
    ///
    /// # Panics
    /// If `logits` is empty: the worker never produces an empty row.
    pub fn sample(&mut self, logits: &mut [f32], params: &SamplingParams) -> SampledToken {
        let prepared = self.prepare(logits, params);
        let token = self.choose(logits, params, None);
        self.finish(logits, token, prepared)
    }

    /// The first half of [`Self::sample`]: the raw logprobs, then the token
    /// filters, min_tokens and the penalties applied to `logits` in place. Follow it with
    /// [`Self::choose`] (or a sampler plugin's choice) and [`Self::finish`].
    ///
    /// # Panics
    /// If `logits` is empty: the worker never produces an empty row.
    pub fn prepare(&mut self, logits: &mut [f32], params: &SamplingParams) -> PreparedRow {
        assert!(
            !logits.is_empty(),
            "RequestSampler::prepare needs a non-empty logits row"
        );
        let raw_lse = log_sum_exp(logits);
        let top_logprobs = match params.logprobs {
            Some(n) if n > 0 => {
                top_k_desc(logits, n as usize, &mut self.candidates);
                self.candidates
                    .iter()
                    .map(|&(t, l)| (t, l - raw_lse))
                    .collect()
            }
            _ => Vec::new(),
        };
        self.saved.clear();
        apply_allowed_token_ids(
            logits,
            params.allowed_token_ids.as_deref(),
            &mut self.allowed_scratch,
        );
        apply_bad_words(
            logits,
            &params.bad_words_token_ids,
            &self.history,
            &mut self.saved,
        );
        apply_logit_bias(logits, &params.logit_bias, &mut self.saved);
        apply_min_tokens(
            logits,
            params,
            &self.history,
            self.eos_token_id,
            &mut self.saved,
        );
        apply_penalties(logits, params, &self.history, &mut self.saved);
        PreparedRow {
            raw_lse,
            top_logprobs,
        }
    }

    /// The host's choice on a prepared row: the argmax when greedy, else a
    /// draw with `u` (one is taken from the request's generator when `None`).
    pub fn choose(&mut self, logits: &[f32], params: &SamplingParams, u: Option<f64>) -> u32 {
        if params.is_greedy() {
            argmax(logits) as u32
        } else {
            let u = u.unwrap_or_else(|| self.rng.next_f64());
            self.draw(logits, params, u)
        }
    }

    /// The next uniform in [0, 1) of the request's own generator (what a
    /// sampler plugin draws with).
    pub fn next_uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// The `k` most likely tokens of a prepared row, most likely first, with
    /// their log-probabilities at the request's temperature (at 1 when it is
    /// greedy) over the whole vocabulary. min-p, top-k and top-p are not
    /// applied: they are cuts a sampler plugin makes itself.
    pub fn top_candidates(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) {
        let inv_t = if params.is_greedy() {
            1.0
        } else {
            1.0 / params.temperature
        };
        top_k_desc(logits, k.min(logits.len()), out);
        let max = max_value(logits);
        if !max.is_finite() {
            // Degenerate row (all masked or an infinite logit): the ranking
            // stands, the probabilities do not exist.
            out.iter_mut().for_each(|c| c.1 = f32::NEG_INFINITY);
            return;
        }
        let sum: f64 = logits
            .iter()
            .map(|&l| f64::from(((l - max) * inv_t).exp()))
            .sum();
        let lse = sum.ln() as f32;
        for c in out.iter_mut() {
            c.1 = (c.1 - max) * inv_t - lse;
        }
    }

    /// The second half of [`Self::sample`]: records `token` and reports its
    /// logprob under the raw model output.
    pub fn finish(&mut self, logits: &[f32], token: u32, prepared: PreparedRow) -> SampledToken {
        let raw = self
            .saved
            .iter()
            .find(|&&(t, _)| t == token)
            .map_or(logits[token as usize], |&(_, l)| l);
        self.accept(token);
        SampledToken {
            token,
            logprob: raw - prepared.raw_lse,
            top_logprobs: prepared.top_logprobs,
        }
    }

    /// Random draw from `softmax(logits / T)` restricted by min-p, top-k and
    /// top-p, by the uniform `u` (the caller takes exactly one per random
    /// step, so the stream advances by one whatever the row).
    fn draw(&mut self, logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
        let max = max_value(logits);
        if !max.is_finite() {
            // Everything masked, or an infinite logit: the distribution is
            // degenerate and the argmax is the only sensible answer.
            return argmax(logits) as u32;
        }
        let inv_t = 1.0 / params.temperature;
        // p_i >= min_p * p_max  <=>  l_i >= l_max + T * ln(min_p).
        let cutoff = if params.min_p > 0.0 {
            max + params.temperature * params.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        // The support is the top-k candidates, or the whole vocabulary. Both
        // are in index order, so the draw does not depend on a sort.
        let top_k = params.effective_top_k(logits.len());
        if let Some(k) = top_k {
            top_k_in_index_order(logits, k, &mut self.candidates);
            self.logit_scratch.clear();
            self.logit_scratch
                .extend(self.candidates.iter().map(|&(_, l)| l));
            fill_weights(&self.logit_scratch, max, inv_t, cutoff, &mut self.weights);
        } else {
            fill_weights(logits, max, inv_t, cutoff, &mut self.weights);
        }
        if params.top_p < 1.0 {
            apply_top_p(&mut self.weights, params.top_p, &mut self.select_scratch);
        }
        match (pick(&self.weights, u), top_k) {
            (Some(i), Some(_)) => self.candidates[i].0,
            (Some(i), None) => i as u32,
            (None, _) => argmax(logits) as u32,
        }
    }
}

/// How many output tokens a request's `bad_words` look back at: all but the
/// last token of its longest sequence.
fn bad_words_tail(params: &SamplingParams) -> usize {
    params
        .bad_words_token_ids
        .iter()
        .map(|w| w.len().saturating_sub(1))
        .max()
        .unwrap_or(0)
}

/// Inverse-CDF draw: the first index whose cumulative weight exceeds
/// `u * total`. `None` when every weight is zero.
///
/// The scan skips whole blocks by their (vectorised) sums, so only one block
/// is walked element by element.
fn pick(weights: &[f32], u: f64) -> Option<usize> {
    let total = sum_f64(weights);
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0;
    let mut last_positive = None;
    for (b, block) in weights.chunks(PICK_BLOCK).enumerate() {
        let block_sum = sum_f64(block);
        if block_sum > 0.0 {
            last_positive = Some(b);
        }
        if cum + block_sum <= target {
            cum += block_sum;
            continue;
        }
        for (i, &w) in block.iter().enumerate() {
            cum += f64::from(w);
            if w > 0.0 && cum > target {
                return Some(b * PICK_BLOCK + i);
            }
        }
    }
    // Only reachable when rounding put `target` at or above the summed total:
    // take the last token with a positive weight.
    let b = last_positive?;
    let block = &weights[b * PICK_BLOCK..];
    block
        .iter()
        .take(PICK_BLOCK)
        .rposition(|&w| w > 0.0)
        .map(|i| b * PICK_BLOCK + i)
}

/// Samples one token per row of a `[rows, vocab]` logits matrix, each row with
/// its own parameters and state; the worker's entry point.
///
/// # Panics
/// If `vocab` is 0 or `logits.len() != rows.len() * vocab`: the worker builds
/// both from the same batch, so a mismatch is a bug, not bad input.
pub fn sample_batch(
    logits: &mut [f32],
    vocab: usize,
    rows: &mut [(&SamplingParams, &mut RequestSampler)],
) -> Vec<SampledToken> {
    assert!(
        vocab > 0 && logits.len() == rows.len() * vocab,
        "sample_batch: logits has {} values, expected {} rows x vocab {}",
        logits.len(),
        rows.len(),
        vocab
    );
    logits
        .chunks_exact_mut(vocab)
        .zip(rows.iter_mut())
        .map(|(row, (params, sampler))| sampler.sample(row, params))
        .collect()
}
