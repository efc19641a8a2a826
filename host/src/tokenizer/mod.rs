//! The tokenizer: text to token ids and back, streaming detokenization and
//! chat templates, for GPT-2 style byte-level BPE models.
//!
//! Loaded from GGUF metadata ([`Tokenizer::from_gguf`]) or a Hugging Face
//! tokenizer.json ([`Tokenizer::from_file`]); both become a `tokenizers`
//! BPE tokenizer, so encoding is the library Hugging Face ships.

mod bpe;
mod byte_level;
mod chat_template;
mod detokenizer;
mod error;
mod gguf_vocab;
mod hf_config;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer as HfTokenizer;

use crate::model::gguf::GgufFile;

pub use chat_template::{ChatMessage, ChatTemplate, TemplateKwargs, RESERVED_VARIABLES};
pub use detokenizer::IncrementalDetokenizer;
pub use error::{TokenizerError, SUPPORTED_PRE_TOKENIZERS};

use detokenizer::TokenPieces;
use gguf_vocab::GgufVocab;
use hf_config::HfTokenizerConfig;

/// The ids of the model's special tokens that the engine uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokenIds {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence: generation stops here.
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
}

/// A byte-level BPE tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    hf: HfTokenizer,
    pieces: Arc<TokenPieces>,
    special: SpecialTokenIds,
    /// Added by `encode(.., add_special_tokens = true)` for GGUF models; a
    /// tokenizer.json does this in its own post-processor instead.
    add_bos: bool,
    add_eos: bool,
    chat_template: ChatTemplateState,
}

/// The chat template, or why there is none. A broken template does not stop
/// the model from loading: completions still work, chat requests get the error.
enum ChatTemplateState {
    /// Compiled and ready to render.
    Ready(Box<ChatTemplate>),
    /// The model has none; `where_looked` says where it was looked for.
    Missing { where_looked: String },
    /// The model's template does not compile, for this reason.
    Broken(String),
}

