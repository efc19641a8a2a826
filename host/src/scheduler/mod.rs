//! The scheduler (vLLM V1's `Scheduler`): decides each step which requests
//! compute how many tokens within a token budget, admits waiting requests,
//! preempts by recompute when KV blocks run out, and turns sampled tokens
//! into per-request outputs and finishes.
//!
//! There is no prefill or decode phase: every request has
//! `num_computed_tokens` and catches up to its token count, a few tokens per
//! step (decode) or a chunk (prefill). See [`Scheduler::schedule_into`] for
//! the algorithm and [`output`] for the worker contract.
//!
//! The hot path (a step of running decodes) allocates nothing once buffers
//! have grown, looks requests up by slot index, and hashes only when a
//! request's block fills.

pub mod config;
pub mod error;
mod ngram;
pub mod output;
pub mod policy;
mod policy_plugin;
mod prediction;
pub mod request;
mod restart;
mod schedule;
mod spec_stats;
mod update;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

pub use crate::step::NewTokens;
pub use config::SchedulerConfig;
pub use error::SchedulerError;
pub use ngram::NgramProposer;
pub use output::RequestOutput;
pub use policy::{
    builtin_policy, Fcfs, Priority, RunningView, SchedulingPolicy, WaitingView, BUILTIN_POLICIES,
};
pub use policy_plugin::{policy_from_config, policy_from_host};
pub use prediction::PredictionTokens;
pub use request::{FinishReason, Request, RequestStatus};
pub use spec_stats::SpecDecodingStats;

use crate::kv_cache::{KVCacheManager, PrefixCacheStats};
use crate::step::ReqHandle;

/// Counters and gauges for logging and the metrics endpoint.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerStats {
    /// Requests in the running batch.
    pub num_running: usize,
    /// Requests waiting (new or preempted).
    pub num_waiting: usize,
    /// Fraction of KV blocks in use.
    pub kv_cache_usage: f64,
    /// Prefix-cache counters (tokens queried and hit at admission).
    pub prefix_cache: PrefixCacheStats,
    /// Preemptions since start.
    pub num_preemptions: u64,
    /// Speculative decoding's counters.
    #[serde(default)]
    pub spec_decoding: SpecDecodingStats,
    /// Policy answers that were invalid and replaced by FCFS.
    pub num_policy_fallbacks: u64,
    /// The KV cache's shape, for `vllm:cache_config_info`.
    pub cache_config: CacheConfigInfo,
}

/// The KV cache's shape as routers read it (vLLM's `cache_config_info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CacheConfigInfo {
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks in the cache (vLLM's `num_gpu_blocks`).
    pub num_blocks: u32,
    /// Whether full blocks are reused across requests.
    pub enable_prefix_caching: bool,
}

/// Reusable per-step buffers, so steady-state steps do not allocate.
#[derive(Debug, Default)]
struct Scratch {
    /// Requests scheduled this step, in order.
    scheduled: Vec<Scheduled>,
    ids: Vec<u32>,
    lens: Vec<u32>,
    priorities: Vec<i32>,
    arrivals: Vec<f64>,
    order: Vec<u32>,
    seen: Vec<bool>,
    /// Per slot: the step whose output last listed it (update dedup).
    mark: Vec<u64>,
    /// This step's draft tokens, all requests' concatenated.
    drafts: Vec<u32>,
}

/// How a request entered this step's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Running,
    New,
    Resumed,
}

#[derive(Debug, Clone)]
struct Scheduled {
    handle: ReqHandle,
    num_tokens: usize,
    /// First block of the table added this step.
    first_new_block: usize,
    kind: Kind,
    /// The request's draft tokens, `scratch.drafts[drafts]` (counted in
    /// `num_tokens`).
    drafts: std::ops::Range<usize>,
}

/// vLLM V1's scheduler over a [`KVCacheManager`] and a [`SchedulingPolicy`].
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KVCacheManager,
    policy: Box<dyn SchedulingPolicy>,
    slots: Vec<Option<Request>>,
    /// Each slot's latest request id, kept after the request finishes until
    /// the slot is reused, so outputs can be named.
    slot_ids: Vec<Arc<str>>,
    free_slots: Vec<u32>,
    /// Slots whose finish the last output reported: reusable next step.
    recycle: Vec<u32>,
    ids: HashMap<Arc<str>, ReqHandle>,
    running: Vec<ReqHandle>,
    waiting: VecDeque<ReqHandle>,
    finished_since_last: Vec<ReqHandle>,
    step_id: u64,
    num_preemptions: u64,
    num_policy_fallbacks: u64,
    /// Proposes draft tokens, when speculative decoding is on.
    proposer: Option<NgramProposer>,
    spec_stats: SpecDecodingStats,
    scratch: Scratch,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("policy", &self.policy.name())
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .field("step_id", &self.step_id)
            .finish()
    }
}

