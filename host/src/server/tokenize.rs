//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes): a prompt, or
//! chat messages with the model's template applied, into token ids; token
//! ids back into text. Neither runs the model, and like vLLM's they do not
//! check the context's length (`count` says how long a prompt is).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ApiError;
use super::fields::{self, unset, Unsupported};
use super::limits;
use super::params;
use super::protocol::RequestMessage;
use super::AppState;

/// `/tokenize` with a `prompt`: the text as `/v1/completions` reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeCompletionRequest {
    /// The served model's id; optional (the one model is meant).
    #[serde(default)]
    pub model: Option<String>,
    /// The text to tokenize.
    pub prompt: String,
    /// Add the tokenizer's special tokens (BOS), as `/v1/completions` does
    /// (default true).
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Also return each token's string (`token_strs`).
    #[serde(default)]
    pub return_token_strs: bool,
}

/// `/tokenize` with `messages`: the prompt `/v1/chat/completions` would run.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeChatRequest {
    /// The served model's id; optional (the one model is meant).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<RequestMessage>,
    /// Open the assistant's turn after the messages (default true).
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Leave the last message open, for the model to continue it (needs
    /// `add_generation_prompt: false`).
    #[serde(default)]
    pub continue_final_message: bool,
    /// Variables for the chat template (vLLM's `chat_template_kwargs`).
    #[serde(default)]
    pub chat_template_kwargs: Option<crate::tokenizer::TemplateKwargs>,
    /// Add the tokenizer's special tokens on top of the template's (default
    /// false, as for chat).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// Also return each token's string (`token_strs`).
    #[serde(default)]
    pub return_token_strs: bool,
}

/// `/detokenize`'s body.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    /// The served model's id; optional (the one model is meant).
    #[serde(default)]
    pub model: Option<String>,
    /// The token ids to turn into text.
    pub tokens: Vec<u32>,
}

/// `/tokenize`'s answer.
#[derive(Clone, Debug, Serialize)]
pub struct TokenizeResponse {
    /// How many tokens.
    pub count: usize,
    /// The model's context length, in tokens.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's string in the tokenizer's alphabet (e.g. `Ġthe`), when
    /// asked for with `return_token_strs`; `null` otherwise.
    pub token_strs: Option<Vec<String>>,
}

/// `/detokenize`'s answer.
#[derive(Clone, Debug, Serialize)]
pub struct DetokenizeResponse {
    /// The text of the tokens (special tokens included).
    pub prompt: String,
}

fn yes() -> bool {
    true
}

/// vLLM's chat tokenize fields this server does not implement.
const UNSUPPORTED_CHAT: &[Unsupported] = &[
    ("tools", unset, fields::TOOLS_ELSEWHERE),
    (
        "chat_template",
        unset,
        "per-request chat templates are not supported; the model's own template is used",
    ),
    (
        "mm_processor_kwargs",
        unset,
        "multimodal processor arguments are not supported; this model takes text only",
    ),
];

/// `POST /tokenize`.
pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let body = super::request_object(body)?;
    let (tokens, with_strs) =
        match (body.get("prompt"), body.get("messages")) {
            (Some(_), None) => tokenize_prompt(&app, &body)?,
            (None, Some(_)) => tokenize_chat(&app, &body)?,
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request(
                    Some("messages".to_string()),
                    "send either `prompt` (text) or `messages` (a chat), not both",
                ))
            }
            (None, None) => return Err(ApiError::bad_request(
                Some("prompt".to_string()),
                "missing `prompt` (text to tokenize) or `messages` (a chat to render and tokenize)",
            )),
        };
    let token_strs = with_strs.then(|| {
        tokens
            .iter()
            .map(|&t| app.tokenizer.id_to_token(t).unwrap_or_default())
            .collect()
    });
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: app.client.max_model_len(),
        tokens,
        token_strs,
    }))
}

/// The ids of a `prompt` body, and whether to name their strings.
fn tokenize_prompt(app: &AppState, body: &Value) -> Result<(Vec<u32>, bool), ApiError> {
    if let Some(Value::String(s)) = body.get("prompt") {
        limits::prompt_bytes("prompt", s.len() as u64, &app.config)?;
    }
    let known = fields::field_names::<TokenizeCompletionRequest>();
    fields::check_endpoint_fields(body, known, &[])?;
    let req: TokenizeCompletionRequest = params::typed(body)?;
    app.check_model(req.model.as_deref())?;
    let ids = app
        .tokenizer
        .encode(&req.prompt, req.add_special_tokens)
        .map_err(|e| ApiError::field("prompt", e))?;
    Ok((ids, req.return_token_strs))
}

/// The ids of a `messages` body, rendered as the chat endpoint renders
/// them, and whether to name their strings.
fn tokenize_chat(app: &AppState, body: &Value) -> Result<(Vec<u32>, bool), ApiError> {
    limits::check_messages(body, &app.config)?;
    let known = fields::field_names::<TokenizeChatRequest>();
    fields::check_endpoint_fields(body, known, UNSUPPORTED_CHAT)?;
    fields::check_message_fields(body)?;
    let req: TokenizeChatRequest = params::typed(body)?;
    app.check_model(req.model.as_deref())?;
    let messages = params::chat_messages(&req.messages)?;
    let rendering = params::ChatRendering {
        add_generation_prompt: req.add_generation_prompt,
        continue_final_message: req.continue_final_message,
        kwargs: req.chat_template_kwargs.as_ref(),
        documents: None,
        add_special_tokens: req.add_special_tokens,
    };
    let ids = rendering.prompt(&app.tokenizer, &messages)?;
    Ok((ids, req.return_token_strs))
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let body = super::request_object(body)?;
    let max_model_len = app.client.max_model_len();
    if let Some(ids) = body.get("tokens").and_then(Value::as_array) {
        // No sequence the model handles is longer than its context.
        if ids.len() > max_model_len {
            return Err(ApiError::field(
                "tokens",
                format!(
                    "{} tokens, but the model's context (max_model_len) is {max_model_len} \
                     tokens and no longer sequence can be the model's; send at most that many",
                    ids.len()
                ),
            ));
        }
    }
    let known = fields::field_names::<DetokenizeRequest>();
    fields::check_endpoint_fields(&body, known, &[])?;
    let req: DetokenizeRequest = params::typed(&body)?;
    app.check_model(req.model.as_deref())?;
    let vocab = app.tokenizer.vocab_size();
    if let Some((i, t)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(ApiError::field(
            &format!("tokens[{i}]"),
            format!("token id {t} is outside the vocabulary (ids 0..{vocab})"),
        ));
    }
    let prompt = app
        .tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::field("tokens", e))?;
    Ok(Json(DetokenizeResponse { prompt }))
}
