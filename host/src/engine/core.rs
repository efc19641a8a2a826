//! `EngineCore`: the scheduler and the executor stepped together (vLLM's
//! `EngineCore.step`): schedule → execute_model → sample_tokens →
//! update_from_output. Token-level stops (EOS, stop ids, max_tokens) are
//! decided here; text-level work (detokenizing, stop strings) is the
//! frontend's.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::executor::{Executor, ExecutorError, StepFuture};
use super::kv_events::KvEventPublisher;

mod recovery;
mod utility;
use crate::kv_cache::KvCacheEvent;
use crate::sampling::SamplingParams;
use crate::scheduler::{
    FinishReason, PredictionTokens, Request, RequestOutput, Scheduler, SchedulerError,
    SchedulerStats,
};
use crate::step::{Logprobs, PromptLogprobs, SchedulerOutput};
pub use recovery::{Respawn, Respawned};
pub use utility::UTILITY_METHODS;

/// A request as the engine core receives it: already tokenized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreRequest {
    /// Unique among live requests.
    pub request_id: String,
    /// The prompt's token ids.
    pub prompt_token_ids: Vec<u32>,
    /// How to sample.
    pub sampling_params: SamplingParams,
    /// Under the priority policy a smaller value runs first (as in vLLM).
    pub priority: i32,
    /// Tokens this request already generated: set when a client replays a
    /// request after the engine core that ran it died. The request resumes
    /// as if preempted: these tokens are recomputed, not sampled again, and
    /// count towards `max_tokens`, penalties and the constraint.
    #[serde(default)]
    pub output_token_ids: Vec<u32>,
    /// The client's guess at the output (OpenAI's predicted outputs),
    /// verified as speculative draft tokens while the output follows it;
    /// empty for none. Refused when speculative decoding is off.
    #[serde(default)]
    pub prediction: Vec<u32>,
    /// vLLM's `cache_salt`: the request shares prefix-cache blocks only
    /// with requests of the same salt (one tenant's prompts cannot be
    /// probed by another's timing); `None` shares with unsalted ones.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// What one request produced in one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutput {
    /// The request.
    pub request_id: String,
    /// Tokens generated this step.
    pub new_token_ids: Vec<u32>,
    /// Set on the request's last output.
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: u32,
    /// Parallel to `new_token_ids` when the request asked for logprobs;
    /// empty otherwise.
    pub new_logprobs: Vec<Logprobs>,
    /// Why the request failed, when `finish_reason` is
    /// [`FinishReason::Error`] (names the plugin that faulted).
    #[serde(default)]
    pub error: Option<String>,
    /// The prompt logprobs this step computed, when the request asked for
    /// them (`SamplingParams::prompt_logprobs`): a prompt's arrive in
    /// order over the steps of its prefill, the last with its first token.
    #[serde(default)]
    pub new_prompt_logprobs: Option<PromptLogprobs>,
    /// How the request's predicted output fared so far (`None` without one).
    #[serde(default)]
    pub prediction_tokens: Option<PredictionTokens>,
}

/// Why the engine core cannot go on.
#[derive(Debug, Error)]
pub enum EngineError {
    /// A request was refused; the engine carries on.
    #[error(transparent)]
    Request(#[from] SchedulerError),
    /// The executor failed; the engine is dead.
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    /// A step panicked (a bug); the engine is dead.
    #[error("the engine core panicked: {0}")]
    Panic(String),
    /// The scheduling-policy plugin faulted under `plugins.on_error =
    /// "fail"`; the engine is dead.
    #[error("{0}")]
    Policy(String),
    /// The workers died and could not be restarted (the budget is spent,
    /// or the new ones failed to start); the engine is dead.
    #[error("{0}")]
    Restart(String),
}

/// Per-step timings, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimings {
    /// Seconds spent in `schedule`.
    pub schedule_s: f64,
    /// Seconds in the executor (forward pass and sampling).
    pub execute_s: f64,
    /// Seconds in `update_from_output`.
    pub update_s: f64,
}

