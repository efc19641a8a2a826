//! The OpenAI wire format: request bodies as clients send them and the
//! response bodies and stream chunks we send back (vLLM's
//! `entrypoints/openai/protocol.py`, trimmed to what this engine serves).
//!
//! Requests are read in three parts from the same JSON object: the endpoint's
//! own fields (`CompletionRequest`, `ChatCompletionRequest`), the fields
//! both endpoints share about the answer (`AnswerRequest`) and the sampling
//! fields they share (`SamplingRequest`). These structs are the
//! list of the fields this server honours; the fields OpenAI or vLLM define
//! beyond them are refused unless neutral, and any others are ignored with
//! a warning in the log, as vLLM does (`fields::check_fields`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::PredictionTokens;

/// `stream_options` of a streaming request.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk carrying `usage` (and no choices) before `[DONE]`.
    pub include_usage: bool,
    /// vLLM's: with `include_usage`, every chunk of a choice also carries
    /// that choice's counts so far (its prompt's tokens and the tokens it
    /// generated until then).
    pub continuous_usage_stats: bool,
}

/// The fields completions and chat share beside the sampling ones: which
/// model, and how the answer is shaped, streamed and named.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct AnswerRequest {
    /// The served model's id; optional (the one model is meant).
    pub model: Option<String>,
    /// Answer with server-sent events as tokens are produced.
    pub stream: bool,
    /// Options of a streamed answer.
    pub stream_options: Option<StreamOptions>,
    /// OpenAI's output format (`text`, `json_object`, `json_schema`); read
    /// by `structured::from_fields`, which checks its shape.
    pub response_format: Option<Value>,
    /// vLLM's structured-output constraint (`json`, `regex`, `choice`,
    /// `grammar`, `json_object`); read by `structured::from_fields`.
    pub structured_outputs: Option<Value>,
    /// vLLM's `use_beam_search`: the `n` choices are the `n` best beams
    /// (`server::beam`).
    pub use_beam_search: bool,
    /// vLLM's `length_penalty` of beam search: scores divide by the
    /// length to this power (default 1).
    pub length_penalty: Option<f64>,
    /// vLLM's `request_id`: names the answer, whose `id` becomes
    /// `<prefix>-<request_id>` (an `X-Request-Id` header wins over it, as
    /// in vLLM; empty means unnamed).
    pub request_id: Option<String>,
    /// vLLM's `return_token_ids`: the answer carries the prompt's token
    /// ids and each choice's generated ones (`prompt_token_ids`,
    /// `token_ids`; streamed, the prompt's in the first chunk).
    pub return_token_ids: Option<bool>,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name tokens
    /// `token_id:<id>` instead of by their text (which a token that ends
    /// inside a UTF-8 character does not have).
    pub return_tokens_as_token_ids: Option<bool>,
}

/// `POST /v1/completions`: the endpoint's own fields.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// A string, a list of strings, a list of token ids, or a list of
    /// token-id lists; classified by [`super::params::prompts_of`].
    pub prompt: Value,
    /// Top log-probabilities to return per token (0..=20); `None` for none.
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Add the tokenizer's special tokens (BOS) to text prompts (default
    /// true, as in vLLM).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Prepend the prompt to each choice's text (and, with `logprobs`, the
    /// prompt tokens' logprobs to its logprobs, the first `null`).
    #[serde(default)]
    pub echo: bool,
}

