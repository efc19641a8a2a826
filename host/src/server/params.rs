//! Request validation: the JSON body into typed fields, the sampling fields
//! into a validated `SamplingParams`, prompts into token ids. Every error is
//! a 400 that names the field (`param`) and says what would be right.

use std::borrow::Cow;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::{FUNCTIONS, IGNORED_NAME_CHARS};
use super::protocol::{MessageContent, RequestMessage, SamplingRequest, StopField};
use super::tools;
use crate::sampling::{SamplingParams, SamplingParamsError};
use crate::tokenizer::{ChatMessage, TemplateKwargs, Tokenizer, RESERVED_VARIABLES};

/// Parses the body as a JSON object (the caller reads the typed parts from
/// it with [`typed`]).
pub fn json_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(None, format!("the request body is not valid JSON: {e}"))
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            None,
            "the request body must be a JSON object",
        ));
    }
    Ok(value)
}

/// Reads `T` from the body's object; a missing or mistyped field is an error
/// naming it (its path, e.g. `messages[0].role`).
pub fn typed<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(
        |e: serde_path_to_error::Error<serde_json::Error>| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                // serde names a missing top-level field in the message itself.
                ApiError::bad_request(missing_field(&inner.to_string()), inner.to_string())
            } else {
                ApiError::field(&path, inner)
            }
        },
    )
}

/// `missing field `x`` → `x`.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest.split('`').next()?.to_string())
}

/// What reading the sampling fields needs of the model's tokenizer: the
/// vocabulary token ids are checked against, and `bad_words` turned into
/// token sequences (the worker, which applies them, has no tokenizer).
pub trait SamplingVocab {
    /// Number of token ids (ids are `0..vocab_size`).
    fn vocab_size(&self) -> usize;
    /// The token ids of `text`, without special tokens.
    fn encode_text(&self, text: &str) -> Result<Vec<u32>, String>;
}

impl SamplingVocab for Tokenizer {
    fn vocab_size(&self) -> usize {
        Tokenizer::vocab_size(self)
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text, false).map_err(|e| e.to_string())
    }
}

/// How many of a prompt's last tokens a request keeps (vLLM's
/// `truncate_prompt_tokens`): `None` keeps the prompt whole; -1 keeps the
/// model's context (`max_model_len`), as vLLM reads it. 0, other negative
/// values and more than the context are refused, naming the field.
pub fn truncation(req: &SamplingRequest, max_model_len: usize) -> Result<Option<usize>, ApiError> {
    let field = "truncate_prompt_tokens";
    match req.truncate_prompt_tokens {
        None => Ok(None),
        Some(-1) => Ok(Some(max_model_len)),
        Some(k) if k >= 1 && k as u64 <= max_model_len as u64 => Ok(Some(k as usize)),
        Some(k) if k >= 1 => Err(ApiError::field(
            field,
            format!(
                "is {k}, more than the model's context (max_model_len) of {max_model_len} tokens; \
                 set it to at most {max_model_len}, or to -1 for the whole context"
            ),
        )),
        Some(k) => Err(ApiError::field(
            field,
            format!("is {k}; it must be at least 1, or -1 for the model's context"),
        )),
    }
}

/// Keeps the last `keep` tokens of `prompt` (all of them for `None`);
/// returns whether any were dropped.
pub fn truncate_prompt(prompt: &mut Vec<u32>, keep: Option<usize>) -> bool {
    let drop = keep.map_or(0, |k| prompt.len().saturating_sub(k));
    prompt.drain(..drop);
    drop > 0
}

/// The template variable vLLM's `documents` fill.
const DOCUMENTS: &str = "documents";

/// How a chat request's messages become its prompt: the fields chat
/// completions and `/tokenize` share.
pub struct ChatRendering<'a> {
    /// Open the assistant's turn after the messages.
    pub add_generation_prompt: bool,
    /// Leave the last message open for the model to continue (as
    /// transformers does; excludes `add_generation_prompt`).
    pub continue_final_message: bool,
    /// The caller's template variables (`chat_template_kwargs`).
    pub kwargs: Option<&'a TemplateKwargs>,
    /// vLLM's `documents`, the template's variable of that name unless
    /// `kwargs` set it.
    pub documents: Option<&'a [Map<String, Value>]>,
    /// Add the tokenizer's special tokens on top of the template's.
    pub add_special_tokens: bool,
}

