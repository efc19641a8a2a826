//! Per-request sampling parameters (vLLM's `SamplingParams`) and their validation.
//!
//! The struct is read from JSONL request lines and TOML files, so every field has
//! vLLM's default and unknown fields are rejected: a typo such as `top_pp` must be
//! an error, not a silently ignored setting.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The largest `logprobs` a request may ask for (vLLM's default `max_logprobs`).
pub const MAX_LOGPROBS: u32 = 20;

/// The largest `logit_bias` magnitude (OpenAI's range is [-100, 100]).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Most `logit_bias` or `allowed_token_ids` entries one request may carry:
/// 2^18 covers every vocabulary in use (the largest hold about 256k
/// tokens), so a longer list can only repeat ids. The worker walks these
/// lists every step, so they are bounded even where no server is in front.
pub const MAX_TOKEN_ID_LIST: usize = 1 << 18;

/// Most banned token sequences (`bad_words` after tokenization), vLLM's
/// `MAX_NUM_BAD_WORDS`: every step matches each of them against the end of
/// the output.
pub const MAX_BAD_WORD_SEQUENCES: usize = 128;

/// Most tokens in all banned sequences together (vLLM's
/// `MAX_BAD_WORDS_TOTAL_TOKENS`), which bounds that per-step matching.
pub const MAX_BAD_WORD_TOKENS: usize = 1024;

/// Temperatures below this are treated as greedy decoding, as vLLM does
/// (`_SAMPLING_EPS`): dividing by a tiny temperature would overflow anyway.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// How one request's next tokens are chosen and when its generation stops.
///
/// Defaults are vLLM's. Call [`SamplingParams::validate`] before using values that
/// came from a user.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Number of sequences to generate for the prompt; default 1.
    pub n: u32,
    /// Softmax temperature; default 1.0. 0 (or below 1e-5) means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass; default 1.0 (disabled); must be in (0, 1].
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 or -1 disable it (default 0).
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the top probability;
    /// default 0.0 (disabled); in [0, 1].
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated; in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a generated token's logit once per occurrence; in [-2, 2].
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of every token seen in the
    /// prompt or output; default 1.0 (disabled); must be > 0.
    pub repetition_penalty: f32,
    /// Seed for this request's random generator; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens; default 16; at least 1.
    pub max_tokens: u32,
    /// EOS and stop tokens are suppressed until this many tokens were generated;
    /// default 0; at most `max_tokens`.
    pub min_tokens: u32,
    /// Generation stops when the output text contains any of these strings.
    pub stop: Vec<String>,
    /// Generation stops when any of these tokens is sampled.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after the end-of-sequence token.
    pub ignore_eos: bool,
    /// Keep the matched stop string in the returned text.
    pub include_stop_str_in_output: bool,
    /// Number of top log-probabilities to return per generated token (at most 20);
    /// `None` returns none. The sampled token's own logprob is always computed.
    pub logprobs: Option<u32>,
    /// Number of top log-probabilities to return per prompt token (at most
    /// 20), besides the prompt token's own; `None` returns none. Computed in
    /// the prefill, so a request asking for them never reuses cached prefix
    /// blocks (every prompt position is computed).
    pub prompt_logprobs: Option<u32>,
    /// Leave special tokens out of the detokenized text; default true.
    pub skip_special_tokens: bool,
    /// OpenAI's `logit_bias`: `(token id, bias)` pairs, each bias in
    /// [-100, 100], added to the token's logit before the penalties (vLLM's
    /// order). Pairs naming the same token add up; the server sends each id
    /// once.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `allowed_token_ids`: when set, only these tokens may be
    /// sampled (every other logit becomes -inf first). Must not be empty.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words` as token sequences (the worker has no tokenizer,
    /// so the frontend tokenizes each word): at every step the last token of
    /// each sequence whose earlier tokens end the output so far is banned,
    /// so a one-token sequence always is. Errors name the field `bad_words`,
    /// as clients write it.
    pub bad_words_token_ids: Vec<Vec<u32>>,
    /// Free-form arguments for sampler plugins; the built-in sampler ignores them.
    #[serde(with = "json_value_anywhere")]
    pub extra_args: Option<serde_json::Value>,
}

