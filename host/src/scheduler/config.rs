//! The scheduler's configuration (vLLM's `SchedulerConfig` plus the cache
//! settings the scheduler needs), resolved from the operator's
//! [`EngineConfig`]: its `[scheduler]` and `[cache]` sections, the model's
//! context length and the KV blocks the workers could hold. The defaults
//! live in `crate::config` alone.

use serde::{Deserialize, Serialize};

use super::ngram::NgramProposer;
use super::SchedulerError;
use crate::config::{EngineConfig, MAX_SPECULATIVE_TOKENS};

/// Limits and switches for one scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most requests in the running batch at once (vLLM default 256 on
    /// most GPUs).
    pub max_num_seqs: u32,
    /// Most tokens scheduled in one step, over all requests (the token
    /// budget).
    pub max_num_batched_tokens: u32,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: u32,
    /// Caps one request's prefill chunk per step so long prompts do not
    /// starve others; 0 disables the cap.
    pub long_prefill_token_threshold: u32,
    /// Split prompts longer than the remaining budget across steps. When off,
    /// a prompt is scheduled whole or not at all (then `max_num_batched_tokens`
    /// must be at least `max_model_len`).
    pub enable_chunked_prefill: bool,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks available. The engine sets it from the worker's
    /// `determine_available_memory`; 0 (the default) is rejected by
    /// [`validate`](Self::validate).
    pub num_blocks: u32,
    /// Reuse the KV of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// The model's end-of-sequence token; `None` means only `max_tokens`,
    /// `stop_token_ids` and aborts end requests.
    pub eos_token_id: Option<u32>,
    /// The scheduling policy's qualified name: `builtin:fcfs` or
    /// `builtin:priority` (plugins are passed to `Scheduler::with_policy`).
    pub policy: String,
    /// Most draft tokens a decode verifies per step (speculative decoding
    /// by n-gram lookup); 0 turns it off.
    pub num_speculative_tokens: u32,
    /// Shortest suffix the n-gram lookup matches.
    pub prompt_lookup_min: u32,
    /// Longest suffix the n-gram lookup tries first.
    pub prompt_lookup_max: u32,
}

impl Default for SchedulerConfig {
    /// [`SchedulerConfig::new`] with `num_blocks` still to be set (0).
    fn default() -> Self {
        Self::new(0)
    }
}

impl SchedulerConfig {
    /// The default configuration's scheduler (vLLM's defaults: 256
    /// sequences, 2048 batched tokens, chunked prefill and prefix caching
    /// on, block size 16) with an 8192-token context, FCFS and a cache of
    /// `num_blocks` blocks.
    pub fn new(num_blocks: u32) -> Self {
        Self::from_engine_config(&EngineConfig::default(), 8192, num_blocks)
            .expect("the default configuration's limits fit in u32")
    }

    /// The scheduler `config` describes, for a context of `max_model_len`
    /// tokens and a cache of `num_blocks` blocks; the policy is
    /// `builtin:fcfs` and no end-of-sequence token is set (the engine sets
    /// both from what it loaded). A limit that does not fit in 32 bits is
    /// an error naming it.
    pub fn from_engine_config(
        config: &EngineConfig,
        max_model_len: usize,
        num_blocks: u32,
    ) -> Result<Self, SchedulerError> {
        let narrow = |field: &'static str, value: usize| {
            u32::try_from(value).map_err(|_| SchedulerError::InvalidConfig {
                field,
                value: value.to_string(),
                reason: format!("must be at most {}", u32::MAX),
            })
        };
        let (sched, cache, spec) = (&config.scheduler, &config.cache, &config.speculative);
        Ok(Self {
            max_num_seqs: narrow("max_num_seqs", sched.max_num_seqs)?,
            max_num_batched_tokens: narrow("max_num_batched_tokens", sched.max_num_batched_tokens)?,
            max_model_len: narrow("max_model_len", max_model_len)?,
            long_prefill_token_threshold: narrow(
                "long_prefill_token_threshold",
                sched.long_prefill_token_threshold,
            )?,
            enable_chunked_prefill: sched.enable_chunked_prefill,
            block_size: narrow("block_size", cache.block_size)?,
            num_blocks,
            enable_prefix_caching: cache.enable_prefix_caching,
            eos_token_id: None,
            policy: "builtin:fcfs".to_string(),
            num_speculative_tokens: narrow("num_speculative_tokens", spec.num_speculative_tokens)?,
            prompt_lookup_min: narrow("prompt_lookup_min", spec.lookup_min())?,
            prompt_lookup_max: narrow("prompt_lookup_max", spec.lookup_max())?,
        })
    }

    /// The n-gram proposer, when speculative decoding is on.
    pub fn ngram_proposer(&self) -> Option<NgramProposer> {
        (self.num_speculative_tokens > 0).then_some(NgramProposer {
            num_speculative_tokens: self.num_speculative_tokens as usize,
            min_n: self.prompt_lookup_min as usize,
            max_n: self.prompt_lookup_max as usize,
        })
    }

    /// Checks every limit; the error names the field and the fix.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(SchedulerError::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason: "must be at least 1".into(),
                });
            }
        }
        if self.num_speculative_tokens as usize > MAX_SPECULATIVE_TOKENS {
            return Err(SchedulerError::InvalidConfig {
                field: "num_speculative_tokens",
                value: self.num_speculative_tokens.to_string(),
                reason: format!("must be at most {MAX_SPECULATIVE_TOKENS}"),
            });
        }
        if self.num_speculative_tokens > 0
            && !(1..=self.prompt_lookup_max).contains(&self.prompt_lookup_min)
        {
            return Err(SchedulerError::InvalidConfig {
                field: "prompt_lookup_min",
                value: self.prompt_lookup_min.to_string(),
                reason: format!(
                    "must be at least 1 and at most prompt_lookup_max ({})",
                    self.prompt_lookup_max
                ),
            });
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(SchedulerError::InvalidConfig {
                field: "max_num_batched_tokens",
                value: self.max_num_batched_tokens.to_string(),
                reason: format!(
                    "without chunked prefill a whole prompt must fit in one step: raise it to at least max_model_len ({}) or enable chunked prefill",
                    self.max_model_len
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_tables_fill_defaults_and_reject_typos() {
        let c: SchedulerConfig = toml::from_str("max_num_seqs = 4\nnum_blocks = 10").unwrap();
        assert_eq!((c.max_num_seqs, c.num_blocks, c.block_size), (4, 10, 16));
        assert_eq!(c.policy, "builtin:fcfs");
        c.validate().unwrap();
        let e = toml::from_str::<SchedulerConfig>("max_num_seq = 4").unwrap_err();
        assert!(e.to_string().contains("max_num_seq"), "{e}");
        let e = SchedulerConfig::default().validate().unwrap_err();
        assert!(e.to_string().contains("num_blocks = 0"), "{e}");
    }

    #[test]
    fn draft_lengths_are_bounded_as_the_speculative_table_bounds_them() {
        let c: SchedulerConfig = toml::from_str(
            "num_blocks = 10\nnum_speculative_tokens = 32\nprompt_lookup_min = 1\nprompt_lookup_max = 2",
        )
        .unwrap();
        c.validate().unwrap();
        let c = SchedulerConfig {
            num_speculative_tokens: 33,
            ..c
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("num_speculative_tokens = 33"), "{e}");
        assert!(e.contains("at most 32"), "{e}");
    }
}