/// Message content: a string, or a list of parts of which only `text`
/// parts are supported.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed parts (`{"type": "text", "text": "..."}`).
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// `text` is the only type this text-only model takes.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One message of a chat request.
#[derive(Clone, Debug, Deserialize)]
pub struct RequestMessage {
    /// `system`, `developer` (taken as `system`), `user`, `assistant` or
    /// `tool` (a function's result).
    pub role: String,
    /// The message text; `null` is taken as empty.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant message's calls, as the API returned them.
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A `tool` message's function name (OpenAI's older form).
    #[serde(default)]
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`: the endpoint's own fields.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// The functions the model may call (read with `tool_choice` and
    /// `parallel_tool_calls` by `server::tools`).
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto`, `required` or a named function.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// Whether an answer may hold more than one call (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<serde_json::Value>,
    /// The conversation so far.
    pub messages: Vec<RequestMessage>,
    /// Return the sampled tokens' log-probabilities.
    #[serde(default)]
    pub logprobs: bool,
    /// Also return this many most likely alternatives per token (0..=20);
    /// needs `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Open the assistant's turn after the messages (default true).
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Add the tokenizer's special tokens (BOS) on top of what the chat
    /// template writes (default false, as in vLLM).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// OpenAI's predicted output (`{"type": "content", "content": ...}`);
    /// read by `server::prediction`, which checks its shape.
    #[serde(default)]
    pub prediction: Option<Value>,
    /// Leave the last message open for the model to continue (a prefilled
    /// answer); needs `add_generation_prompt: false`.
    #[serde(default)]
    pub continue_final_message: bool,
    /// Variables for the chat template (vLLM's `chat_template_kwargs`,
    /// such as `enable_thinking`); a template ignores those it does not
    /// read, as transformers' does.
    #[serde(default)]
    pub chat_template_kwargs: Option<crate::tokenizer::TemplateKwargs>,
    /// vLLM's `documents` (retrieval-augmented generation): the chat
    /// template's `documents` variable, unless `chat_template_kwargs` sets
    /// it (as in vLLM, where the kwargs win).
    #[serde(default)]
    pub documents: Option<Vec<serde_json::Map<String, Value>>>,
    /// vLLM's chat `echo`: the answer repeats the last message before its
    /// own text when it continues that message's role.
    #[serde(default)]
    pub echo: bool,
}

fn yes() -> bool {
    true
}

/// Reads `seed`: vLLM takes any signed 64-bit integer, OpenAI any integer,
/// and the generator is keyed by 64 bits, so a negative seed keys it by its
/// two's-complement bits (distinct seeds stay distinct keys).
fn seed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Seed;
    impl serde::de::Visitor<'_> for Seed {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an integer from -2^63 to 2^64 - 1")
        }
        fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
            Ok(Some(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Option<u64>, E> {
            Ok(Some(v as u64))
        }
        fn visit_unit<E>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Seed)
}

/// `stop`: one string or a list of them.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// The sampling fields both endpoints share (vLLM's extra parameters
/// included); `None` keeps `SamplingParams`' default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct SamplingRequest {
    /// Completions per prompt; each is its own engine request.
    pub n: Option<u32>,
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens; 0 or -1 disable.
    pub top_k: Option<i32>,
    /// Minimum probability relative to the most likely token.
    pub min_p: Option<f32>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// vLLM's repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Seed of the request's random generator: any 64-bit integer, signed
    /// or not, as vLLM takes it.
    #[serde(deserialize_with = "seed")]
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// The chat API's newer name for `max_tokens` (wins when both are set).
    pub max_completion_tokens: Option<u32>,
    /// EOS and stop tokens are suppressed until this many were generated.
    pub min_tokens: Option<u32>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Stop token ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating after EOS.
    pub ignore_eos: Option<bool>,
    /// Keep the matched stop string in the text.
    pub include_stop_str_in_output: Option<bool>,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: Option<bool>,
    /// vLLM's `spaces_between_special_tokens`, read for its type only:
    /// either value gives the same text here, as in vLLM for the byte-level
    /// tokenizers this engine loads. The detokenizer writes a special token
    /// as its own text, so adjacent ones touch (what `false` asks), and a
    /// byte-level decoder puts nothing between them either (what `true`
    /// gives in vLLM); `tests/tokenizer_agreement.rs` holds both to vLLM's
    /// fast detokenizer.
    pub spaces_between_special_tokens: Option<bool>,
    /// Free-form arguments for sampler plugins (`SamplingParams.extra_args`).
    pub extra_args: Option<Value>,
    /// vLLM's name for the same thing; merged into `extra_args`.
    pub vllm_xargs: Option<serde_json::Map<String, Value>>,
    /// Scheduling priority under the priority policy (smaller runs first).
    pub priority: Option<i32>,
    /// vLLM's `cache_salt`: prefix-cache blocks are shared only between
    /// requests with the same salt (a non-empty string).
    pub cache_salt: Option<String>,
    /// vLLM's `truncate_prompt_tokens`: keep only the prompt's last this
    /// many tokens (-1: the model's context), see `params::truncation`.
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's prompt logprobs: per prompt token (from the second), its
    /// logprob and rank and this many most likely tokens (0..=20). Not
    /// with `stream` (as in vLLM).
    pub prompt_logprobs: Option<u32>,
    /// OpenAI's `logit_bias`: token ids (decimal strings) to a bias in
    /// [-100, 100] added to their logits.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// vLLM's `allowed_token_ids`: only these tokens may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`: words never written out, tokenized by the server
    /// (`params::bad_word_sequences`).
    pub bad_words: Option<Vec<String>>,
}

