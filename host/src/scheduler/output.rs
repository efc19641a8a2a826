//! What `update_from_output` tells the engine: each request's new tokens and
//! finish. What a step tells the worker is [`crate::step::SchedulerOutput`].

use super::prediction::PredictionTokens;
use super::request::FinishReason;
use crate::step::{NewTokens, ReqHandle};

/// What one request produced in one step. It names the request by handle
/// only (cloning the id string per token would cost more than the rest of
/// the step); [`Scheduler::request_id`](super::Scheduler::request_id) maps it
/// back, including for requests that just finished.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    /// The scheduler's handle.
    pub handle: ReqHandle,
    /// Tokens appended this step (a stop token is included).
    pub new_token_ids: NewTokens,
    /// Set when the request finished this step; its blocks are freed.
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub num_cached_tokens: u32,
    /// How the request's predicted output fared so far (`None` without one).
    pub prediction_tokens: Option<PredictionTokens>,
}
