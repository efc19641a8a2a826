//! Token sampling: per-request parameters, the logits pipeline (penalties,
//! temperature, min-p/top-k/top-p, draw) and incremental stop-string
//! detection. Token-level stops (EOS, stop ids, lengths) are the
//! scheduler's (`scheduler::update_from_output`).

pub mod exp;
pub mod nucleus;
pub mod params;
pub mod penalties;
pub mod rng;
pub mod sampler;
pub mod select;
pub mod stop;

pub use params::{SamplingParams, SamplingParamsError, GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS};
pub use sampler::{sample_batch, PreparedRow, RequestSampler, SampledToken};
pub use stop::{StopChecker, StopUpdate};

#[cfg(test)]
mod tests;
