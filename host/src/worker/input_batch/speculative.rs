//! Sampling a step, and verifying draft tokens (speculative decoding) by
//! sampling position after position.
//!
//! A speculating request's step computes its last known token and its
//! drafts at once. Its position `i` is then sampled exactly as a decode
//! step at that position would be, by the same logits processors and
//! sampler, after the tokens before it were appended: if the sample equals
//! draft `i`, that draft is kept and position `i + 1` is sampled; the
//! first sample that differs is kept in the draft's place and ends the
//! step. Each kept token is one sample from the distribution plain
//! decoding would have drawn it from, and draws the request's random
//! numbers in the same order, so the output (a seeded one included) is
//! what plain decoding gives; the drafts only decide how many positions
//! one step covers. (With drafts that carry no probabilities of their own,
//! as n-gram drafts do, this is the rejection rule of speculative sampling.)
//!
//! Positions are sampled in rounds over all speculating requests, so the
//! processors and a sampler plugin see one batch per round.

use super::{BatchError, InputBatch, StepPlan};
use crate::model_runner::Logits;
use crate::step::{ModelRunnerOutput, ReqHandle};

impl InputBatch {
    /// Samples the step `plan` ran, whose last-row logits are `logits`:
    /// the logits processors edit each sampled row, then one token is
    /// sampled per request, and a speculating request goes on sampling
    /// its next position while its samples equal its drafts (see the
    /// module doc). A processor's fault fails the requests of its round.
    pub fn sample_step(
        &mut self,
        plan: &mut StepPlan,
        logits: &mut Logits,
    ) -> Result<ModelRunnerOutput, BatchError> {
        let vocab = logits.vocab_size;
        // Round 0 samples each speculating request's first position, whose
        // logits the forward pass kept as the draft row 0; its last row
        // (after every draft) becomes the request's final row.
        for d in &mut plan.drafts {
            if d.logits.len() != d.tokens.len() * vocab {
                return Err(BatchError(format!(
                    "request {:?}: {} logits kept for {} drafts",
                    d.handle,
                    d.logits.len(),
                    d.tokens.len()
                )));
            }
            let last = logits
                .data
                .get_mut(d.row * vocab..(d.row + 1) * vocab)
                .ok_or_else(|| BatchError(format!("no logits row for {:?}", d.handle)))?;
            d.logits.extend_from_slice(last);
            last.copy_from_slice(&d.logits[..vocab]);
        }
        let mut out = self.sample_round(plan, logits)?;
        if plan.drafts.is_empty() {
            return Ok(out);
        }
        let at = &mut self.sampled_at;
        for (i, (h, _)) in out.sampled.iter().enumerate() {
            index(at, *h, i);
        }
        let mut round_plan = StepPlan::default();
        let mut round_logits = Logits {
            num_seqs: 0,
            vocab_size: vocab,
            data: Vec::new(),
        };
        for round in 1.. {
            round_plan.rows.clear();
            round_logits.data.clear();
            // Those whose every sample so far equalled its draft, with a
            // position left: row `round` follows `round` kept drafts.
            for d in plan.drafts.iter().filter(|d| round <= d.tokens.len()) {
                let kept = find(&self.sampled_at, &out, d.handle).is_some_and(|i| {
                    let t = &out.sampled[i].1;
                    t.len() == round && t[round - 1] == d.tokens[round - 1]
                });
                if kept {
                    round_plan.rows.push((d.handle, true));
                    let rows = &d.logits[round * vocab..(round + 1) * vocab];
                    round_logits.data.extend_from_slice(rows);
                }
            }
            if round_plan.rows.is_empty() {
                break;
            }
            round_logits.num_seqs = round_plan.rows.len();
            let round_out = self.sample_round(&mut round_plan, &mut round_logits)?;
            plan.failed.append(&mut round_plan.failed);
            merge(&mut self.sampled_at, &mut out, round_out);
        }
        Ok(out)
    }

    /// One round: the processors, then the sampler, over `plan`'s rows.
    fn sample_round(
        &mut self,
        plan: &mut StepPlan,
        logits: &mut Logits,
    ) -> Result<ModelRunnerOutput, BatchError> {
        match self.apply_processors(plan, logits) {
            Ok(()) => self.sample(plan, logits),
            // An older processor faulted under `on_error = "fail"`: the
            // requests whose rows it was given fail; the engine and the
            // other requests carry on. (A 0.4 processor's failures are per
            // request, in `plan`.)
            Err(e) => {
                self.fail(plan.sampling_handles());
                Ok(ModelRunnerOutput::failed(
                    plan.sampling_handles(),
                    &e.to_string(),
                ))
            }
        }
    }
}

/// Appends a later round's tokens, logprobs and failures to `out`, whose
/// entries `at` locates.
fn merge(at: &mut Vec<usize>, out: &mut ModelRunnerOutput, round: ModelRunnerOutput) {
    for ((h, tokens), logprobs) in round.sampled.into_iter().zip(round.logprobs) {
        match find(at, out, h) {
            Some(i) => {
                for &t in tokens.iter() {
                    out.sampled[i].1.push(t);
                }
                out.logprobs[i].extend(logprobs);
            }
            None => {
                index(at, h, out.sampled.len());
                out.sampled.push((h, tokens));
                out.logprobs.push(logprobs);
            }
        }
    }
    out.failed.extend(round.failed);
}

/// Records that request `h`'s entry in the step's output is the `i`-th.
fn index(at: &mut Vec<usize>, h: ReqHandle, i: usize) {
    let k = h.index();
    if at.len() <= k {
        at.resize(k + 1, usize::MAX);
    }
    at[k] = i;
}

/// Request `h`'s entry in `out`, if it has one. `at` may hold entries
/// of earlier steps' outputs, so the handle there is checked.
fn find(at: &[usize], out: &ModelRunnerOutput, h: ReqHandle) -> Option<usize> {
    let i = *at.get(h.index())?;
    out.sampled.get(i).filter(|(s, _)| *s == h).map(|_| i)
}