impl<'a> ChatRendering<'a> {
    /// The prompt's token ids: `messages` rendered by the model's template
    /// and tokenized.
    pub fn prompt(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>, ApiError> {
        let text = self.text(tokenizer, messages)?;
        tokenizer
            .encode(&text, self.add_special_tokens)
            .map_err(|e| ApiError::field("messages", e))
    }

    /// The prompt's text.
    fn text(&self, tokenizer: &Tokenizer, messages: &[ChatMessage]) -> Result<String, ApiError> {
        if self.continue_final_message && self.add_generation_prompt {
            return Err(ApiError::field(
                "continue_final_message",
                "cannot be true together with `add_generation_prompt` (true by default); \
                 set `add_generation_prompt: false`",
            ));
        }
        let variables = self.variables()?;
        let mut text = tokenizer
            .apply_chat_template_with(messages, self.add_generation_prompt, &variables)
            .map_err(|e| ApiError::field("messages", e))?;
        if self.continue_final_message {
            let last = messages.last().map_or("", |m| m.content.as_str());
            let end = open_end(&text, last).ok_or_else(|| {
                ApiError::field(
                    "continue_final_message",
                    "the chat template does not write the last message's text as it is, so it \
                     cannot be left open; send a last message with text",
                )
            })?;
            text.truncate(end);
        }
        Ok(text)
    }

    /// The template's variables besides those the renderer sets: the
    /// caller's kwargs, and the documents unless the kwargs name some.
    fn variables(&self) -> Result<Cow<'a, TemplateKwargs>, ApiError> {
        let mut variables = match self.kwargs {
            Some(kwargs) => Cow::Borrowed(kwargs),
            None => Cow::Owned(TemplateKwargs::new()),
        };
        if let Some(key) = variables
            .keys()
            .find(|k| RESERVED_VARIABLES.contains(&k.as_str()))
        {
            return Err(ApiError::field(
                &format!("chat_template_kwargs.{key}"),
                "is set by the server from the request; leave it out",
            ));
        }
        if let Some(documents) = self.documents {
            if !variables.contains_key(DOCUMENTS) {
                let documents = Value::from(documents.to_vec());
                variables.to_mut().insert(DOCUMENTS.into(), documents);
            }
        }
        Ok(variables)
    }
}

/// Where the rendered chat `text` is cut to leave its last message
/// `content` open (what follows it, the end-of-turn marker, goes), as
/// transformers' `continue_final_message` does: after the last occurrence
/// of the content, whitespace at its end kept when the template kept it.
fn open_end(text: &str, content: &str) -> Option<usize> {
    let trimmed = content.trim();
    if trimmed.is_empty() {
        return None;
    }
    let at = text.rfind(trimmed)?;
    let whole = content.trim_start();
    Some(if text[at..].starts_with(whole) {
        at + whole.len()
    } else {
        at + trimmed.len()
    })
}

