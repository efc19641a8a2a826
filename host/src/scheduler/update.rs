//! `Scheduler::update_from_output`: sampled tokens in, per-request outputs
//! and finishes out.

use super::output::RequestOutput;
use super::request::{FinishReason, Request, RequestStatus};
use super::Scheduler;
use crate::step::{NewTokens, ReqHandle, SchedulerOutput};

/// Why `req` must stop after its newest token `t`, if it must. Stop tokens
/// count only once `min_tokens` outputs exist; a stop token wins over the
/// length limit when both apply (the sequence did end naturally).
#[inline]
fn check_stop(
    req: &Request,
    t: u32,
    eos: Option<u32>,
    max_model_len: usize,
) -> Option<FinishReason> {
    let p = &req.sampling_params;
    let n_out = req.num_output_tokens();
    if n_out >= p.min_tokens as usize {
        if !p.ignore_eos && eos == Some(t) {
            return Some(FinishReason::Eos);
        }
        if p.stop_token_ids.contains(&t) {
            return Some(FinishReason::StopToken(t));
        }
    }
    if n_out >= p.max_tokens as usize || req.num_tokens() >= max_model_len {
        return Some(FinishReason::Length);
    }
    None
}

impl Scheduler {
    /// Applies the tokens sampled in the step `out` scheduled. `sampled`
    /// pairs a handle with its tokens (one for a plain decode; for a step
    /// that verified drafts, the drafts kept and one more, the slots of the
    /// others given back to be computed again); entries for
    /// handles not scheduled in `out`, finished or aborted meanwhile, or
    /// without an output placeholder (a partial prefill samples nothing)
    /// are ignored. A request preempted while the step was in flight keeps
    /// its token, unlike vLLM, which drops it: the worker has already
    /// appended it and advanced the request's sampler, so keeping it keeps
    /// both sides in step and the outputs equal to synchronous scheduling. Stops on EOS (unless `ignore_eos`), a stop token,
    /// `max_tokens` or `max_model_len`, ignoring stop tokens before
    /// `min_tokens`; tokens after a stop are dropped. Finished requests'
    /// blocks are freed. Returns one output per request that got tokens.
    pub fn update_from_output<T: AsRef<[u32]>>(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[(ReqHandle, T)],
    ) -> Vec<RequestOutput> {
        let mut outputs = Vec::with_capacity(sampled.len());
        self.update_from_output_into(out, sampled, &mut outputs);
        outputs
    }

    /// [`update_from_output`](Self::update_from_output) writing into a
    /// reusable vector (cleared first).
    pub fn update_from_output_into<T: AsRef<[u32]>>(
        &mut self,
        out: &SchedulerOutput,
        sampled: &[(ReqHandle, T)],
        outputs: &mut Vec<RequestOutput>,
    ) {
        outputs.clear();
        let mark = &mut self.scratch.mark;
        for &(h, _) in &out.num_scheduled_tokens {
            if let Some(m) = mark.get_mut(h.index()) {
                *m = out.step_id;
            }
        }
        let eos = self.config.eos_token_id;
        let max_model_len = self.config.max_model_len as usize;
        let mut any_finished = false;
        let mut waiting_finished = false;
        for (h, tokens) in sampled {
            let tokens = tokens.as_ref();
            match self.scratch.mark.get_mut(h.index()) {
                Some(m) if *m == out.step_id && out.step_id != 0 => *m = 0,
                _ => continue,
            }
            let Some(req) = self.slots[h.index()].as_mut() else {
                continue;
            };
            if req.num_output_placeholders == 0 || tokens.is_empty() {
                continue;
            }
            req.num_output_placeholders -= 1;
            let drafts = std::mem::take(&mut req.num_draft_tokens);
            if drafts > 0 {
                // The step computed the last known token and every draft;
                // only the drafts kept (all tokens but the last) stay
                // computed. A request preempted meanwhile recomputes anyway.
                let kept = tokens.len().min(drafts + 1) - 1;
                if req.status == RequestStatus::Running {
                    req.num_computed_tokens -= drafts - kept;
                }
                self.spec_stats.observe_accepted(kept);
                if let Some(p) = &mut req.prediction {
                    p.settle(drafts, kept);
                }
            }
            let mut new_token_ids = NewTokens::default();
            let mut finish_reason = None;
            for &t in tokens {
                req.all_token_ids.push(t);
                new_token_ids.push(t);
                finish_reason = check_stop(req, t, eos, max_model_len);
                if finish_reason.is_some() {
                    break;
                }
            }
            outputs.push(RequestOutput {
                handle: *h,
                new_token_ids,
                finish_reason,
                num_cached_tokens: req.num_cached_tokens() as u32,
                prediction_tokens: req.prediction_tokens(),
            });
            if let Some(reason) = finish_reason {
                waiting_finished |= req.status != RequestStatus::Running;
                self.finish(*h, reason);
                any_finished = true;
            }
        }
        if any_finished {
            let slots = &self.slots;
            self.running.retain(|h| slots[h.index()].is_some());
            if waiting_finished {
                self.waiting.retain(|h| slots[h.index()].is_some());
            }
        }
    }

    /// Finishes with [`FinishReason::Error`] every request of `failed` (the
    /// worker could not sample it and will not run it again), freeing its
    /// blocks, and appends its final output to `outputs`. A request
    /// preempted while the step was in flight fails too; handles finished
    /// or aborted meanwhile are ignored.
    pub fn fail_requests<'a>(
        &mut self,
        failed: impl IntoIterator<Item = &'a ReqHandle>,
        outputs: &mut Vec<RequestOutput>,
    ) {
        let mut any_finished = false;
        for &h in failed {
            let Some(req) = self.slots.get(h.index()).and_then(Option::as_ref) else {
                continue;
            };
            outputs.push(RequestOutput {
                handle: h,
                new_token_ids: NewTokens::default(),
                finish_reason: Some(FinishReason::Error),
                num_cached_tokens: req.num_cached_tokens() as u32,
                prediction_tokens: req.prediction_tokens(),
            });
            self.finish(h, FinishReason::Error);
            any_finished = true;
        }
        if any_finished {
            let slots = &self.slots;
            self.running.retain(|h| slots[h.index()].is_some());
            self.waiting.retain(|h| slots[h.index()].is_some());
        }
    }
}
