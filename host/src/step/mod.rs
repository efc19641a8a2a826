//! The step types: what crosses the boundary between the engine core and
//! its workers each step (vLLM's `sched/output.py` and `v1/outputs.py`).
//!
//! The scheduler builds a [`SchedulerOutput`], the executor carries it to
//! every worker as an [`RpcValue`] inside an [`RpcRequest`], and each worker
//! answers with a [`ModelRunnerOutput`] in an [`RpcReply`]. The scheduler,
//! the executor, the worker and the server all use these types from here, so
//! none of them reaches into another for them; this module imports only
//! `sampling` (a request's [`SamplingParams`](crate::sampling::SamplingParams)).

mod model_runner_output;
mod rpc;
mod scheduler_output;
mod tokens;

pub use model_runner_output::{Logprobs, ModelRunnerOutput, PromptLogprob, PromptLogprobs};
pub use rpc::{RpcReply, RpcRequest, RpcValue};
pub use scheduler_output::{CachedRequestData, NewRequestData, SchedulerOutput, SpecDecodeTokens};
pub use tokens::NewTokens;

/// The scheduler's compact handle for a live request: an index into its
/// request slots. Handles are what the worker keys its persistent batch by.
/// A handle is reused for a later request only after the scheduler output
/// that reported its request finished, so one output never names a handle
/// both as finished and as a new request.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ReqHandle(pub u32);

impl ReqHandle {
    /// The slot index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
