//! `[speculative]`: speculative decoding (vLLM's `SpeculativeConfig`), by
//! n-gram lookup in the request's own tokens: each decode step also
//! computes up to `num_speculative_tokens` guessed tokens and keeps those
//! the model would have produced, so one step can yield several tokens.
//! The output is the same as without it.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// vLLM's n-gram lengths when neither is given.
const DEFAULT_PROMPT_LOOKUP: usize = 5;

/// The most draft tokens per step the engine accepts.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

/// `[speculative]`: what vLLM's `--speculative-config` holds, for the
/// `ngram` method.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpeculativeConfig {
    /// How drafts are proposed: `ngram` (the only method; draft models,
    /// EAGLE and MTP need a second model).
    pub method: String,
    /// Draft tokens verified per decode step; 0 (the default) turns
    /// speculative decoding off.
    pub num_speculative_tokens: usize,
    /// Shortest suffix of the sequence the lookup matches (unset: as
    /// `prompt_lookup_max`, or 5 when both are unset, as in vLLM).
    pub prompt_lookup_min: Option<usize>,
    /// Longest suffix the lookup tries first (unset: as
    /// `prompt_lookup_min`, or 5 when both are unset).
    pub prompt_lookup_max: Option<usize>,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            method: "ngram".into(),
            num_speculative_tokens: 0,
            prompt_lookup_min: None,
            prompt_lookup_max: None,
        }
    }
}

impl SpeculativeConfig {
    /// Whether decode steps verify drafts.
    pub fn enabled(&self) -> bool {
        self.num_speculative_tokens > 0
    }

    /// The shortest suffix matched, defaults applied.
    pub fn lookup_min(&self) -> usize {
        self.prompt_lookup_min
            .or(self.prompt_lookup_max)
            .unwrap_or(DEFAULT_PROMPT_LOOKUP)
    }

    /// The longest suffix matched, defaults applied.
    pub fn lookup_max(&self) -> usize {
        self.prompt_lookup_max
            .or(self.prompt_lookup_min)
            .unwrap_or(DEFAULT_PROMPT_LOOKUP)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if self.method != "ngram" {
            return invalid(
                "speculative.method",
                format!(
                    "is `{}`; the engine proposes drafts by n-gram lookup only: use `ngram` \
                     (draft models, EAGLE and MTP need a second model it does not load)",
                    self.method
                ),
            );
        }
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS {
            return invalid(
                "speculative.num_speculative_tokens",
                format!(
                    "must be at most {MAX_SPECULATIVE_TOKENS}, got {}",
                    self.num_speculative_tokens
                ),
            );
        }
        let (min, max) = (self.lookup_min(), self.lookup_max());
        if min == 0 || min > max || max > 1024 {
            return invalid(
                "speculative.prompt_lookup_min",
                format!(
                    "prompt_lookup_min ({min}) must be at least 1 and at most \
                     prompt_lookup_max ({max}), itself at most 1024"
                ),
            );
        }
        Ok(())
    }
}
