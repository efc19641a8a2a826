//! What one scheduling step tells the worker (vLLM's `sched/output.py`).
//!
//! # The worker contract (vLLM's persistent batch)
//!
//! [`SchedulerOutput`] is a delta against state the worker keeps per request
//! handle. The worker applies it in this order:
//! 1. drop every handle in `finished_req_ids` (it may never have seen some);
//! 2. take every handle in `preempted_req_ids` out of the batch, keeping its
//!    tokens and sampling parameters (it will come back as resumed);
//! 3. add `scheduled_new_reqs` (prompt, sampling parameters, block table);
//! 4. for `scheduled_cached_reqs`: append `new_block_ids` to the block table,
//!    or replace the table with them when `resumed_from_preemption`;
//! 5. compute `num_scheduled_tokens` tokens for each listed request, starting
//!    at its `num_computed_tokens`, and sample one token for each request whose
//!    computed tokens then reach its full sequence;
//! 6. for a request listed in `scheduled_spec_decode_tokens` (speculative
//!    decoding), its scheduled tokens are its last known token followed by
//!    those draft tokens: sample at each of their positions in order, keep
//!    each draft the sample equals and stop at the first it does not, so
//!    the step yields from one token (no draft kept) to drafts + 1. The
//!    scheduler then takes back the computed slots of the drafts not kept.
//!
//! A handle is reused only after its finish was reported, so steps 1 and 3
//! never conflict.
//!
//! # Async scheduling (`scheduler.async_scheduling`, the default)
//!
//! `num_computed_tokens` is advanced when a step is scheduled, so step N+1
//! is scheduled before step N's tokens are known: after scheduling a
//! decode the scheduler counts one *output placeholder* per request
//! (vLLM's `num_output_placeholders`), schedules
//! `num_tokens + placeholders - num_computed_tokens` tokens next step (the
//! KV manager allocates slots beyond the known tokens), the worker feeds
//! its own previous sample as the next input, and `update_from_output`
//! decrements the placeholders, dropping the tokens of requests that
//! finished meanwhile; a request preempted meanwhile keeps its token (see
//! the scheduler's `update_from_output`).

use serde::{Deserialize, Serialize};

use super::ReqHandle;
use crate::sampling::SamplingParams;

/// A request the worker has not seen yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewRequestData {
    /// The scheduler's handle, which later outputs use.
    pub handle: ReqHandle,
    /// The caller's request id (for logs and errors).
    pub request_id: String,
    /// The prompt.
    pub prompt_token_ids: Vec<u32>,
    /// Tokens the request already generated, for a request replayed after
    /// its workers died (empty otherwise): they are recomputed after the
    /// prompt, and the request's sampler resumes after them.
    #[serde(default)]
    pub output_token_ids: Vec<u32>,
    /// How to sample it.
    pub sampling_params: SamplingParams,
    /// Its whole block table.
    pub block_ids: Vec<u32>,
    /// Tokens already in the KV cache (prefix-cache hits); computation starts here.
    pub num_computed_tokens: u32,
}

/// Requests the worker already holds, as columns (index `i` in every column
/// is one request); block ids are flattened, `new_block_ids(i)` slices them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CachedRequestData {
    /// Handles.
    pub handles: Vec<ReqHandle>,
    /// True when the request comes back from preemption: its `new_block_ids`
    /// are its whole new block table, and it recomputes from
    /// `num_computed_tokens` (its prefix-cache hit, often 0).
    pub resumed_from_preemption: Vec<bool>,
    /// Tokens computed before this step; computation starts here.
    pub num_computed_tokens: Vec<u32>,
    /// `new_block_ids[offsets[i]..offsets[i + 1]]` belong to request `i`.
    pub new_block_offsets: Vec<u32>,
    /// All requests' new block ids, concatenated.
    pub new_block_ids: Vec<u32>,
}

impl CachedRequestData {
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Request `i`'s new block ids.
    pub fn new_block_ids(&self, i: usize) -> &[u32] {
        let (a, b) = (
            self.new_block_offsets[i] as usize,
            self.new_block_offsets[i + 1] as usize,
        );
        &self.new_block_ids[a..b]
    }

