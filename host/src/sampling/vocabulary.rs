//! The served model's vocabulary, which a logits processor (0.3 and later)
//! learns through `set-vocabulary`: built by the engine from its tokenizer,
//! sent to the workers as JSON, and given to each processor instance. It
//! lives here, beside the sampling it constrains, because both the engine
//! (which builds it) and the plugin host (which hands it on) import
//! `sampling`, and neither may import the other.

/// The served model's vocabulary as the engine sends it to the workers
/// (JSON over `collective_rpc`'s `set_vocabulary`): every token's bytes
/// flat, with each token's end offset, the special ids and EOS. What a 0.3
/// logits processor's `set-vocabulary` receives.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Vocabulary {
    /// Every token's bytes, concatenated in id order.
    pub token_bytes: Vec<u8>,
    /// Token `i` ends at `token_ends[i]` (and starts where `i - 1` ends).
    pub token_ends: Vec<u32>,
    /// The special (control) tokens' ids, ascending.
    pub special_ids: Vec<u32>,
    /// The end-of-sequence token.
    pub eos: Option<u32>,
}

impl Vocabulary {
    /// Builds it from each token's bytes and whether it is special.
    pub fn from_tokens<'a>(
        tokens: impl IntoIterator<Item = (&'a [u8], bool)>,
        eos: Option<u32>,
    ) -> Vocabulary {
        let mut v = Vocabulary {
            token_bytes: Vec::new(),
            token_ends: Vec::new(),
            special_ids: Vec::new(),
            eos,
        };
        for (id, (bytes, special)) in tokens.into_iter().enumerate() {
            v.token_bytes.extend_from_slice(bytes);
            v.token_ends.push(v.token_bytes.len() as u32);
            if special {
                v.special_ids.push(id as u32);
            }
        }
        v
    }

    /// Tokens it describes.
    pub fn len(&self) -> usize {
        self.token_ends.len()
    }

    /// Whether it describes no token.
    pub fn is_empty(&self) -> bool {
        self.token_ends.is_empty()
    }

    /// Token `id`'s bytes.
    pub fn token(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let end = *self.token_ends.get(i)? as usize;
        let start = if i == 0 {
            0
        } else {
            self.token_ends[i - 1] as usize
        };
        self.token_bytes.get(start..end)
    }

    /// Checks the offsets and ids are consistent.
    pub fn validate(&self) -> Result<(), String> {
        if self.token_ends.windows(2).any(|w| w[0] > w[1]) {
            return Err("token_ends is not ascending".into());
        }
        if self.token_ends.last().map_or(0, |&e| e as usize) != self.token_bytes.len() {
            return Err("the last token end is not the length of token_bytes".into());
        }
        let n = self.len();
        if let Some(id) = self
            .special_ids
            .iter()
            .chain(&self.eos)
            .find(|&&id| id as usize >= n)
        {
            return Err(format!(
                "token id {id} is not below the vocabulary's {n} tokens"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_offsets_round_trip() {
        let toks: [(&[u8], bool); 3] = [(b"<s>", true), (b"ab", false), (b"", false)];
        let v = Vocabulary::from_tokens(toks, Some(0));
        v.validate().unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v.token(1), Some(&b"ab"[..]));
        assert_eq!(v.token(2), Some(&b""[..]));
        assert_eq!(v.token(3), None);
        assert_eq!(v.special_ids, [0]);
        let mut bad = v.clone();
        bad.eos = Some(3);
        assert!(bad.validate().unwrap_err().contains("token id 3"));
    }
}