/// A step sent to the workers and what the scheduler made of it.
struct InFlight {
    so: SchedulerOutput,
    step: StepFuture,
}

/// The scheduler and the executor.
pub struct EngineCore {
    scheduler: Scheduler,
    executor: Box<dyn Executor>,
    outputs: Vec<RequestOutput>,
    /// Steps sent to the workers, oldest first, with what was scheduled.
    in_flight: VecDeque<InFlight>,
    /// Schedule step N+1 while step N runs.
    async_scheduling: bool,
    /// Whether the latest `submit` sent a step.
    submitted: bool,
    /// Whether the workers sleep (`utility.rs`): nothing is scheduled.
    sleeping: bool,
    last_timings: StepTimings,
    /// Prompt tokens of the requests admitted so far.
    num_prompt_tokens: u64,
    /// Tokens generated so far.
    num_generation_tokens: u64,
    /// The workers' plugin faults so far, by plugin, summed from their
    /// outputs (so a replaced worker group's count carries on).
    worker_plugin_faults: BTreeMap<String, u64>,
    started: Instant,
    /// How to replace dead workers; `None`: a worker death is fatal.
    restart: Option<recovery::WorkerRestart>,
    /// Where the prefix cache's events go (`[kv_events]`).
    kv_events: Option<KvEventPublisher>,
    /// The same events kept for the API server's data-parallel router,
    /// which takes them with each step's outputs; `None` without one.
    routed_events: Option<Vec<KvCacheEvent>>,
}

impl EngineCore {
    /// An engine core over a started executor and a scheduler sized to its
    /// KV cache.
    pub fn new(scheduler: Scheduler, executor: Box<dyn Executor>) -> EngineCore {
        EngineCore {
            scheduler,
            executor,
            outputs: Vec::new(),
            in_flight: VecDeque::new(),
            async_scheduling: false,
            submitted: false,
            sleeping: false,
            last_timings: StepTimings::default(),
            num_prompt_tokens: 0,
            num_generation_tokens: 0,
            worker_plugin_faults: BTreeMap::new(),
            started: Instant::now(),
            restart: None,
            kv_events: None,
            routed_events: None,
        }
    }

    /// Schedules each step while the previous one runs (vLLM's async
    /// scheduling; off unless set). The outputs are the same either way;
    /// what changes is that the engine's own work per step (scheduling,
    /// applying outputs, sending them) overlaps the workers' forward pass
    /// instead of adding to it.
    pub fn with_async_scheduling(mut self, on: bool) -> EngineCore {
        self.async_scheduling = on;
        self
    }

    /// Publishes the prefix cache's events through `publisher` after every
    /// step (and after aborts and utility calls, which free or forget
    /// blocks between steps).
    pub fn with_kv_events(mut self, publisher: KvEventPublisher) -> EngineCore {
        self.scheduler.enable_kv_events();
        self.kv_events = Some(publisher);
        self
    }

    /// Keeps the prefix cache's events for a data-parallel router (see
    /// [`EngineCore::take_routed_events`]).
    pub fn with_routed_kv_events(mut self) -> EngineCore {
        self.scheduler.enable_kv_events();
        self.routed_events = Some(Vec::new());
        self
    }

