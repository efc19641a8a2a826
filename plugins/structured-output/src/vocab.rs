//! The model's vocabulary as llguidance sees it: a token trie built once
//! from the flat vocabulary the host hands over in `set-vocabulary`.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// Token ids are stored in 24 bits inside llguidance's trie nodes.
const MAX_TOKENS: usize = (1 << 24) - 1;

/// The vocabulary, flat, as the WIT's `vocabulary` record carries it.
#[derive(Clone, Copy, Debug)]
pub struct FlatVocab<'a> {
    /// Every token's bytes, back to back.
    pub token_bytes: &'a [u8],
    /// Token `i` ends at `token_ends[i]` in `token_bytes` (and starts where
    /// token `i - 1` ended, or at 0).
    pub token_ends: &'a [u32],
    /// Ids of the special (control) tokens.
    pub special_ids: &'a [u32],
    /// The end-of-sequence token.
    pub eos: Option<u32>,
}

/// Builds llguidance's token environment from the flat vocabulary.
///
/// Special tokens get llguidance's `0xFF` marker in front of their text, so
/// a grammar's literal text never matches them (a model must not "write"
/// `<|im_end|>` as part of a JSON string) while EOS still ends the output.
pub fn build_tok_env(v: FlatVocab<'_>) -> Result<TokEnv, String> {
    let n = v.token_ends.len();
    if n == 0 {
        return Err("the vocabulary is empty (token-ends has no entries)".into());
    }
    if n > MAX_TOKENS {
        return Err(format!(
            "the vocabulary has {n} tokens; llguidance handles at most {MAX_TOKENS}"
        ));
    }
    let eos = v.eos.ok_or(
        "the vocabulary has no end-of-sequence token; structured output needs one to end a \
         constrained answer",
    )?;
    if eos as usize >= n {
        return Err(format!(
            "the end-of-sequence token {eos} is outside the vocabulary of {n} tokens"
        ));
    }
    if let Some(&bad) = v.special_ids.iter().find(|&&t| t as usize >= n) {
        return Err(format!(
            "special token id {bad} is outside the vocabulary of {n} tokens"
        ));
    }
    let mut words: Vec<Vec<u8>> = Vec::with_capacity(n);
    let mut start = 0usize;
    for (id, &end) in v.token_ends.iter().enumerate() {
        let end = end as usize;
        if end < start || end > v.token_bytes.len() {
            return Err(format!(
                "token {id} ends at byte {end}, outside {start}..={} (token-ends must be \
                 non-decreasing and within token-bytes)",
                v.token_bytes.len()
            ));
        }
        words.push(v.token_bytes[start..end].to_vec());
        start = end;
    }
    for &id in v.special_ids {
        words[id as usize].insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
    }
    // EOS is often special already; when it is not, it still must not be
    // reachable as text, only through the grammar's end.
    if words[eos as usize].first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
        words[eos as usize].insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
    }
    let info = TokRxInfo::new(n as u32, eos);
    let trie = TokTrie::from(&info, &words);
    // Masks never depend on how text would be tokenized; the approximate
    // (greedy) tokenizer only serves llguidance's forced-token helpers,
    // which this plugin does not use.
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat<'a>(bytes: &'a [u8], ends: &'a [u32], special: &'a [u32]) -> FlatVocab<'a> {
        FlatVocab {
            token_bytes: bytes,
            token_ends: ends,
            special_ids: special,
            eos: Some(0),
        }
    }

    #[test]
    fn builds_trie_with_marked_specials() {
        // "<eos>" "a" "bc" ""
        let env = build_tok_env(flat(b"<eos>abc", &[5, 6, 8, 8], &[0])).unwrap();
        let trie = env.tok_trie();
        assert_eq!(trie.vocab_size(), 4);
        assert_eq!(trie.token(0), b"\xff<eos>");
        assert_eq!(trie.token(2), b"bc");
        assert_eq!(trie.eos_token(), 0);
        assert!(trie.is_special_token(0));
        assert!(!trie.is_special_token(1));
    }

    fn err(v: FlatVocab<'_>) -> String {
        build_tok_env(v)
            .err()
            .expect("the vocabulary must be refused")
    }

    #[test]
    fn refuses_bad_vocabularies() {
        let no_eos = FlatVocab {
            eos: None,
            ..flat(b"ab", &[1, 2], &[])
        };
        assert!(err(no_eos).contains("no end-of-sequence"));
        let far_eos = FlatVocab {
            eos: Some(2),
            ..flat(b"ab", &[1, 2], &[])
        };
        assert!(err(far_eos).contains("end-of-sequence token 2 is outside the vocabulary of 2"));
        assert!(err(flat(b"ab", &[2, 1], &[])).contains("token 1 ends at byte 1"));
        assert!(err(flat(b"ab", &[1, 3], &[])).contains("token 1 ends at byte 3"));
        assert!(err(flat(b"ab", &[1, 2], &[5])).contains("special token id 5"));
        assert!(err(flat(b"", &[], &[])).contains("empty"));
    }
}
