//! `Scheduler::schedule`: one step's token budget handed out to running
//! requests, then to waiting ones, with preemption by recompute.

use std::ops::Range;

use super::policy::{is_valid_order, RunningView, WaitingView};
use super::request::{Request, RequestStatus};
use super::{Kind, Scheduled, Scheduler};
use crate::kv_cache::ComputedBlocks;
use crate::step::{NewRequestData, ReqHandle, SchedulerOutput};

/// The live request behind a queued or running handle.
fn req_mut(slots: &mut [Option<Request>], h: ReqHandle) -> &mut Request {
    slots[h.index()]
        .as_mut()
        .expect("queued and running handles always hold a request")
}

impl Scheduler {
    /// Schedules one step into a fresh output. See [`schedule_into`](Self::schedule_into).
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        self.schedule_into(&mut out);
        out
    }

    /// Schedules one step, overwriting `out` (reuse one output across steps
    /// to avoid allocating). vLLM V1's algorithm:
    ///
    /// 1. Running requests, in order, each get the tokens they lack
    ///    (`num_tokens - num_computed_tokens`: one for a decode, a chunk for a
    ///    prefill) capped by the long-prefill threshold and the remaining
    ///    budget. When their blocks cannot be allocated, the policy picks a
    ///    victim among the running requests; it is preempted by recompute
    ///    (blocks freed, `num_computed_tokens = 0`, back to the front of the
    ///    waiting queue) and the allocation retried; if the victim is the
    ///    request itself, the running pass stops.
    ///    With speculative decoding on, a running decode whose last token is
    ///    known also gets draft tokens within the budget (dropped first when
    ///    its blocks cannot be allocated): its predicted output's while the
    ///    output follows it, else the n-gram proposer's.
    /// 2. Only if nothing was preempted: waiting requests in the policy's
    ///    order, while budget, `max_num_seqs` and blocks allow, with
    ///    prefix-cache hits counted as computed. Without chunked prefill a
    ///    prompt that does not fit the remaining budget stops admission; a
    ///    failed allocation stops it too (no skipping ahead).
    /// 3. Every scheduled request's `num_computed_tokens` advances by its
    ///    scheduled tokens now, before the step runs, and a request whose
    ///    step reaches the end of its tokens gains an output placeholder.
    ///
    /// Under async scheduling this runs while the previous step is still in
    /// flight: a request's tokens then count its placeholders (the worker
    /// fills in the token it sampled before it runs the next step), and a
    /// request whose placeholders already reach `max_tokens` is not
    /// scheduled again.
    pub fn schedule_into(&mut self, out: &mut SchedulerOutput) {
        out.clear();
        self.step_id += 1;
        out.step_id = self.step_id;
        self.free_slots.append(&mut self.recycle);
        out.finished_req_ids
            .extend_from_slice(&self.finished_since_last);
        self.recycle
            .extend(self.finished_since_last.drain(..).map(|h| h.0));

        let mut scheduled = std::mem::take(&mut self.scratch.scheduled);
        scheduled.clear();
        self.scratch.drafts.clear();
        let mut budget = self.config.max_num_batched_tokens as usize;
        let preempted_any = self.schedule_running(&mut scheduled, &mut budget, out);
        if !preempted_any {
            self.schedule_waiting(&mut scheduled, &mut budget);
        }
        self.emit(&scheduled, out);
        self.scratch.scheduled = scheduled;
    }

    /// Caps a request's missing tokens by the long-prefill threshold.
    fn cap_long_prefill(&self, missing: usize) -> usize {
        match self.config.long_prefill_token_threshold as usize {
            0 => missing,
            threshold => missing.min(threshold),
        }
    }

    /// Pass 1. Returns whether anything was preempted.
    fn schedule_running(
        &mut self,
        scheduled: &mut Vec<Scheduled>,
        budget: &mut usize,
        out: &mut SchedulerOutput,
    ) -> bool {
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let h = self.running[i];
            let req = req_mut(&mut self.slots, h);
            let missing = if req.is_fully_scheduled() {
                0
            } else {
                (req.num_tokens() + req.num_output_placeholders)
                    .saturating_sub(req.num_computed_tokens)
            };
            let n = self.cap_long_prefill(missing).min(*budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut drafts = self.propose(h, missing, n, *budget - n);
            let allocated = loop {
                let req = req_mut(&mut self.slots, h);
                let got = self.kv.allocate_slots(
                    &mut req.kv,
                    &req.all_token_ids,
                    req.num_computed_tokens,
                    n + drafts.len(),
                    &ComputedBlocks::NONE,
                );
                if let Some(range) = got {
                    break Some(range.start);
                }
                if !drafts.is_empty() {
                    // Drafts are a bet: drop them before preempting anyone.
                    self.scratch.drafts.truncate(drafts.start);
                    drafts = drafts.start..drafts.start;
                    continue;
                }
                let v = self.pick_victim();
                let victim = self.running.remove(v);
                if v < i {
                    // Before the cursor: give back its tokens if it was
                    // scheduled this step (one whose tokens are all in
                    // flight was passed over).
                    if let Some(pos) = scheduled.iter().position(|s| s.handle == victim) {
                        *budget += scheduled.remove(pos).num_tokens;
                    }
                    i -= 1;
                }
                self.preempt(victim, out);
                preempted_any = true;
                if victim == h {
                    break None;
                }
            };
            let Some(first_new_block) = allocated else {
                break;
            };
            *budget -= n + drafts.len();
            scheduled.push(Scheduled {
                handle: h,
                num_tokens: n + drafts.len(),
                first_new_block,
                kind: Kind::Running,
                drafts,
            });
            i += 1;
        }
        preempted_any
    }

    /// Speculative decoding: the draft tokens of request `h` for this step,
    /// appended to `scratch.drafts`, when its `n` scheduled tokens reach
    /// the end of the `missing` ones and no step in flight samples its last
    /// token. A decode drafts from its prediction, else by n-gram lookup;
    /// a prefill (or a preempted request's recompute) from its prediction
    /// alone: the step that samples the first token verifies the
    /// prediction's first tokens, while the lookup would match the end of
    /// a prompt, the chat template's turn markers, where nothing worth
    /// drafting follows. At most `room` drafts (the budget left), and few
    /// enough that the step's tokens, every draft kept plus one, stay
    /// within the request's `max_tokens` and `max_model_len`.
    fn propose(&mut self, h: ReqHandle, missing: usize, n: usize, room: usize) -> Range<usize> {
        let start = self.scratch.drafts.len();
        let Some(proposer) = self.proposer else {
            return start..start;
        };
        let req = self.slots[h.index()]
            .as_mut()
            .expect("scheduled handles hold a request");
        if n != missing || req.num_output_placeholders > 0 {
            return start..start;
        }
        let max_tokens = req.sampling_params.max_tokens as usize;
        let max_model_len = self.config.max_model_len as usize;
        let limit = room
            .min(proposer.num_speculative_tokens)
            .min(max_tokens.saturating_sub(req.num_output_tokens() + 1))
            .min(max_model_len.saturating_sub(req.num_tokens() + 1));
        let drafts = &mut self.scratch.drafts;
        // The client's prediction first; where the output has departed
        // from it, the output's own repeats.
        let predicted = match &mut req.prediction {
            Some(p) => p.propose(&req.all_token_ids[req.num_prompt_tokens..], limit, drafts),
            None => 0,
        };
        let n = match predicted {
            0 if missing == 1 => proposer.propose(&req.all_token_ids, limit, drafts),
            n => n,
        };
        start..start + n
    }

    /// The policy's victim as a position in `running`, validated; FCFS (the
    /// last) when the answer is missing or out of range.
    fn pick_victim(&mut self) -> usize {
        let s = &mut self.scratch;
        s.ids.clear();
        s.priorities.clear();
        s.arrivals.clear();
        s.lens.clear();
        for &h in &self.running {
            let r = self.slots[h.index()]
                .as_ref()
                .expect("running handles hold a request");
            s.ids.push(h.0);
            s.priorities.push(r.priority);
            s.arrivals.push(r.arrival_time);
            s.lens.push(r.num_computed_tokens as u32);
        }
        let view = RunningView {
            ids: &s.ids,
            priorities: &s.priorities,
            arrival_times: &s.arrivals,
            num_computed_tokens: &s.lens,
        };
        let n = self.running.len();
        match self.policy.pick_victim(&view) {
            Some(v) if (v as usize) < n => v as usize,
            _ => {
                self.num_policy_fallbacks += 1;
                n - 1
            }
        }
    }

    /// Preemption by recompute: free the blocks (caching what was computed),
    /// reset progress and requeue at the front.
    fn preempt(&mut self, h: ReqHandle, out: &mut SchedulerOutput) {
        let req = req_mut(&mut self.slots, h);
        self.kv
            .free(&mut req.kv, &req.all_token_ids, req.num_computed_tokens);
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(h);
        out.preempted_req_ids.push(h);
    }

    /// Pass 2: admit waiting requests in policy order.
    fn schedule_waiting(&mut self, scheduled: &mut Vec<Scheduled>, budget: &mut usize) {
        let max_seqs = self.config.max_num_seqs as usize;
        if self.waiting.is_empty() || *budget == 0 || self.running.len() >= max_seqs {
            return;
        }
        let mut order = std::mem::take(&mut self.scratch.order);
        self.order_waiting(&mut order);
        let mut admitted = std::mem::take(&mut self.scratch.seen);
        admitted.clear();
        admitted.resize(self.waiting.len(), false);
        let mut any = false;
        for &pos in &order {
            if *budget == 0 || self.running.len() >= max_seqs {
                break;
            }
            let h = self.waiting[pos as usize];
            let req = req_mut(&mut self.slots, h);
            if req.num_output_placeholders > 0 {
                // Preempted while a step that samples it was in flight: it
                // resumes once that token has arrived.
                continue;
            }
            // A request that wants prompt logprobs computes every prompt
            // position, so it takes no prefix-cache hit (as in vLLM).
            let computed = if req.sampling_params.prompt_logprobs.is_some() {
                ComputedBlocks::default()
            } else {
                self.kv.get_computed_blocks(&mut req.kv, &req.all_token_ids)
            };
            let missing = req.num_tokens() - computed.num_tokens;
            let capped = self.cap_long_prefill(missing);
            if !self.config.enable_chunked_prefill && capped > *budget {
                break;
            }
            let n = capped.min(*budget);
            let mut drafts = self.propose(h, missing, n, *budget - n);
            let req = req_mut(&mut self.slots, h);
            let mut allocated = self.kv.allocate_slots(
                &mut req.kv,
                &req.all_token_ids,
                0,
                n + drafts.len(),
                &computed,
            );
            if allocated.is_none() && !drafts.is_empty() {
                // Drafts are a bet: the prompt goes in without them.
                self.scratch.drafts.truncate(drafts.start);
                drafts = drafts.start..drafts.start;
                allocated =
                    self.kv
                        .allocate_slots(&mut req.kv, &req.all_token_ids, 0, n, &computed);
            }
            let Some(range) = allocated else {
                break;
            };
            req.num_computed_tokens = computed.num_tokens;
            req.num_cached_tokens.get_or_insert(computed.num_tokens);
            let kind = if req.seen_by_worker {
                Kind::Resumed
            } else {
                Kind::New
            };
            req.seen_by_worker = true;
            req.status = RequestStatus::Running;
            self.running.push(h);
            admitted[pos as usize] = true;
            any = true;
            *budget -= n + drafts.len();
            scheduled.push(Scheduled {
                handle: h,
                num_tokens: n + drafts.len(),
                first_new_block: range.start,
                kind,
                drafts,
            });
        }
        if any {
            let mut k = 0;
            self.waiting.retain(|_| {
                k += 1;
                !admitted[k - 1]
            });
        }
        self.scratch.order = order;
        self.scratch.seen = admitted;
    }

    /// Fills `order` with the policy's admission order, validated; the queue
    /// order (FCFS) when the answer is invalid.
    fn order_waiting(&mut self, order: &mut Vec<u32>) {
        let s = &mut self.scratch;
        s.ids.clear();
        s.lens.clear();
        s.priorities.clear();
        s.arrivals.clear();
        for &h in self.waiting.iter() {
            let r = self.slots[h.index()]
                .as_ref()
                .expect("waiting handles hold a request");
            s.ids.push(h.0);
            s.lens.push(r.num_prompt_tokens as u32);
            s.priorities.push(r.priority);
            s.arrivals.push(r.arrival_time);
        }
        let view = WaitingView {
            ids: &s.ids,
            prompt_lens: &s.lens,
            priorities: &s.priorities,
            arrival_times: &s.arrivals,
        };
        order.clear();
        self.policy.order_waiting(&view, order);
        if !is_valid_order(order, view.len(), &mut s.seen) {
            self.num_policy_fallbacks += 1;
            order.clear();
            order.extend(0..view.len() as u32);
        }
    }

    /// Writes the output lists and advances `num_computed_tokens`.
    fn emit(&mut self, scheduled: &[Scheduled], out: &mut SchedulerOutput) {
        for s in scheduled {
            let req = req_mut(&mut self.slots, s.handle);
            let n = s.num_tokens as u32;
            out.num_scheduled_tokens.push((s.handle, n));
            out.total_num_scheduled_tokens += n;
            let drafts = &self.scratch.drafts[s.drafts.clone()];
            if !drafts.is_empty() {
                out.scheduled_spec_decode_tokens.push(s.handle, drafts);
                self.spec_stats.observe_draft(drafts.len());
            }
            let computed = req.num_computed_tokens as u32;
            match s.kind {
                Kind::New => out.scheduled_new_reqs.push(NewRequestData {
                    handle: s.handle,
                    request_id: req.request_id.to_string(),
                    prompt_token_ids: req.prompt_token_ids().to_vec(),
                    output_token_ids: req.output_token_ids().to_vec(),
                    sampling_params: req.sampling_params.clone(),
                    block_ids: req.kv.block_ids().to_vec(),
                    num_computed_tokens: computed,
                }),
                Kind::Running | Kind::Resumed => out.scheduled_cached_reqs.push(
                    s.handle,
                    s.kind == Kind::Resumed,
                    computed,
                    &req.kv.block_ids()[s.first_new_block..],
                ),
            }
            req.num_computed_tokens += s.num_tokens;
            req.num_draft_tokens = drafts.len();
            let end = req.num_tokens() + req.num_output_placeholders + drafts.len();
            if req.num_computed_tokens == end {
                // The step reaches the end of the known tokens (and of its
                // drafts): it samples.
                req.num_output_placeholders += 1;
            }
        }
    }
}
