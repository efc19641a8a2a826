//! Builds a `tokenizers` byte-level BPE tokenizer from a GGUF vocabulary,
//! configured the way Hugging Face ships GPT-2 style tokenizer.json files:
//! a BPE model over the byte-level alphabet, the pre-tokenizer named by
//! `tokenizer.ggml.pre`, a ByteLevel decoder, and the control and
//! user-defined tokens as added tokens so they are matched whole in the text.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use super::error::TokenizerError;
use super::gguf_vocab::{GgufVocab, PreTokenizerKind, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};

/// The `tokenizers` tokenizer for `vocab`.
pub(crate) fn build(vocab: &GgufVocab) -> Result<HfTokenizer, TokenizerError> {
    let bad = |key: &str, reason: String| TokenizerError::BadMetadata {
        path: vocab.path.clone(),
        key: key.into(),
        reason,
    };

    let mut ids = Vocab::with_capacity(vocab.tokens.len());
    for (id, token) in vocab.tokens.iter().enumerate() {
        if let Some(first) = ids.insert(token.clone(), id as u32) {
            return Err(bad(
                "tokenizer.ggml.tokens",
                format!("token {token:?} appears twice (ids {first} and {id})"),
            ));
        }
    }
    let model = BPE::builder()
        .vocab_and_merges(ids, vocab.merges.clone())
        .build()
        .map_err(|e| bad("tokenizer.ggml.merges", e.to_string()))?;

    let mut hf = HfTokenizer::new(model);
    hf.with_pre_tokenizer(Some(pre_tokenizer(vocab.pre, vocab.add_space_prefix)));
    hf.with_decoder(Some(ByteLevelDecoder::default()));

    // Control tokens are special (skippable on decode); user-defined ones
    // are matched whole but are ordinary text on decode.
    let added = |wanted: i32| -> Vec<AddedToken> {
        vocab
            .tokens
            .iter()
            .zip(&vocab.token_types)
            .filter(|(_, &t)| t == wanted)
            .map(|(token, _)| {
                AddedToken::from(token.clone(), wanted == TOKEN_TYPE_CONTROL).normalized(false)
            })
            .collect()
    };
    hf.add_special_tokens(&added(TOKEN_TYPE_CONTROL));
    hf.add_tokens(&added(TOKEN_TYPE_USER_DEFINED));
    Ok(hf)
}

/// The pre-tokenizer of `kind`.
fn pre_tokenizer(kind: PreTokenizerKind, add_prefix_space: bool) -> PreTokenizerWrapper {
    // trim_offsets only affects offsets, use_regex selects the GPT-2 pattern.
    let byte_level = ByteLevel::new(add_prefix_space, true, true);
    match kind {
        PreTokenizerKind::Gpt2 => byte_level.into(),
        PreTokenizerKind::SmolLm => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
    }
}