/// The `extra_args` key a structured-output constraint travels under (the
/// API server puts it there; the backend named by
/// `structured_outputs.backend` claims only requests that carry it).
pub const STRUCTURED_OUTPUTS_KEY: &str = "structured_outputs";

/// Whether `extra_args` carry `key` with a value other than `null`.
pub fn extra_args_carry(extra_args: Option<&serde_json::Value>, key: &str) -> bool {
    extra_args
        .and_then(|a| a.get(key))
        .is_some_and(|v| !v.is_null())
}

/// Serde for a JSON value in any format: as itself in self-describing ones
/// (JSON, TOML), as JSON text in compact binary ones (postcard, on the
/// message queues), which cannot carry a value whose shape is only known
/// while reading it.
mod json_value_anywhere {
    use serde::{de::Error, Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::Value;

    pub fn serialize<S: Serializer>(v: &Option<Value>, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            v.serialize(s)
        } else {
            v.as_ref().map(Value::to_string).serialize(s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
        if d.is_human_readable() {
            Option::<Value>::deserialize(d)
        } else {
            Option::<String>::deserialize(d)?
                .map(|text| serde_json::from_str(&text).map_err(D::Error::custom))
                .transpose()
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            logprobs: None,
            prompt_logprobs: None,
            skip_special_tokens: true,
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words_token_ids: Vec::new(),
            extra_args: None,
        }
    }
}

/// A sampling parameter outside its valid range.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingParamsError {
    /// `field` holds `value`, which is not in the range described by `valid`.
    #[error("{field} must be {valid}, got {value}")]
    OutOfRange {
        /// The parameter's name as written in a request.
        field: &'static str,
        /// The rejected value, formatted.
        value: String,
        /// The valid range in words, e.g. "in (0, 1]".
        valid: String,
    },
}

/// Builds the error for `field`; `value` is formatted with `Debug` so strings
/// are quoted and NaN is visible.
fn out_of_range(
    field: &'static str,
    value: impl std::fmt::Debug,
    valid: impl Into<String>,
) -> SamplingParamsError {
    SamplingParamsError::OutOfRange {
        field,
        value: format!("{value:?}"),
        valid: valid.into(),
    }
}

/// Checks `lo <= value <= hi`; NaN fails every comparison and is rejected.
fn check_closed(
    field: &'static str,
    value: f32,
    lo: f32,
    hi: f32,
) -> Result<(), SamplingParamsError> {
    if value >= lo && value <= hi {
        Ok(())
    } else {
        Err(out_of_range(field, value, format!("in [{lo}, {hi}]")))
    }
}

/// The first of `ids` that is not below `vocab_size`.
fn first_outside(mut ids: impl Iterator<Item = u32>, vocab_size: usize) -> Option<u32> {
    ids.find(|&t| t as usize >= vocab_size)
}

impl SamplingParams {
    /// The parameters of choice `index` of a request for `n`: one
    /// sequence, and, when seeded, a stream of its own (seed + index, as
    /// vLLM's parallel sampling does), so the choices differ but the whole
    /// answer is reproducible.
    pub fn child(&self, index: u32) -> SamplingParams {
        SamplingParams {
            n: 1,
            seed: self.seed.map(|s| s.wrapping_add(u64::from(index))),
            ..self.clone()
        }
    }

    /// Checks every field against vLLM's ranges; the error names the field, the
    /// value and the valid range. NaN and infinities are rejected everywhere.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        if self.n < 1 {
            return Err(out_of_range("n", self.n, "at least 1"));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(out_of_range(
                "temperature",
                self.temperature,
                "finite and >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(out_of_range("top_p", self.top_p, "in (0, 1]"));
        }
        if self.top_k < -1 {
            return Err(out_of_range(
                "top_k",
                self.top_k,
                "0 or -1 (disabled) or >= 1",
            ));
        }
        check_closed("min_p", self.min_p, 0.0, 1.0)?;
        check_closed("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_closed("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(out_of_range(
                "repetition_penalty",
                self.repetition_penalty,
                "finite and > 0",
            ));
        }
        if self.max_tokens < 1 {
            return Err(out_of_range("max_tokens", self.max_tokens, "at least 1"));
        }
        if self.min_tokens > self.max_tokens {
            return Err(out_of_range(
                "min_tokens",
                self.min_tokens,
                format!("<= max_tokens ({})", self.max_tokens),
            ));
        }
        if let Some(s) = self.stop.iter().find(|s| s.is_empty()) {
            return Err(out_of_range("stop", s, "a list of non-empty strings"));
        }
        for (field, k) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(k) = k.filter(|&k| k > MAX_LOGPROBS) {
                return Err(out_of_range(field, k, format!("in [0, {MAX_LOGPROBS}]")));
            }
        }
        self.validate_token_filters()
    }

