//! Errors the scheduler reports: bad configuration and requests that can
//! never run. Each message names the offending value and how to fix it.

use thiserror::Error;

use crate::kv_cache::KvCacheError;
use crate::sampling::SamplingParamsError;

/// Why a scheduler could not be built or a request was rejected.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SchedulerError {
    /// A [`SchedulerConfig`](super::SchedulerConfig) field is out of range.
    #[error("scheduler config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The field's name.
        field: &'static str,
        /// The rejected value, formatted.
        value: String,
        /// What is required instead.
        reason: String,
    },
    /// The KV cache could not be built.
    #[error("scheduler config: {0}")]
    KvCache(#[from] KvCacheError),
    /// The configured policy name is not a built-in one.
    #[error("unknown scheduling policy {name:?}; known built-in policies: {known}")]
    UnknownPolicy {
        /// The name that was asked for.
        name: String,
        /// The known names, comma separated.
        known: String,
    },
    /// A live request already uses this id.
    #[error("request {0:?}: a request with this id is already queued or running; use a unique id")]
    DuplicateRequestId(String),
    /// The prompt has no tokens.
    #[error("request {0:?}: the prompt is empty; at least one prompt token is required")]
    EmptyPrompt(String),
    /// A replayed request already holds every token `max_tokens` allows.
    #[error("request {request_id:?}: replayed with {num_output} output tokens, but max_tokens is {max_tokens}; a finished request is not replayed")]
    NothingLeftToGenerate {
        /// The request.
        request_id: String,
        /// Tokens it already generated.
        num_output: usize,
        /// Its `max_tokens`.
        max_tokens: u32,
    },
    /// The sampling parameters are invalid.
    #[error("request {request_id:?}: {source}")]
    InvalidSamplingParams {
        /// The request.
        request_id: String,
        /// What was wrong.
        source: SamplingParamsError,
    },
    /// `n` must be 1 here: the engine fans `n > 1` out into `n` requests.
    #[error("request {request_id:?}: n = {n}, but the scheduler runs one sequence per request; expand n > 1 into n requests before adding them")]
    UnsupportedN {
        /// The request.
        request_id: String,
        /// The requested number of sequences.
        n: u32,
    },
    /// Prompt plus `max_tokens` does not fit in the model's context.
    #[error("request {request_id:?}: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds max_model_len ({max_model_len}); {fix}")]
    ExceedsMaxModelLen {
        /// The request.
        request_id: String,
        /// Prompt length in tokens.
        prompt_len: usize,
        /// The request's `max_tokens`.
        max_tokens: u32,
        /// Their sum.
        total: u64,
        /// The configured context length.
        max_model_len: u32,
        /// How to make it fit.
        fix: String,
    },
    /// The request's KV would not fit even in an otherwise empty cache, so
    /// it could never finish (vLLM hangs on this, issue #35541).
    #[error("request {request_id:?}: needs {blocks_needed} KV blocks ({tokens} tokens at {block_size} per block) but the whole KV cache has {num_blocks}; lower max_tokens, shorten the prompt, or give the KV cache more memory")]
    ExceedsKvCache {
        /// The request.
        request_id: String,
        /// Tokens whose KV must be held at once (prompt + max_tokens - 1).
        tokens: u64,
        /// Blocks those tokens need.
        blocks_needed: u64,
        /// Tokens per block.
        block_size: u32,
        /// Blocks in the whole cache.
        num_blocks: u32,
    },
    /// The request carries a prediction of its output, which is verified
    /// as speculative drafts, and speculative decoding is off.
    #[error("request {0:?}: a predicted output is verified as speculative draft tokens, and speculative decoding is off; start the server with --speculative-config '{{\"num_speculative_tokens\": 4}}' (or [speculative] in the config; CPU workers only), or drop `prediction`")]
    PredictionWithoutDrafts(String),
}