/// The sampling parameters of a request, validated. `logprobs` is the
/// endpoint's own reading of its logprobs fields; `default_max_tokens` is
/// used when the request sets neither `max_tokens` nor
/// `max_completion_tokens`; `vocab` checks token ids and tokenizes
/// `bad_words`.
pub fn sampling_params(
    req: &SamplingRequest,
    logprobs: Option<u32>,
    default_max_tokens: u32,
    vocab: &dyn SamplingVocab,
) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let extra_args = match (&req.extra_args, &req.vllm_xargs) {
        (None, None) => None,
        (Some(e), None) => Some(e.clone()),
        (None, Some(x)) => Some(Value::Object(x.clone())),
        (Some(Value::Object(e)), Some(x)) => {
            let mut merged = e.clone();
            merged.extend(x.clone());
            Some(Value::Object(merged))
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "extra_args",
                "must be an object when vllm_xargs is also given",
            ))
        }
    };
    let params = SamplingParams {
        n: req.n.unwrap_or(d.n),
        temperature: req.temperature.unwrap_or(d.temperature),
        top_p: req.top_p.unwrap_or(d.top_p),
        top_k: req.top_k.unwrap_or(d.top_k),
        min_p: req.min_p.unwrap_or(d.min_p),
        presence_penalty: req.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: req.frequency_penalty.unwrap_or(d.frequency_penalty),
        repetition_penalty: req.repetition_penalty.unwrap_or(d.repetition_penalty),
        seed: req.seed,
        max_tokens: req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(default_max_tokens),
        min_tokens: req.min_tokens.unwrap_or(d.min_tokens),
        stop: match &req.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        },
        stop_token_ids: req.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: req.ignore_eos.unwrap_or(d.ignore_eos),
        include_stop_str_in_output: req
            .include_stop_str_in_output
            .unwrap_or(d.include_stop_str_in_output),
        logprobs,
        prompt_logprobs: req.prompt_logprobs,
        skip_special_tokens: req.skip_special_tokens.unwrap_or(d.skip_special_tokens),
        logit_bias: logit_bias(req.logit_bias.as_ref())?,
        allowed_token_ids: req.allowed_token_ids.clone(),
        bad_words_token_ids: bad_word_sequences(
            req.bad_words.as_deref().unwrap_or_default(),
            vocab,
        )?,
        extra_args,
    };
    params
        .validate()
        .and_then(|()| params.check_vocab(vocab.vocab_size()))
        .map_err(|e| {
            let SamplingParamsError::OutOfRange { field, .. } = &e;
            // The chat API's name for the logprobs count is `top_logprobs`.
            ApiError::field(field, e.to_string().trim_start_matches(field).trim_start())
        })?;
    Ok(params)
}

/// `logit_bias`'s keys as token ids. A key must be the id in plain decimal
/// (`"50256"`, not `"050256"` or `"+50256"`), so two keys never name the
/// same token.
fn logit_bias(
    bias: Option<&std::collections::BTreeMap<String, f32>>,
) -> Result<Vec<(u32, f32)>, ApiError> {
    bias.into_iter()
        .flatten()
        .map(|(key, &b)| match key.parse::<u32>() {
            Ok(id) if id.to_string() == *key => Ok((id, b)),
            _ => Err(ApiError::field(
                "logit_bias",
                format!(
                    "has the key {:?}, which is not a token id; keys are token ids written in \
                     decimal, as {{\"50256\": -100}}",
                    key.chars().take(IGNORED_NAME_CHARS).collect::<String>()
                ),
            )),
        })
        .collect()
}

/// vLLM's tokenization of `bad_words` (`SamplingParams.update_from_tokenizer`):
/// each word, leading whitespace removed, as it would appear at the start of
/// the text, and again after a space (`" word"`) when that spelling starts
/// with a different token but is as long, so the word is banned both at the
/// start and in the middle of the text.
fn bad_word_sequences(
    words: &[String],
    vocab: &dyn SamplingVocab,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let mut sequences = Vec::with_capacity(words.len() * 2);
    for (i, word) in words.iter().enumerate() {
        let field = || format!("bad_words[{i}]");
        let word = word.trim_start();
        let encode = |text: &str| match vocab.encode_text(text) {
            Ok(ids) if !ids.is_empty() => Ok(ids),
            Ok(_) => Err(ApiError::field(
                &field(),
                "is empty (or only whitespace); give a word to ban",
            )),
            Err(e) => Err(ApiError::field(&field(), e)),
        };
        let plain = encode(word)?;
        let spaced = encode(&format!(" {word}"))?;
        let new_word_start = spaced[0] != plain[0] && spaced.len() == plain.len();
        sequences.push(plain);
        if new_word_start {
            sequences.push(spaced);
        }
    }
    Ok(sequences)
}

/// A completion prompt: text to tokenize, or token ids as given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptInput {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// Classifies `/v1/completions`' `prompt`: a string, a list of strings, a
/// list of token ids or a list of token-id lists (a batch).
pub fn prompts_of(prompt: &Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::field(
            "prompt",
            "must be a string, a list of strings, a list of token ids, or a list of token-id lists",
        )
    };
    let token_ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let prompts = match prompt {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::field("prompt", "must not be empty"))
        }
        Value::Array(items) if items[0].is_string() => items
            .iter()
            .map(|v| v.as_str().map(|s| PromptInput::Text(s.to_string())))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?,
        Value::Array(items) if items[0].is_number() => {
            vec![PromptInput::Tokens(token_ids(items).ok_or_else(bad)?)]
        }
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_array()
                    .and_then(|a| token_ids(a))
                    .map(PromptInput::Tokens)
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    Ok(prompts)
}

