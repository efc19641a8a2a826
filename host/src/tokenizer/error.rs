//! Why a tokenizer cannot be loaded or used. Every variant names what was
//! wrong (the file, the metadata key, the token id) and how to fix it.

use std::path::PathBuf;

use thiserror::Error;

use crate::model::gguf::GgufError;

/// The pre-tokenizers (`tokenizer.ggml.pre`) this engine implements.
pub const SUPPORTED_PRE_TOKENIZERS: &[&str] = &["default", "gpt2", "smollm"];

/// Errors of the tokenizer module.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// A required GGUF metadata key is missing or has the wrong type (the
    /// GGUF error names the key and the file).
    #[error("cannot load the tokenizer: {0}")]
    Gguf(#[from] GgufError),
    /// A metadata value has the right type but an impossible value.
    #[error("{}: tokenizer metadata `{key}` is invalid: {reason}", path.display())]
    BadMetadata {
        /// The model file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer family other than GPT-2 BPE.
    #[error(
        "{}: tokenizer.ggml.model is {found:?}, but only \"gpt2\" (byte-level BPE) is \
         supported; use a model with a GPT-2 style byte-level BPE tokenizer",
        path.display()
    )]
    UnsupportedModel {
        /// The model file.
        path: PathBuf,
        /// The value found.
        found: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this engine does not implement.
    #[error(
        "{}: pre-tokenizer tokenizer.ggml.pre = {found:?} is not supported; the supported \
         ones are {}",
        path.display(), SUPPORTED_PRE_TOKENIZERS.join(", ")
    )]
    UnsupportedPreTokenizer {
        /// The model file.
        path: PathBuf,
        /// The value found.
        found: String,
    },
    /// A tokenizer file (tokenizer.json, tokenizer_config.json, a chat
    /// template file) cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A tokenizer file is not what the `tokenizers` library or this engine
    /// can use (malformed JSON, unknown model type, merges not in the vocabulary).
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A token id outside the vocabulary.
    #[error(
        "token id {id} is not in the vocabulary (valid ids are 0..{vocab_size}); \
         pass ids produced by this model's tokenizer"
    )]
    InvalidTokenId {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The `tokenizers` library failed to encode or decode.
    #[error("cannot {op}: {reason}")]
    Codec {
        /// "encode" or "decode".
        op: &'static str,
        /// The library's message.
        reason: String,
    },
    /// The model has no chat template.
    #[error(
        "the model has no chat template (no {where_looked}); use the completions API with \
         a plain prompt, or pick a model that ships a chat template"
    )]
    NoChatTemplate {
        /// Where a template was looked for.
        where_looked: String,
    },
    /// The chat template does not compile or fails while rendering.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
}
