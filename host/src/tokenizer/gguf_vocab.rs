//! The tokenizer as llama.cpp's converter stores it in GGUF metadata
//! (`tokenizer.ggml.*`), read and checked before anything is built from it.

use std::path::{Path, PathBuf};

use crate::model::gguf::{GgufFile, Value};

use super::error::TokenizerError;

/// `tokenizer.ggml.token_type` of a control token (`<|im_start|>`): special,
/// skipped by `decode(.., skip_special_tokens = true)`.
pub(crate) const TOKEN_TYPE_CONTROL: i32 = 3;
/// `tokenizer.ggml.token_type` of a user-defined token: matched whole in the
/// input like a control token, but printed when special tokens are skipped.
pub(crate) const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// How the text is split into words before BPE (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreTokenizerKind {
    /// The GPT-2 regex (`"gpt2"`, and `"default"`).
    Gpt2,
    /// Every digit on its own, then the GPT-2 regex (`"smollm"`), as
    /// SmolLM's tokenizer.json does with `Digits(individual_digits = true)`.
    SmolLm,
}

impl PreTokenizerKind {
    /// The kind named `name`; the names are those of
    /// [`super::error::SUPPORTED_PRE_TOKENIZERS`].
    fn from_name(name: &str) -> Option<PreTokenizerKind> {
        match name {
            "default" | "gpt2" => Some(PreTokenizerKind::Gpt2),
            "smollm" => Some(PreTokenizerKind::SmolLm),
            _ => None,
        }
    }
}

/// A GPT-2 style byte-level BPE vocabulary read from GGUF metadata.
#[derive(Clone, Debug)]
pub(crate) struct GgufVocab {
    /// The model file, for error messages.
    pub path: PathBuf,
    /// Token strings in the byte-level alphabet, indexed by id.
    pub tokens: Vec<String>,
    /// llama.cpp token types, one per token (1 = normal when absent).
    pub token_types: Vec<i32>,
    /// BPE merges in priority order.
    pub merges: Vec<(String, String)>,
    /// The pre-tokenizer.
    pub pre: PreTokenizerKind,
    /// Prepend a space to the text before tokenizing.
    pub add_space_prefix: bool,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// `encode(.., add_special_tokens = true)` prepends BOS.
    pub add_bos: bool,
    /// `encode(.., add_special_tokens = true)` appends EOS.
    pub add_eos: bool,
    /// The Jinja chat template.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads and checks the `tokenizer.ggml.*` metadata of `gguf`.
    pub fn read(gguf: &GgufFile) -> Result<GgufVocab, TokenizerError> {
        let path = gguf.path.clone();
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                path,
                found: model.into(),
            });
        }
        let pre_name = gguf.get_str("tokenizer.ggml.pre")?;
        let pre = PreTokenizerKind::from_name(pre_name).ok_or_else(|| {
            TokenizerError::UnsupportedPreTokenizer {
                path: path.clone(),
                found: pre_name.into(),
            }
        })?;

        let tokens: Vec<String> = gguf
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        let bad = |key: &str, reason: String| TokenizerError::BadMetadata {
            path: path.clone(),
            key: key.into(),
            reason,
        };
        if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
            return Err(bad(
                "tokenizer.ggml.tokens",
                format!("it holds {} tokens", tokens.len()),
            ));
        }
        let token_types = match gguf.get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(_) => gguf.get_i32_array("tokenizer.ggml.token_type")?,
        };
        if token_types.len() != tokens.len() {
            return Err(bad(
                "tokenizer.ggml.token_type",
                format!(
                    "it has {} entries but tokenizer.ggml.tokens has {}",
                    token_types.len(),
                    tokens.len()
                ),
            ));
        }
        let merges = gguf
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '))
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| {
                        bad(
                            "tokenizer.ggml.merges",
                            format!("merge {i} is {m:?}, expected \"left right\""),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            if gguf.get(key).is_none() {
                return Ok(None);
            }
            let id = gguf.get_u64(key)?;
            if id >= tokens.len() as u64 {
                return Err(bad(
                    key,
                    format!(
                        "token id {id} is outside the vocabulary of {} tokens",
                        tokens.len()
                    ),
                ));
            }
            Ok(Some(id as u32))
        };
        let flag = |key: &str| optional_bool(gguf, &path, key);
        let chat_template = match gguf.get("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(gguf.get_str("tokenizer.chat_template")?.to_owned()),
        };
        Ok(GgufVocab {
            bos: token_id("tokenizer.ggml.bos_token_id")?,
            eos: token_id("tokenizer.ggml.eos_token_id")?,
            unk: token_id("tokenizer.ggml.unknown_token_id")?,
            pad: token_id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            path,
            tokens,
            token_types,
            merges,
            pre,
            chat_template,
        })
    }
}

/// Metadata `key` as a bool, `false` when absent.
fn optional_bool(gguf: &GgufFile, path: &Path, key: &str) -> Result<bool, TokenizerError> {
    match gguf.get(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(TokenizerError::BadMetadata {
            path: path.to_path_buf(),
            key: key.into(),
            reason: format!("expected a bool, found {}", other.type_name()),
        }),
    }
}