/// The chat request's messages as the chat template takes them; text parts
/// are joined, any other part type is refused, and so is a role the
/// template is not given. An assistant's `tool_calls` and a `tool` result
/// are rendered in the generic tool format (`super::tools`), the result as
/// a user turn, since a template without tool support knows no `tool` role.
pub fn chat_messages(messages: &[RequestMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::field(
            "messages",
            "must hold at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(s)) => s.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            ("text", None) => {
                                return Err(ApiError::field(
                                    &format!("messages[{i}].content[{j}].text"),
                                    "is missing",
                                ))
                            }
                            (other, _) => {
                                return Err(ApiError::field(
                                    &format!("messages[{i}].content[{j}].type"),
                                    format!("is `{other}`; this model takes `text` parts only"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            if m.role == "tool" {
                let id = m.tool_call_id.as_deref();
                let name = m
                    .name
                    .clone()
                    .or_else(|| id.and_then(|id| called_function(&messages[..i], id)));
                let text = tools::render_result(name.as_deref(), id, &content);
                return Ok(ChatMessage::new("user", text));
            }
            let role = role(i, &m.role)?;
            let content = match m.tool_calls.as_ref().filter(|c| !c.is_null()) {
                Some(_) if role != "assistant" => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_calls"),
                        "only an assistant message carries tool calls",
                    ))
                }
                Some(calls) => {
                    let calls = tools::render_calls(&format!("messages[{i}].tool_calls"), calls)?;
                    if content.is_empty() {
                        calls
                    } else {
                        format!("{content}\n{calls}")
                    }
                }
                None => content,
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// The name of the function that call `id` of an earlier assistant message
/// named.
fn called_function(earlier: &[RequestMessage], id: &str) -> Option<String> {
    earlier
        .iter()
        .rev()
        .filter_map(|m| m.tool_calls.as_ref()?.as_array())
        .flatten()
        .find(|c| c.get("id").and_then(Value::as_str) == Some(id))?
        .pointer("/function/name")?
        .as_str()
        .map(str::to_string)
}

/// The role the chat template is given for a message's `role`: `system`,
/// `user` and `assistant` as they are, and `developer` (OpenAI's newer
/// name for the system message) as `system`, since templates know only
/// that one.
fn role(index: usize, role: &str) -> Result<&'static str, ApiError> {
    let field = || format!("messages[{index}].role");
    match role {
        "system" | "developer" => Ok("system"),
        "user" => Ok("user"),
        "assistant" => Ok("assistant"),
        "function" => Err(ApiError::field(
            &field(),
            format!("is `function`; {FUNCTIONS} (results as `tool` messages)"),
        )),
        other => Err(ApiError::field(
            &field(),
            format!(
                "is `{}`; the roles accepted are system, developer (taken as system), user, assistant and tool",
                other.chars().take(IGNORED_NAME_CHARS).collect::<String>()
            ),
        )),
    }
}

/// A hand-written tokenizer of 100 tokens that knows the texts listed, for
/// unit tests of the sampling fields.
#[cfg(test)]
pub(super) struct Words(pub &'static [(&'static str, &'static [u32])]);

#[cfg(test)]
impl SamplingVocab for Words {
    fn vocab_size(&self) -> usize {
        100
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>, String> {
        match self.0.iter().find(|(t, _)| *t == text) {
            Some((_, ids)) => Ok(ids.to_vec()),
            None if text.trim().is_empty() => Ok(Vec::new()),
            None => Err(format!("no ids for {text:?}")),
        }
    }
}

/// [`Words`] that knows no text: for requests without `bad_words`.
#[cfg(test)]
pub(super) const NO_WORDS: Words = Words(&[]);

#[cfg(test)]
mod tests;
