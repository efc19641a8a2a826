//! The worker's persistent batch (vLLM's `InputBatch` + `CachedRequestState`):
//! per-request state kept across steps, updated by each [`SchedulerOutput`]'s
//! deltas, turned into the flattened [`ModelInput`] of a step, and sampled.
//!
//! The worker owns the sampled tokens: a request's next decode input is the
//! token this batch sampled for it, so the scheduler only ever sends deltas
//! (new requests, new blocks, token counts), never whole token lists again.

use thiserror::Error;

#[cfg(feature = "cuda")]
mod device_draw;
mod plugins;
mod speculative;
mod step_plan;
#[cfg(test)]
mod tests;

use crate::model_runner::{DeviceSampleRow, Logits, LogitsSpan, ModelInput, SeqInput};
use crate::plugins::{LogitsProcessors, Row, SamplerPlugin};
use crate::sampling::rng::Xoshiro256StarStar;
use crate::sampling::{RequestSampler, SampledToken, SamplingParams};
use crate::step::{
    Logprobs, ModelRunnerOutput, NewTokens, PromptLogprobs, ReqHandle, SchedulerOutput,
};
pub use step_plan::StepPlan;
use step_plan::{DraftRows, SpanRequest};

/// A scheduler output that does not fit the worker's state: a protocol bug
/// between the scheduler and the worker, reported instead of panicking.
#[derive(Debug, Error)]
#[error("scheduler output does not match the worker's batch: {0}")]
pub struct BatchError(String);

/// What the worker keeps of one request between steps.
struct CachedRequestState {
    /// Prompt then output tokens.
    token_ids: Vec<u32>,
    /// Tokens in the KV cache before this step, as the scheduler last said.
    num_computed_tokens: usize,
    block_ids: Vec<u32>,
    params: SamplingParams,
    sampler: RequestSampler,
    /// Keys the device sampler's stream: the request's seed, or a random
    /// one drawn when it entered the batch, so it is stable across steps.
    /// `None` when the batch does not sample on a device.
    device_seed: Option<u64>,
    /// Failed in an earlier step (a plugin fault): steps scheduled for it
    /// before the scheduler learnt of it (async scheduling) skip it.
    failed: bool,
    /// Tokens of the prompt (the first `prompt_len` of `token_ids`).
    prompt_len: usize,
    /// The next prompt token whose logprob is to be reported, when the
    /// request asked for prompt logprobs (from 1: token 0 has none). A
    /// prompt recomputed after preemption reports nothing twice.
    prompt_logprobs_next: usize,
}

/// The persistent batch.
pub struct InputBatch {
    /// Indexed by handle.
    requests: Vec<Option<CachedRequestState>>,
    eos_token_id: Option<u32>,
    /// Logits-processor plugins, told when requests enter and leave.
    processors: Option<LogitsProcessors>,
    /// The rows handed to the processors (reused).
    processor_rows: Vec<Row>,
    /// The sampler plugin, told when requests enter and leave.
    sampler: Option<SamplerPlugin>,
    /// The plugins' fault counts last reported ([`Self::take_plugin_faults`]),
    /// processors first, then the sampler.
    faults_reported: Vec<u64>,
    /// The worker's runner can sample on its device (a GPU worker).
    on_device: bool,
    /// Why the worker's runner cannot compute prompt logprobs (the logits
    /// of other rows than the last), when it cannot: requests asking for
    /// them fail with this, and draft tokens are not verified.
    no_prompt_logprobs: Option<String>,
    /// Per handle: where a speculating request's tokens sit in the output
    /// of the step being sampled (reused; see `speculative.rs`).
    sampled_at: Vec<usize>,
}

impl InputBatch {
    /// An empty batch; `eos_token_id` is masked while a request is below its
    /// `min_tokens`.
    pub fn new(eos_token_id: Option<u32>) -> InputBatch {
        InputBatch {
            requests: Vec::new(),
            eos_token_id,
            processors: None,
            processor_rows: Vec::new(),
            sampler: None,
            faults_reported: Vec::new(),
            on_device: false,
            no_prompt_logprobs: None,
            sampled_at: Vec::new(),
        }
    }

    /// Tells the batch whether the runner computes prompt logprobs: `None`
    /// when it does, else why not (requests asking for them fail with it).
    pub fn set_no_prompt_logprobs(&mut self, why: Option<String>) {
        self.no_prompt_logprobs = why;
    }