    /// The `logit_bias`, `allowed_token_ids` and `bad_words` part of
    /// [`Self::validate`]: ranges, finiteness and sizes. Token ids are
    /// checked against a vocabulary by [`Self::check_vocab`].
    fn validate_token_filters(&self) -> Result<(), SamplingParamsError> {
        let list_bound = format!("at most {MAX_TOKEN_ID_LIST} entries");
        if self.logit_bias.len() > MAX_TOKEN_ID_LIST {
            return Err(out_of_range(
                "logit_bias",
                self.logit_bias.len(),
                list_bound,
            ));
        }
        for &(token, bias) in &self.logit_bias {
            // NaN is in no range; infinities are outside this one.
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
                return Err(out_of_range(
                    "logit_bias",
                    bias,
                    format!("in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}] (the bias of token {token})"),
                ));
            }
        }
        match &self.allowed_token_ids {
            Some(ids) if ids.is_empty() => {
                return Err(out_of_range(
                    "allowed_token_ids",
                    ids,
                    "a non-empty list of token ids (or null for no restriction)",
                ))
            }
            Some(ids) if ids.len() > MAX_TOKEN_ID_LIST => {
                return Err(out_of_range("allowed_token_ids", ids.len(), list_bound))
            }
            _ => {}
        }
        let words = &self.bad_words_token_ids;
        if words.len() > MAX_BAD_WORD_SEQUENCES {
            return Err(out_of_range(
                "bad_words",
                words.len(),
                format!("at most {MAX_BAD_WORD_SEQUENCES} token sequences (a word may make two: with and without a leading space)"),
            ));
        }
        if let Some(empty) = words.iter().find(|w| w.is_empty()) {
            return Err(out_of_range(
                "bad_words",
                empty,
                "non-empty token sequences",
            ));
        }
        let tokens: usize = words.iter().map(Vec::len).sum();
        if tokens > MAX_BAD_WORD_TOKENS {
            return Err(out_of_range(
                "bad_words",
                tokens,
                format!("at most {MAX_BAD_WORD_TOKENS} tokens in all words together, after tokenization"),
            ));
        }
        Ok(())
    }

    /// Checks that every token id the request names (`logit_bias` keys,
    /// `allowed_token_ids`, the tokens of `bad_words`) is below `vocab_size`.
    /// The worker ignores ids outside the logits row, so a request naming one
    /// would silently not get what it asked for; the frontend refuses it.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), SamplingParamsError> {
        let found = first_outside(self.logit_bias.iter().map(|&(t, _)| t), vocab_size)
            .map(|t| ("logit_bias", "keyed by token ids", t))
            .or_else(|| {
                let ids = self.allowed_token_ids.iter().flatten().copied();
                first_outside(ids, vocab_size).map(|t| ("allowed_token_ids", "token ids", t))
            })
            .or_else(|| {
                let ids = self.bad_words_token_ids.iter().flatten().copied();
                first_outside(ids, vocab_size).map(|t| ("bad_words", "tokenized into ids", t))
            });
        match found {
            Some((field, what, token)) => Err(out_of_range(
                field,
                token,
                format!("{what} below the vocabulary size {vocab_size}"),
            )),
            None => Ok(()),
        }
    }

    /// True when the next token is the argmax rather than a random draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE_EPS
    }

    /// The effective top-k cut for a vocabulary of `vocab` tokens, or `None`
    /// when top-k is disabled or would keep the whole vocabulary.
    pub fn effective_top_k(&self, vocab: usize) -> Option<usize> {
        match usize::try_from(self.top_k) {
            Ok(k) if k >= 1 && k < vocab => Some(k),
            _ => None,
        }
    }
}
