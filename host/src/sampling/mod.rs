//! Token sampling: per-request parameters, the logits pipeline (the
//! request's token filters, penalties, temperature, min-p/top-k/top-p,
//! draw) and incremental stop-string detection. Token-level stops (EOS, stop ids, lengths) are the
//! scheduler's (`scheduler::update_from_output`).

pub mod exp;
pub mod nucleus;
pub mod params;
pub mod penalties;
pub mod rng;
pub mod sampler;
pub mod select;
pub mod stop;
pub mod token_filters;
pub mod vocabulary;

pub use params::{
    SamplingParams, SamplingParamsError, GREEDY_TEMPERATURE_EPS, MAX_BAD_WORD_SEQUENCES,
    MAX_BAD_WORD_TOKENS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_TOKEN_ID_LIST, STRUCTURED_OUTPUTS_KEY,
};
pub use sampler::{sample_batch, PreparedRow, RequestSampler, SampledToken};
pub use stop::{StopChecker, StopUpdate};
pub use vocabulary::Vocabulary;

#[cfg(test)]
mod tests;