    /// Marks the batch as a GPU worker's: requests entering it from now on
    /// get a device seed, and [`Self::device_rows`] offers steps to the
    /// device sampler.
    #[cfg(any(feature = "cuda", test))]
    pub fn set_samples_on_device(&mut self) {
        self.on_device = true;
    }

    /// The rows `plan` samples, for the runner to sample where the logits
    /// are; `None` (the host samples) unless the batch is a GPU worker's and
    /// no logits processor or sampler plugin is installed (both run on the
    /// host's logits). Whether every row's parameters suit the device is
    /// the runner's call.
    pub fn device_rows(&self, plan: &StepPlan) -> Option<Vec<DeviceSampleRow<'_>>> {
        if !self.on_device || self.processors.is_some() || self.sampler.is_some() {
            return None;
        }
        let mut rows = Vec::with_capacity(plan.rows.len());
        for (logits_row, &(h, samples)) in plan.rows.iter().enumerate() {
            if !samples {
                continue;
            }
            let req = self.requests.get(h.index()).and_then(Option::as_ref)?;
            rows.push(DeviceSampleRow {
                params: &req.params,
                seed: req.device_seed?,
                position: req.token_ids.len() as u32,
                logits_row,
            });
        }
        Some(rows)
    }

    /// Records the tokens the device sampled for `plan`'s rows (in
    /// [`Self::device_rows`]' order), advancing each request as
    /// [`Self::sample`] does.
    pub fn record_sampled(
        &mut self,
        plan: &StepPlan,
        tokens: &[u32],
    ) -> Result<ModelRunnerOutput, BatchError> {
        let mut out = ModelRunnerOutput {
            sampled: Vec::with_capacity(tokens.len()),
            logprobs: Vec::with_capacity(tokens.len()),
            ..ModelRunnerOutput::default()
        };
        let mut tokens = tokens.iter();
        for h in plan.sampling_handles() {
            let &token = tokens.next().ok_or_else(|| {
                BatchError(format!("the device sampled no token for request {h:?}"))
            })?;
            let req = self.get_mut(h)?;
            req.sampler.accept(token);
            // Device rows have no logprobs (not device-eligible otherwise).
            record(
                &mut out,
                h,
                req,
                SampledToken {
                    token,
                    logprob: 0.0,
                    top_logprobs: Vec::new(),
                },
            );
        }
        Ok(out)
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.requests.iter().filter(|r| r.is_some()).count()
    }

    /// Whether no request is in the batch.
    pub fn is_empty(&self) -> bool {
        self.requests.iter().all(Option::is_none)
    }

    /// Applies `so`'s deltas (in the order its contract states) and builds the
    /// step's model input into `input`.
    pub fn prepare(
        &mut self,
        so: &SchedulerOutput,
        input: &mut ModelInput,
    ) -> Result<StepPlan, BatchError> {
        let refused = self.update_states(so)?;
        self.prepare_inputs(so, input, refused)
    }

    /// Applies `so`'s deltas: finished requests leave, new ones enter (and
    /// are announced to the plugins), cached ones learn their new blocks.
    /// Returns the new requests a logits processor refused (0.4
    /// `check-request`), already marked failed.
    fn update_states(
        &mut self,
        so: &SchedulerOutput,
    ) -> Result<Vec<(ReqHandle, String)>, BatchError> {
        for h in &so.finished_req_ids {
            if let Some(slot) = self.requests.get_mut(h.index()) {
                *slot = None;
            }
            if let Some(p) = self.processors.as_mut() {
                p.remove(h.0);
            }
            if let Some(p) = self.sampler.as_mut() {
                p.remove(h.0);
            }
        }
        // Requests a logits processor refused (0.4 `check-request`).
        let mut refused = Vec::new();
        for new in &so.scheduled_new_reqs {
            let i = new.handle.index();
            if i >= self.requests.len() {
                self.requests.resize_with(i + 1, || None);
            }
            let mut sampler = RequestSampler::new(
                &new.sampling_params,
                &new.prompt_token_ids,
                self.eos_token_id,
            );
            sampler.resume(&new.output_token_ids, &new.sampling_params);
            let mut token_ids = new.prompt_token_ids.clone();
            token_ids.extend_from_slice(&new.output_token_ids);
            let mut failed = false;
            if let Some(p) = self.processors.as_mut() {
                p.remove(new.handle.0);
                if let Err(why) = p.add(new.handle.0, new.sampling_params.extra_args.as_ref()) {
                    refused.push((new.handle, why));
                    failed = true;
                }
            }
            if let Some(p) = self.sampler.as_mut() {
                p.remove(new.handle.0);
                p.add(new.handle.0, new.sampling_params.extra_args.as_ref());
            }
            self.requests[i] = Some(CachedRequestState {
                token_ids,
                num_computed_tokens: new.num_computed_tokens as usize,
                block_ids: new.block_ids.clone(),
                params: new.sampling_params.clone(),
                sampler,
                device_seed: self.on_device.then(|| {
                    new.sampling_params
                        .seed
                        .unwrap_or_else(|| Xoshiro256StarStar::from_entropy().next_u64())
                }),
                failed,
                prompt_len: new.prompt_token_ids.len(),
                // A replayed request's prompt logprobs all went out before
                // its first token did.
                prompt_logprobs_next: if new.output_token_ids.is_empty() {
                    1
                } else {
                    new.prompt_token_ids.len()
                },
            });
        }
        let cached = &so.scheduled_cached_reqs;
        for i in 0..cached.len() {
            let req = self.get_mut(cached.handles[i])?;
            req.num_computed_tokens = cached.num_computed_tokens[i] as usize;
            if cached.resumed_from_preemption[i] {
                req.block_ids.clear();
            }
            req.block_ids.extend_from_slice(cached.new_block_ids(i));
        }
        Ok(refused)
    }

    /// Flattens the step's scheduled tokens into `input` (tokens,
    /// positions, one sequence with its block table per request) and plans
    /// which rows sample and which keep logits for prompt logprobs.
    fn prepare_inputs(
        &mut self,
        so: &SchedulerOutput,
        input: &mut ModelInput,
        refused: Vec<(ReqHandle, String)>,
    ) -> Result<StepPlan, BatchError> {
        input.token_ids.clear();
        input.positions.clear();
        // Sequences are overwritten in place, so their block tables keep
        // their allocations from step to step.
        let mut n_seqs = 0;
        let mut plan = StepPlan::new(refused);
        let spec = &so.scheduled_spec_decode_tokens;
        let mut next_spec = 0;
        for &(h, mut n) in &so.num_scheduled_tokens {
            // Drafts are listed in the same order as the scheduled tokens.
            let mut drafts = if spec.handles.get(next_spec) == Some(&h) {
                next_spec += 1;
                spec.drafts(next_spec - 1)
            } else {
                &[]
            };
            if self.no_prompt_logprobs.is_some() && !drafts.is_empty() {
                // A runner that returns no logits but the last row's cannot
                // verify drafts: the step computes the known token alone,
                // as if every draft were refused (the output is the same).
                n -= drafts.len().min(n as usize - 1) as u32;
                drafts = &[];
            }
            let no_prompt_logprobs = self.no_prompt_logprobs.as_deref();
            let req = request_mut(&mut self.requests, h)?;
            if req.failed {
                continue;
            }
            let wants_prompt_logprobs =
                req.params.prompt_logprobs.is_some() && req.prompt_logprobs_next < req.prompt_len;
            if let Some(why) = no_prompt_logprobs.filter(|_| wants_prompt_logprobs) {
                req.failed = true;
                plan.failed.push((h, why.to_string()));
                continue;
            }
            let start = req.num_computed_tokens;
            let end = start + n as usize;
            let known = req.token_ids.len();
            // Drafts follow the last known token: the step must reach it.
            let reaches = drafts.is_empty() || end == known + drafts.len();
            if n == 0 || end > known + drafts.len() || !reaches || start >= known {
                return Err(BatchError(format!(
                    "request {h:?}: tokens {start}..{end} scheduled but {known} are known \
                     and {} drafted",
                    drafts.len()
                )));
            }
            let computed = &req.token_ids[start..end.min(known)];
            input.token_ids.extend_from_slice(computed);
            input.token_ids.extend_from_slice(drafts);
            input.positions.extend(start as u32..end as u32);
            if n_seqs == input.seqs.len() {
                input.seqs.push(SeqInput::default());
            }
            let seq = &mut input.seqs[n_seqs];
            seq.query_len = n as usize;
            seq.context_len = end;
            seq.block_table.clear();
            seq.block_table.extend_from_slice(&req.block_ids);
            if wants_prompt_logprobs {
                // Row p's logits predict prompt token p + 1; the last
                // prompt position predicts the first output instead.
                let first = start.max(req.prompt_logprobs_next - 1);
                let last = end.min(req.prompt_len - 1);
                if first < last {
                    plan.spans.push(LogitsSpan {
                        seq: n_seqs,
                        first: first - start,
                        len: last - first,
                    });
                    plan.span_requests.push(SpanRequest::PromptLogprobs {
                        k: req.params.prompt_logprobs.unwrap_or(0) as usize,
                        tokens: req.token_ids[first + 1..last + 1].to_vec(),
                        entry: plan.prompt_logprobs.len(),
                    });
                    plan.prompt_logprobs.push((
                        h,
                        PromptLogprobs {
                            start: (first + 1) as u32,
                            entries: Vec::with_capacity(last - first),
                        },
                    ));
                    req.prompt_logprobs_next = last + 1;
                }
            }
            if !drafts.is_empty() {
                // The rows of the last known token and of every draft but
                // the last predict a draft; the last row is sampled anyway.
                plan.spans.push(LogitsSpan {
                    seq: n_seqs,
                    first: n as usize - 1 - drafts.len(),
                    len: drafts.len(),
                });
                plan.span_requests.push(SpanRequest::Drafts {
                    entry: plan.drafts.len(),
                });
                plan.drafts.push(DraftRows {
                    handle: h,
                    row: plan.rows.len(),
                    tokens: drafts.to_vec(),
                    logits: Vec::new(),
                });
            }
            n_seqs += 1;
            plan.rows.push((h, end == known + drafts.len()));
        }
        input.seqs.truncate(n_seqs);
        Ok(plan)
    }

    /// Samples one token for every request of `plan` that reached the end of
    /// its known tokens, appends it to the request, and returns
    /// `(handle, token)` pairs in the plan's order.
    pub fn sample(
        &mut self,
        plan: &StepPlan,
        logits: &mut Logits,
    ) -> Result<ModelRunnerOutput, BatchError> {
        if self.sampler.is_some() {
            return self.sample_with_plugin(plan, logits);
        }
        let vocab = logits.vocab_size;
        let mut out = ModelRunnerOutput {
            sampled: Vec::with_capacity(plan.rows.len()),
            logprobs: Vec::with_capacity(plan.rows.len()),
            ..ModelRunnerOutput::default()
        };
        for (row, &(h, samples)) in plan.rows.iter().enumerate() {
            if !samples {
                continue;
            }
            let req = self.get_mut(h)?;
            if req.failed {
                // Failed by a logits processor this step.
                continue;
            }
            let logits_row = &mut logits.data[row * vocab..(row + 1) * vocab];
            // A GPU worker sampling this step on the host (a neighbour is
            // not device-eligible) draws the eligible rows as the device
            // would, so a seeded request's tokens do not depend on its batch.
            #[cfg(feature = "cuda")]
            if let Some(sampled) = device_draw::draw_like_device(req, logits_row) {
                record(&mut out, h, req, sampled);
                continue;
            }
            let sampled = req.sampler.sample(logits_row, &req.params);
            record(&mut out, h, req, sampled);
        }
        Ok(out)
    }

    /// Marks requests as failed: they are not run again, and the scheduler
    /// finishes them once it reads the failure.
    pub fn fail(&mut self, handles: impl Iterator<Item = ReqHandle>) {
        for h in handles {
            if let Some(req) = self.requests.get_mut(h.index()).and_then(Option::as_mut) {
                req.failed = true;
            }
        }
    }

    fn get_mut(&mut self, h: ReqHandle) -> Result<&mut CachedRequestState, BatchError> {
        request_mut(&mut self.requests, h)
    }
}

/// Request `h` of `requests` (a free function, so a caller may hold another
/// field of the batch meanwhile).
fn request_mut(
    requests: &mut [Option<CachedRequestState>],
    h: ReqHandle,
) -> Result<&mut CachedRequestState, BatchError> {
    requests
        .get_mut(h.index())
        .and_then(Option::as_mut)
        .ok_or_else(|| BatchError(format!("request {h:?} is not in the batch")))
}

/// Appends `sampled` to `req` and reports it (with logprobs when asked).
fn record(
    out: &mut ModelRunnerOutput,
    h: ReqHandle,
    req: &mut CachedRequestState,
    sampled: SampledToken,
) {
    req.token_ids.push(sampled.token);
    let mut tokens = NewTokens::default();
    tokens.push(sampled.token);
    out.sampled.push((h, tokens));
    out.logprobs.push(match req.params.logprobs {
        Some(_) => vec![Logprobs {
            logprob: sampled.logprob,
            top: sampled.top_logprobs,
        }],
        None => Vec::new(),
    });
}