impl Tokenizer {
    /// The tokenizer stored in a GGUF file's `tokenizer.*` metadata.
    ///
    /// Needs `tokenizer.ggml.model = "gpt2"`, a supported
    /// `tokenizer.ggml.pre` ([`SUPPORTED_PRE_TOKENIZERS`]), `tokens` and
    /// `merges`; control tokens (token type 3) become special tokens and
    /// user-defined ones (type 4) added tokens, both matched whole in the text.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let vocab = GgufVocab::read(gguf)?;
        let hf = bpe::build(&vocab)?;
        let special = SpecialTokenIds {
            bos: vocab.bos,
            eos: vocab.eos,
            unk: vocab.unk,
            pad: vocab.pad,
        };
        let where_looked = format!("tokenizer.chat_template in {}", vocab.path.display());
        let mut tokenizer = Tokenizer::assemble(
            hf,
            special,
            (vocab.add_bos, vocab.add_eos),
            ChatTemplateState::Missing { where_looked },
        );
        if let Some(source) = &vocab.chat_template {
            tokenizer.chat_template = ChatTemplateState::new(
                source,
                &tokenizer.token_text(special.bos),
                &tokenizer.token_text(special.eos),
            );
        }
        Ok(tokenizer)
    }

    /// A Hugging Face tokenizer.json, with tokenizer_config.json and
    /// chat_template.jinja from the same folder when present. Only
    /// byte-level tokenizers (ByteLevel decoder) are supported.
    pub fn from_file(tokenizer_json: &Path) -> Result<Tokenizer, TokenizerError> {
        let invalid = |reason: String| TokenizerError::Invalid {
            path: tokenizer_json.to_path_buf(),
            reason,
        };
        if !tokenizer_json.is_file() {
            return Err(TokenizerError::Io {
                path: tokenizer_json.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let hf = HfTokenizer::from_file(tokenizer_json)
            .map_err(|e| invalid(format!("not a usable tokenizer.json: {e}")))?;
        match hf.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => {}
            other => {
                let found = other.map_or("none".to_owned(), |d| format!("{d:?}"));
                return Err(invalid(format!(
                    "the decoder is {found}, but only byte-level BPE tokenizers (decoder ByteLevel) are supported"
                )));
            }
        }
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config = HfTokenizerConfig::read(dir)?;
        let id = |key: &str, token: &Option<String>| -> Result<Option<u32>, TokenizerError> {
            let Some(token) = token else { return Ok(None) };
            hf.token_to_id(token)
                .map(Some)
                .ok_or_else(|| TokenizerError::Invalid {
                    path: dir.join(hf_config::CONFIG_FILE),
                    reason: format!(
                        "`{key}` is {token:?}, which is not in the vocabulary of {}",
                        tokenizer_json.display()
                    ),
                })
        };
        let special = SpecialTokenIds {
            bos: id("bos_token", &config.bos_token)?,
            eos: id("eos_token", &config.eos_token)?,
            unk: id("unk_token", &config.unk_token)?,
            pad: id("pad_token", &config.pad_token)?,
        };
        let chat_template = match &config.chat_template {
            None => ChatTemplateState::Missing {
                where_looked: config.where_looked,
            },
            Some(source) => ChatTemplateState::new(
                source,
                config.bos_token.as_deref().unwrap_or(""),
                config.eos_token.as_deref().unwrap_or(""),
            ),
        };
        Ok(Tokenizer::assemble(
            hf,
            special,
            (false, false),
            chat_template,
        ))
    }

    fn assemble(
        hf: HfTokenizer,
        special: SpecialTokenIds,
        (add_bos, add_eos): (bool, bool),
        chat_template: ChatTemplateState,
    ) -> Tokenizer {
        let added = hf.get_added_tokens_decoder();
        let len = hf
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        let pieces = TokenPieces::new(len, |id| {
            let token = hf.id_to_token(id)?;
            let special = added.get(&id).is_some_and(|t| t.special);
            Some((byte_level::token_bytes(&token), special))
        });
        Tokenizer {
            hf,
            pieces: Arc::new(pieces),
            special,
            add_bos,
            add_eos,
            chat_template,
        }
    }

    /// The ids of `text`. Special tokens written in the text (`<|im_start|>`)
    /// become their single ids; `add_special_tokens` adds what the model
    /// wants around a sequence (BOS when `tokenizer.ggml.add_bos_token`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.hf
                .encode_fast(text, add_special_tokens)
                .map_err(|e| TokenizerError::Codec {
                    op: "encode",
                    reason: e.to_string(),
                })?;
        let mut ids = Vec::with_capacity(encoding.len() + 2);
        if add_special_tokens && self.add_bos {
            ids.extend(self.special.bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        if add_special_tokens && self.add_eos {
            ids.extend(self.special.eos);
        }
        Ok(ids)
    }

    /// The text of `ids`; bytes that do not form valid UTF-8 become U+FFFD.
    /// An id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        for &id in ids {
            self.pieces.check(id)?;
        }
        self.hf
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Codec {
                op: "decode",
                reason: e.to_string(),
            })
    }

    /// A streaming detokenizer for one sequence (see [`IncrementalDetokenizer`]).
    pub fn detokenizer(&self, skip_special_tokens: bool) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(self.pieces.clone(), skip_special_tokens)
    }

    /// Beginning-of-sequence token id.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos
    }

    /// End-of-sequence token id.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special.eos
    }

    /// All the special token ids the model declares.
    pub fn special_token_ids(&self) -> SpecialTokenIds {
        self.special
    }

    /// Number of ids (one more than the largest): the logits' width.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The id of token `token` (in the byte-level alphabet, e.g. `"Ġthe"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token)
    }

    /// The token string of `id` (in the byte-level alphabet).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.hf.id_to_token(id)
    }

    /// Whether `id` is a special token (skipped by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        self.pieces.is_special(id)
    }

    /// The bytes token `id` decodes to (a special token's text included);
    /// `None` when no token has that id. What constrained-decoding plugins
    /// match against (`set-vocabulary`).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.bytes(id, false).ok().flatten()
    }

    /// Every token in id order, as its bytes ([`Self::token_bytes`], empty
    /// for an id without any) and whether it is special: the vocabulary a
    /// constrained-decoding plugin learns.
    pub fn tokens(&self) -> impl Iterator<Item = (&[u8], bool)> + '_ {
        (0..self.vocab_size() as u32).map(|id| {
            (
                self.token_bytes(id).unwrap_or_default(),
                self.is_special(id),
            )
        })
    }

    /// The text of token `id` (empty for none), as templates see `bos_token`.
    fn token_text(&self, id: Option<u32>) -> String {
        id.and_then(|id| self.decode(&[id], false).ok())
            .unwrap_or_default()
    }

    /// Renders the model's chat template for `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, add_generation_prompt, &TemplateKwargs::new())
    }

    /// [`apply_chat_template`](Self::apply_chat_template) with the caller's
    /// template variables `kwargs` (vLLM's `chat_template_kwargs`).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String, TokenizerError> {
        match &self.chat_template {
            ChatTemplateState::Ready(t) => t.render_with(messages, add_generation_prompt, kwargs),
            ChatTemplateState::Missing { where_looked } => Err(TokenizerError::NoChatTemplate {
                where_looked: where_looked.clone(),
            }),
            ChatTemplateState::Broken(e) => Err(TokenizerError::ChatTemplate(e.clone())),
        }
    }

    /// Replaces the chat template (vLLM's `--chat-template`); the model's
    /// BOS and EOS token strings stay available to it.
    pub fn set_chat_template(&mut self, source: &str) -> Result<(), TokenizerError> {
        let template = ChatTemplate::new(
            source,
            &self.token_text(self.special.bos),
            &self.token_text(self.special.eos),
        )?;
        self.chat_template = ChatTemplateState::Ready(Box::new(template));
        Ok(())
    }
}

impl ChatTemplateState {
    /// `source` compiled, or the reason it does not compile.
    fn new(source: &str, bos: &str, eos: &str) -> ChatTemplateState {
        match ChatTemplate::new(source, bos, eos) {
            Ok(t) => ChatTemplateState::Ready(Box::new(t)),
            Err(TokenizerError::ChatTemplate(reason)) => ChatTemplateState::Broken(reason),
            Err(e) => ChatTemplateState::Broken(e.to_string()),
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}
