//! Why a request stopped generating, and the token-level stop check.

use serde::{Deserialize, Serialize};

use super::params::SamplingParams;

/// Why a sequence finished; serialised as OpenAI's `finish_reason`
/// (`"stop"` / `"length"`) plus vLLM's `stop_reason`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// The model or a user-given stop condition ended the sequence.
    Stop(StopReason),
    /// `max_tokens` (or the context length) was reached.
    Length,
}

/// Which stop condition fired.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The tokenizer's end-of-sequence token was generated.
    Eos,
    /// A token from `stop_token_ids` was generated.
    StopToken(u32),
    /// A string from `stop` appeared in the output text.
    StopString(String),
}

impl FinishReason {
    /// OpenAI's `finish_reason` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop(_) => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Decides, after `token` became output token number `num_output_tokens`
/// (counting it), whether the sequence is finished.
///
/// Like vLLM's `check_stop`: EOS (unless `ignore_eos`) and stop tokens only
/// count once `min_tokens` tokens were generated. A stop condition is
/// reported in preference to `Length` when both hold on the same token,
/// because it is the more specific reason.
pub fn check_token_stop(
    token: u32,
    num_output_tokens: usize,
    params: &SamplingParams,
    eos_token_id: Option<u32>,
) -> Option<FinishReason> {
    if num_output_tokens >= params.min_tokens as usize {
        if !params.ignore_eos && eos_token_id == Some(token) {
            return Some(FinishReason::Stop(StopReason::Eos));
        }
        if params.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop(StopReason::StopToken(token)));
        }
    }
    (num_output_tokens >= params.max_tokens as usize).then_some(FinishReason::Length)
}