impl SamplingRequest {
    /// The field the request's `max_tokens` came from, for error messages:
    /// `max_completion_tokens` wins when both are set.
    pub fn max_tokens_field(&self) -> &'static str {
        if self.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }
}

/// A request's prompt tokens, each prompt counted once however many
/// samples were drawn from it (as vLLM's `usage` counts them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptTokens {
    /// Tokens in the prompt(s).
    pub total: usize,
    /// Of those, the ones the prefix cache served (vLLM's
    /// `num_cached_tokens`: counted when the prompt was first scheduled).
    pub cached: usize,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens in the prompt(s).
    pub prompt_tokens: usize,
    /// Tokens generated over every choice.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// OpenAI's breakdown of the prompt tokens: how many the prefix cache
    /// served.
    pub prompt_tokens_details: PromptTokensDetails,
    /// How a predicted output fared; only when the request sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache instead of computed.
    pub cached_tokens: usize,
}

/// OpenAI's breakdown of the completion tokens (the predicted-output part).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CompletionTokensDetails {
    /// Predicted tokens the answer kept, over every choice.
    pub accepted_prediction_tokens: u64,
    /// Predicted tokens the model verified and did not keep, over every
    /// choice. They cost compute like generated tokens, and are not part
    /// of `completion_tokens`, which counts the answer's tokens only.
    pub rejected_prediction_tokens: u64,
}

impl Usage {
    /// Counts for the prompt(s) and `completion_tokens`.
    pub fn new(prompt: PromptTokens, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: prompt.total,
            completion_tokens,
            total_tokens: prompt.total + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: prompt.cached,
            },
            completion_tokens_details: None,
        }
    }

    /// The counts with the choices' prediction tallies summed into
    /// `completion_tokens_details`, which is left out when no choice had a
    /// prediction.
    pub fn with_predictions(
        mut self,
        choices: impl IntoIterator<Item = Option<PredictionTokens>>,
    ) -> Usage {
        for p in choices.into_iter().flatten() {
            let d = self
                .completion_tokens_details
                .get_or_insert_with(Default::default);
            d.accepted_prediction_tokens += u64::from(p.accepted);
            d.rejected_prediction_tokens += u64::from(p.rejected);
        }
        self
    }
}

/// An entry of `/v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCard {
    /// The id clients send as `model`.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    /// Who serves it.
    pub owned_by: &'static str,
    /// The model it was loaded from (its path), as vLLM reports it.
    pub root: String,
    /// The model it derives from; `null` (no adapters here).
    pub parent: Option<String>,
    /// The longest sequence (prompt + output) served, in tokens.
    pub max_model_len: usize,
    /// What clients may do with it (vLLM's one permission object).
    pub permission: Vec<ModelPermission>,
}

/// vLLM's `ModelPermission`: what clients may do with a model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelPermission {
    /// `modelperm-<model id>`.
    pub id: String,
    /// Always `model_permission`.
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    /// Always false.
    pub allow_create_engine: bool,
    /// Always true.
    pub allow_sampling: bool,
    /// Always true.
    pub allow_logprobs: bool,
    /// Always false.
    pub allow_search_indices: bool,
    /// Always true.
    pub allow_view: bool,
    /// Always false.
    pub allow_fine_tuning: bool,
    /// Always `*`.
    pub organization: &'static str,
    /// Always `null`.
    pub group: Option<String>,
    /// Always false.
    pub is_blocking: bool,
}

impl ModelPermission {
    /// The permissions vLLM reports for every model it serves.
    pub fn for_model(id: &str, created: u64) -> ModelPermission {
        ModelPermission {
            id: format!("modelperm-{id}"),
            object: "model_permission",
            created,
            allow_create_engine: false,
            allow_sampling: true,
            allow_logprobs: true,
            allow_search_indices: false,
            allow_view: true,
            allow_fine_tuning: false,
            organization: "*",
            group: None,
            is_blocking: false,
        }
    }
}

/// `/v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served models (one).
    pub data: Vec<ModelCard>,
}

/// The body of every error answer: `{"error": {...}}` as OpenAI sends it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// What went wrong.
    pub error: ErrorInfo,
}

/// What went wrong, OpenAI-style.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// A sentence naming the field and how to fix it.
    pub message: String,
    /// `BadRequestError`, `AuthenticationError`, ... (vLLM's names).
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending request field, when one is to blame.
    pub param: Option<String>,
    /// The HTTP status code.
    pub code: u16,
}
