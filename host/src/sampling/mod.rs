//! Token sampling: per-request parameters, the logits pipeline (penalties,
//! temperature, min-p/top-k/top-p, draw), incremental stop-string detection
//! and finish reasons.

pub mod exp;
pub mod finish;
pub mod nucleus;
pub mod params;
pub mod penalties;
pub mod rng;
pub mod sampler;
pub mod select;
pub mod stop;

pub use finish::{check_token_stop, FinishReason, StopReason};
pub use params::{SamplingParams, SamplingParamsError, GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS};
pub use sampler::{sample_batch, RequestSampler, SampledToken};
pub use stop::{StopChecker, StopUpdate};

#[cfg(test)]
mod tests;