    /// The events kept for the router since the last call.
    pub fn take_routed_events(&mut self) -> Vec<KvCacheEvent> {
        self.routed_events
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Hands the events recorded since the last call to the publisher and
    /// the router.
    fn flush_kv_events(&mut self) {
        if self.kv_events.is_none() && self.routed_events.is_none() {
            return;
        }
        let events = self.scheduler.take_kv_events();
        if let Some(routed) = &mut self.routed_events {
            routed.extend_from_slice(&events);
        }
        if let Some(publisher) = &mut self.kv_events {
            publisher.publish(events);
        }
    }

    /// Queues a request; an impossible one is refused at once with the reason.
    pub fn add_request(&mut self, req: EngineCoreRequest) -> Result<(), SchedulerError> {
        let arrival = self.started.elapsed().as_secs_f64();
        let prompt_len = req.prompt_token_ids.len() as u64;
        let request = Request::new(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            arrival,
            req.priority,
        );
        let request = request
            .with_output(&req.output_token_ids)
            .with_prediction(req.prediction)
            .with_cache_salt(req.cache_salt.as_deref());
        self.scheduler.add_request(request)?;
        self.num_prompt_tokens += prompt_len;
        Ok(())
    }

    /// Aborts requests (unknown or finished ids are ignored: aborts are
    /// idempotent). Their blocks are freed now; the worker forgets them at
    /// the next step.
    pub fn abort_requests(&mut self, request_ids: &[String]) {
        for id in request_ids {
            self.scheduler.abort_request(id);
        }
        self.flush_kv_events();
    }

    /// Aborts every request (shutdown without draining).
    pub fn abort_all(&mut self) {
        self.scheduler.abort_all();
    }

    /// True while a step has something to do (never while the workers
    /// sleep: requests wait for `wake_up`).
    pub fn has_work(&self) -> bool {
        !self.sleeping
            && (self.scheduler.has_unfinished_requests()
                || self.scheduler.has_finished_requests()
                || !self.in_flight.is_empty())
    }

    /// Runs one step: [`submit`](Self::submit) then
    /// [`collect`](Self::collect). Under async scheduling the outputs are
    /// those of the previous step (the first call returns none).
    pub fn step(&mut self) -> Result<Vec<EngineCoreOutput>, EngineError> {
        self.submit()?;
        self.collect()
    }

    /// The first half of a step: schedules and sends the next step to the
    /// workers unless the workers sleep, the pipeline is full (one step in flight, two under
    /// async scheduling) or there is nothing to run.
    pub fn submit(&mut self) -> Result<(), EngineError> {
        self.submitted = false;
        if self.sleeping || self.in_flight.len() >= self.pipeline_depth() {
            return Ok(());
        }
        let t0 = Instant::now();
        let so: SchedulerOutput = self.scheduler.schedule();
        if let Some(failure) = self.scheduler.policy_failure() {
            return Err(EngineError::Policy(failure.to_string()));
        }
        self.last_timings.schedule_s = t0.elapsed().as_secs_f64();
        if so.is_empty() && so.finished_req_ids.is_empty() {
            return Ok(());
        }
        let step = self.executor.submit_step(&so)?;
        self.in_flight.push_back(InFlight { so, step });
        self.submitted = true;
        Ok(())
    }

    /// The second half of a step: waits for the oldest step in flight and
    /// applies its tokens, unless the pipeline is still filling (a step was
    /// just submitted and there is room for another). Returns what each of
    /// its requests produced.
    pub fn collect(&mut self) -> Result<Vec<EngineCoreOutput>, EngineError> {
        let filling = self.submitted && self.in_flight.len() < self.pipeline_depth();
        if filling {
            return Ok(Vec::new());
        }
        let Some(InFlight { so, step }) = self.in_flight.pop_front() else {
            return Ok(Vec::new());
        };
        let t1 = Instant::now();
        let mut sampled = step.wait()?;
        let t2 = Instant::now();
        for (name, n) in sampled.plugin_faults.drain(..) {
            *self.worker_plugin_faults.entry(name).or_default() += n;
        }
        self.scheduler
            .update_from_output_into(&so, &sampled.sampled, &mut self.outputs);
        let failed = sampled.failed.iter().map(|(h, _)| h);
        self.scheduler.fail_requests(failed, &mut self.outputs);
        let t3 = Instant::now();
        self.last_timings.execute_s = (t2 - t1).as_secs_f64();
        self.last_timings.update_s = (t3 - t2).as_secs_f64();
        if let Some(r) = self.restart.as_mut() {
            r.note_outputs(self.outputs.len());
        }
        let mut out = Vec::with_capacity(self.outputs.len());
        for o in &self.outputs {
            self.num_generation_tokens += o.new_token_ids.len() as u64;
            let request_id = self
                .scheduler
                .request_id(o.handle)
                .unwrap_or_default()
                .to_string();
            out.push(EngineCoreOutput {
                request_id,
                new_token_ids: o.new_token_ids.to_vec(),
                finish_reason: o.finish_reason,
                num_cached_tokens: o.num_cached_tokens,
                // Tokens after a stop were dropped: so are their logprobs.
                new_logprobs: sampled
                    .logprobs_of(o.handle)
                    .iter()
                    .take(o.new_token_ids.len())
                    .cloned()
                    .collect(),
                error: match o.finish_reason {
                    Some(FinishReason::Error) => sampled.failure_of(o.handle).map(str::to_string),
                    _ => None,
                },
                new_prompt_logprobs: None,
                prediction_tokens: o.prediction_tokens,
            });
        }
        self.flush_kv_events();
        // Prompt logprobs go with the request's output of the step, or in
        // an output of their own (a partial prefill samples nothing).
        for (h, chunk) in sampled.prompt_logprobs.drain(..) {
            if let Some(i) = self.outputs.iter().position(|o| o.handle == h) {
                out[i].new_prompt_logprobs = Some(chunk);
            } else if let Some(req) = self.scheduler.request(h) {
                out.push(EngineCoreOutput {
                    request_id: self.scheduler.request_id(h).unwrap_or_default().into(),
                    new_token_ids: Vec::new(),
                    finish_reason: None,
                    num_cached_tokens: req.num_cached_tokens() as u32,
                    new_logprobs: Vec::new(),
                    error: None,
                    new_prompt_logprobs: Some(chunk),
                    prediction_tokens: req.prediction_tokens(),
                });
            }
        }
        Ok(out)
    }

    /// Steps sent to the workers and not yet collected at most.
    fn pipeline_depth(&self) -> usize {
        if self.async_scheduling {
            2
        } else {
            1
        }
    }

    /// An error once the executor lost a worker, even with no step running;
    /// the busy loop checks it while idle so a dead worker is noticed
    /// before the next request arrives.
    pub fn check_health(&self) -> Result<(), EngineError> {
        match self.executor.worker_death() {
            Some(death) => Err(EngineError::Executor(death)),
            None => Ok(()),
        }
    }

    /// The scheduler's counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            scheduler: self.scheduler.make_stats(),
            num_prompt_tokens: self.num_prompt_tokens,
            num_generation_tokens: self.num_generation_tokens,
            last_step: self.last_timings,
            num_worker_restarts: self.restart.as_ref().map_or(0, |r| r.num_restarts),
            num_worker_replayed_requests: self.restart.as_ref().map_or(0, |r| r.num_replayed),
            plugin_faults: self.plugin_faults(),
        }
    }

    /// The workers' plugin faults as reported and the policy's.
    fn plugin_faults(&self) -> BTreeMap<String, u64> {
        let mut faults = self.worker_plugin_faults.clone();
        if let Some((name, n)) = self.scheduler.policy_faults() {
            *faults.entry(name.to_string()).or_default() += n;
        }
        faults
    }

    /// The scheduler (read-only), for invariant checks in tests.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }
}

/// Counters for the metrics endpoint.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EngineStats {
    /// Running / waiting counts, KV usage, prefix-cache hits, preemptions.
    pub scheduler: SchedulerStats,
    /// Prompt tokens of all requests admitted.
    pub num_prompt_tokens: u64,
    /// Tokens generated.
    pub num_generation_tokens: u64,
    /// Timings of the latest step.
    pub last_step: StepTimings,
    /// Times the worker group died and was restarted.
    #[serde(default)]
    pub num_worker_restarts: u64,
    /// Requests replayed by recompute after those restarts.
    #[serde(default)]
    pub num_worker_replayed_requests: u64,
    /// Faults of each plugin in use (scheduling policy, logits processors,
    /// sampler) by qualified name; each was recovered from by recreating
    /// the instance.
    #[serde(default)]
    pub plugin_faults: BTreeMap<String, u64>,
}