impl Scheduler {
    /// A scheduler with the built-in policy named in `config.policy`.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        let policy = builtin_policy(&config.policy)?;
        Self::with_policy(config, policy)
    }

    /// A scheduler with a given policy (a plugin); `config.policy` is ignored.
    pub fn with_policy(
        config: SchedulerConfig,
        policy: Box<dyn SchedulingPolicy>,
    ) -> Result<Self, SchedulerError> {
        config.validate()?;
        let kv = KVCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
        )?;
        Ok(Self {
            proposer: config.ngram_proposer(),
            spec_stats: SpecDecodingStats::new(config.num_speculative_tokens as usize),
            config,
            kv,
            policy,
            slots: Vec::new(),
            slot_ids: Vec::new(),
            free_slots: Vec::new(),
            recycle: Vec::new(),
            ids: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            finished_since_last: Vec::new(),
            step_id: 0,
            num_preemptions: 0,
            num_policy_fallbacks: 0,
            scratch: Scratch::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The policy's qualified name.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The policy's fatal fault, if it had one (see
    /// [`SchedulingPolicy::failure`]).
    pub fn policy_failure(&self) -> Option<&str> {
        self.policy.failure()
    }

    /// The policy's qualified name and its faults so far, for a policy
    /// that can fault (see [`SchedulingPolicy::faults`]).
    pub fn policy_faults(&self) -> Option<(&str, u64)> {
        Some((self.policy.name(), self.policy.faults()?))
    }

    /// The KV cache manager (read-only).
    pub fn kv_cache_manager(&self) -> &KVCacheManager {
        &self.kv
    }

    /// Queues a request. Rejects at once, with the reason, a request that
    /// could never finish: empty prompt, invalid sampling parameters, `n > 1`,
    /// prompt + `max_tokens` over `max_model_len`, or more KV than the whole
    /// cache holds. Returns the handle outputs will use.
    pub fn add_request(&mut self, mut req: Request) -> Result<ReqHandle, SchedulerError> {
        self.check_admissible(&req)?;
        req.status = RequestStatus::Waiting;
        let handle = match self.free_slots.pop() {
            Some(i) => {
                self.slot_ids[i as usize] = req.request_id.clone();
                ReqHandle(i)
            }
            None => {
                self.slots.push(None);
                self.slot_ids.push(req.request_id.clone());
                self.scratch.mark.push(0);
                ReqHandle(self.slots.len() as u32 - 1)
            }
        };
        self.ids.insert(req.request_id.clone(), handle);
        self.slots[handle.index()] = Some(req);
        self.waiting.push_back(handle);
        Ok(handle)
    }

    fn check_admissible(&self, req: &Request) -> Result<(), SchedulerError> {
        let id = || req.request_id.to_string();
        if self.ids.contains_key(&req.request_id) {
            return Err(SchedulerError::DuplicateRequestId(id()));
        }
        if req.all_token_ids.is_empty() {
            return Err(SchedulerError::EmptyPrompt(id()));
        }
        let params = &req.sampling_params;
        params
            .validate()
            .map_err(|source| SchedulerError::InvalidSamplingParams {
                request_id: id(),
                source,
            })?;
        if params.n != 1 {
            return Err(SchedulerError::UnsupportedN {
                request_id: id(),
                n: params.n,
            });
        }
        if req.num_output_tokens() >= params.max_tokens as usize {
            return Err(SchedulerError::NothingLeftToGenerate {
                request_id: id(),
                num_output: req.num_output_tokens(),
                max_tokens: params.max_tokens,
            });
        }
        // A replayed request's output counts against max_tokens, not twice.
        let prompt_len = req.num_prompt_tokens;
        let total = prompt_len as u64 + u64::from(params.max_tokens);
        let max_len = self.config.max_model_len;
        if total > u64::from(max_len) {
            let fix = if prompt_len as u64 >= u64::from(max_len) {
                format!("shorten the prompt below {max_len} tokens")
            } else {
                format!(
                    "lower max_tokens to at most {}",
                    u64::from(max_len) - prompt_len as u64
                )
            };
            return Err(SchedulerError::ExceedsMaxModelLen {
                request_id: id(),
                prompt_len,
                max_tokens: params.max_tokens,
                total,
                max_model_len: max_len,
                fix,
            });
        }
        // The last sampled token's KV is never computed.
        let tokens = total - 1;
        let block_size = u64::from(self.config.block_size);
        let blocks_needed = tokens.div_ceil(block_size);
        if blocks_needed > u64::from(self.config.num_blocks) {
            return Err(SchedulerError::ExceedsKvCache {
                request_id: id(),
                tokens,
                blocks_needed,
                block_size: self.config.block_size,
                num_blocks: self.config.num_blocks,
            });
        }
        if req.prediction.is_some() && self.proposer.is_none() {
            return Err(SchedulerError::PredictionWithoutDrafts(id()));
        }
        Ok(())
    }

    /// Aborts a queued or running request, freeing all its blocks; the next
    /// output lists it in `finished_req_ids`. Returns false for an unknown
    /// (or already finished) id.
    pub fn abort_request(&mut self, request_id: &str) -> bool {
        let Some(handle) = self.ids.get(request_id).copied() else {
            return false;
        };
        let status = self.slots[handle.index()].as_ref().map(|r| r.status);
        match status {
            Some(RequestStatus::Running) => self.running.retain(|&h| h != handle),
            _ => self.waiting.retain(|&h| h != handle),
        }
        self.finish(handle, FinishReason::Abort);
        true
    }

    /// Aborts every queued and running request (an engine shutting down
    /// without draining).
    pub fn abort_all(&mut self) {
        for handle in std::mem::take(&mut self.running)
            .into_iter()
            .chain(std::mem::take(&mut self.waiting))
        {
            self.finish(handle, FinishReason::Abort);
        }
    }

    /// Frees a request's blocks and slot; the next output reports it.
    fn finish(&mut self, handle: ReqHandle, reason: FinishReason) {
        if let Some(mut req) = self.slots[handle.index()].take() {
            req.status = RequestStatus::Finished(reason);
            self.kv
                .free(&mut req.kv, &req.all_token_ids, req.num_computed_tokens);
            self.ids.remove(&req.request_id);
            self.finished_since_last.push(handle);
        }
    }

    /// A live request by handle.
    pub fn request(&self, handle: ReqHandle) -> Option<&Request> {
        self.slots.get(handle.index())?.as_ref()
    }

    /// The id of the request behind `handle`: live, or finished and not yet
    /// replaced. A finished request's handle is reused at the earliest by a
    /// request added after the second `schedule` call following its finish,
    /// so outputs can always be named right after `update_from_output`.
    pub fn request_id(&self, handle: ReqHandle) -> Option<&str> {
        self.slot_ids.get(handle.index()).map(|id| &**id)
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// True while any request is queued or running.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// True when finishes are waiting to be reported by the next output
    /// (the engine should still call `schedule` so the worker drops them).
    pub fn has_finished_requests(&self) -> bool {
        !self.finished_since_last.is_empty()
    }

    /// Records the prefix cache's events from now on (for routers).
    pub fn enable_kv_events(&mut self) {
        self.kv.enable_events();
    }

    /// The prefix cache's events since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_cache::KvCacheEvent> {
        self.kv.take_events()
    }

    /// Forgets all cached prefixes (e.g. after a weight update).
    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_prefix_cache();
    }

    /// Current counters.
    pub fn make_stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kv_cache_usage: self.kv.usage(),
            prefix_cache: self.kv.prefix_cache_stats(),
            num_preemptions: self.num_preemptions,
            spec_decoding: self.spec_stats.clone(),
            num_policy_fallbacks: self.num_policy_fallbacks,
            cache_config: CacheConfigInfo {
                block_size: self.config.block_size,
                num_blocks: self.config.num_blocks,
                enable_prefix_caching: self.config.enable_prefix_caching,
            },
        }
    }

    /// Checks the scheduler's invariants (O(requests + blocks); for tests and
    /// debugging): every block's reference count equals the number of live
    /// requests holding it, free + used = total, queues agree with statuses,
    /// running requests' tables cover their computed tokens and queued ones
    /// hold no blocks.
    pub fn check_invariants(&self) -> Result<(), String> {
        let pool = self.kv.pool();
        pool.check_invariants()?;
        let mut owners = vec![0u32; pool.num_blocks() as usize];
        let mut live = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(req) = slot else { continue };
            live += 1;
            for &b in req.kv.block_ids() {
                owners[b as usize] += 1;
            }
            let in_running = self.running.contains(&ReqHandle(i as u32));
            let in_waiting = self.waiting.contains(&ReqHandle(i as u32));
            match req.status {
                RequestStatus::Running if in_running && !in_waiting => {
                    let covered = req.kv.block_ids().len() * self.kv.block_size();
                    if covered < req.num_computed_tokens {
                        return Err(format!(
                            "request {i}: {covered} slots for {} computed tokens",
                            req.num_computed_tokens
                        ));
                    }
                }
                RequestStatus::Waiting | RequestStatus::Preempted if in_waiting && !in_running => {
                    if !req.kv.block_ids().is_empty() || req.num_computed_tokens != 0 {
                        return Err(format!(
                            "queued request {i} holds blocks or computed tokens"
                        ));
                    }
                }
                s => {
                    return Err(format!(
                        "request {i}: status {s:?}, running {in_running}, waiting {in_waiting}"
                    ))
                }
            }
        }
        for (b, &n) in owners.iter().enumerate() {
            if n != pool.ref_count(b as u32) {
                return Err(format!(
                    "block {b}: {n} owners but ref count {}",
                    pool.ref_count(b as u32)
                ));
            }
        }
        let used = owners.iter().filter(|&&n| n > 0).count() as u32;
        if used + pool.num_free_blocks() != pool.num_blocks() {
            return Err(format!(
                "{used} used + {} free != {}",
                pool.num_free_blocks(),
                pool.num_blocks()
            ));
        }
        if live != self.running.len() + self.waiting.len() || live != self.ids.len() {
            return Err(format!(
                "{live} live requests, {} running, {} waiting, {} ids",
                self.running.len(),
                self.waiting.len(),
                self.ids.len()
            ));
        }
        if self.running.len() > self.config.max_num_seqs as usize {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        Ok(())
    }
}