    #[inline]
    pub(crate) fn push(
        &mut self,
        handle: ReqHandle,
        resumed: bool,
        num_computed: u32,
        blocks: &[u32],
    ) {
        if self.new_block_offsets.is_empty() {
            self.new_block_offsets.push(0);
        }
        self.handles.push(handle);
        self.resumed_from_preemption.push(resumed);
        self.num_computed_tokens.push(num_computed);
        if !blocks.is_empty() {
            self.new_block_ids.extend_from_slice(blocks);
        }
        self.new_block_offsets.push(self.new_block_ids.len() as u32);
    }

    pub(crate) fn clear(&mut self) {
        self.handles.clear();
        self.resumed_from_preemption.clear();
        self.num_computed_tokens.clear();
        self.new_block_offsets.clear();
        self.new_block_ids.clear();
    }
}

/// Draft tokens to verify this step (speculative decoding), as columns:
/// `handles[i]`'s drafts are `token_ids[offsets[i]..offsets[i + 1]]`, in
/// `num_scheduled_tokens` order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecDecodeTokens {
    /// Requests with drafts.
    pub handles: Vec<ReqHandle>,
    /// `token_ids[offsets[i]..offsets[i + 1]]` belong to request `i`.
    pub offsets: Vec<u32>,
    /// All requests' drafts, concatenated.
    pub token_ids: Vec<u32>,
}

impl SpecDecodeTokens {
    /// Number of requests with drafts.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// True when no request has drafts.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Request `i`'s drafts.
    pub fn drafts(&self, i: usize) -> &[u32] {
        &self.token_ids[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }

    pub(crate) fn push(&mut self, handle: ReqHandle, drafts: &[u32]) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.handles.push(handle);
        self.token_ids.extend_from_slice(drafts);
        self.offsets.push(self.token_ids.len() as u32);
    }

    fn clear(&mut self) {
        self.handles.clear();
        self.offsets.clear();
        self.token_ids.clear();
    }
}

/// One step's schedule, as deltas to the worker's persistent batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerOutput {
    /// Increases by one per `schedule` call.
    pub step_id: u64,
    /// Requests scheduled for the first time.
    pub scheduled_new_reqs: Vec<NewRequestData>,
    /// Requests the worker already knows (continuing or resumed).
    pub scheduled_cached_reqs: CachedRequestData,
    /// Tokens to compute per scheduled request: running requests first, in
    /// running order, then newly admitted ones.
    pub num_scheduled_tokens: Vec<(ReqHandle, u32)>,
    /// Sum of `num_scheduled_tokens` (at most `max_num_batched_tokens`).
    pub total_num_scheduled_tokens: u32,
    /// Requests that finished or were aborted since the previous output.
    pub finished_req_ids: Vec<ReqHandle>,
    /// Requests preempted in this step.
    pub preempted_req_ids: Vec<ReqHandle>,
    /// The draft tokens each speculating request verifies this step
    /// (vLLM's `scheduled_spec_decode_tokens`); counted in
    /// `num_scheduled_tokens`.
    #[serde(default)]
    pub scheduled_spec_decode_tokens: SpecDecodeTokens,
}

impl SchedulerOutput {
    /// Empties every list, keeping capacity, so one output can be reused.
    pub fn clear(&mut self) {
        self.step_id = 0;
        self.scheduled_new_reqs.clear();
        self.scheduled_cached_reqs.clear();
        self.num_scheduled_tokens.clear();
        self.total_num_scheduled_tokens = 0;
        self.finished_req_ids.clear();
        self.preempted_req_ids.clear();
        self.scheduled_spec_decode_tokens.clear();
    }

    /// True when no token is scheduled.
    pub fn is_empty(&self) -> bool {
        self.num_scheduled_tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_request_columns_slice_block_ids() {
        let mut c = CachedRequestData::default();
        c.push(ReqHandle(3), false, 10, &[]);
        c.push(ReqHandle(5), true, 0, &[7, 8, 9]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.new_block_ids(0), &[] as &[u32]);
        assert_eq!(c.new_block_ids(1), &[7, 8, 9]);
        c.clear();
        assert!(c.is_empty());
    }
}
