//! Incremental detokenization for streaming: text deltas, one token at a time.
//!
//! Byte-level BPE tokens are byte strings, and a multi-byte character (an
//! emoji, a CJK ideograph) may be split across tokens. The detokenizer keeps
//! the bytes of an incomplete character until it is complete, so no delta
//! holds a broken character, and replaces invalid bytes with U+FFFD exactly
//! where `String::from_utf8_lossy` over all the bytes would: the deltas
//! concatenated (with [`IncrementalDetokenizer::finish`]) equal
//! `Tokenizer::decode` of all the ids.

use std::sync::Arc;

use super::error::TokenizerError;

/// Every token's bytes in one buffer, with its special flag: built once per
/// tokenizer and shared by all detokenizers.
#[derive(Debug)]
pub(crate) struct TokenPieces {
    bytes: Vec<u8>,
    /// `bytes[ends[id - 1]..ends[id]]` is token `id` (from 0 for id 0).
    ends: Vec<usize>,
    kinds: Vec<PieceKind>,
}

/// What an id stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PieceKind {
    /// No token has this id.
    Missing,
    /// A token that decodes to its bytes.
    Text,
    /// A special token: skipped when special tokens are skipped.
    Special,
}

impl TokenPieces {
    /// Builds the table for ids `0..len`; `piece(id)` gives the bytes of the
    /// token and whether it is special, or `None` when no token has that id.
    pub fn new(len: usize, mut piece: impl FnMut(u32) -> Option<(Vec<u8>, bool)>) -> TokenPieces {
        let mut pieces = TokenPieces {
            bytes: Vec::new(),
            ends: Vec::with_capacity(len),
            kinds: Vec::with_capacity(len),
        };
        for id in 0..len as u32 {
            let kind = match piece(id) {
                None => PieceKind::Missing,
                Some((bytes, special)) => {
                    pieces.bytes.extend_from_slice(&bytes);
                    if special {
                        PieceKind::Special
                    } else {
                        PieceKind::Text
                    }
                }
            };
            pieces.ends.push(pieces.bytes.len());
            pieces.kinds.push(kind);
        }
        pieces
    }

    /// Ids are `0..len()`.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// An error unless `id` names a token.
    pub fn check(&self, id: u32) -> Result<(), TokenizerError> {
        match self.kinds.get(id as usize) {
            Some(PieceKind::Text | PieceKind::Special) => Ok(()),
            _ => Err(TokenizerError::InvalidTokenId {
                id,
                vocab_size: self.len(),
            }),
        }
    }

    /// Whether `id` is a special token.
    pub fn is_special(&self, id: u32) -> bool {
        self.kinds.get(id as usize) == Some(&PieceKind::Special)
    }

    /// The bytes `id` contributes to the text: `None` for a special token
    /// when `skip_special_tokens`.
    pub fn bytes(
        &self,
        id: u32,
        skip_special_tokens: bool,
    ) -> Result<Option<&[u8]>, TokenizerError> {
        self.check(id)?;
        let i = id as usize;
        if skip_special_tokens && self.kinds[i] == PieceKind::Special {
            return Ok(None);
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Ok(Some(&self.bytes[start..self.ends[i]]))
    }
}

/// Turns a stream of token ids into text deltas (see the module docs).
/// Owns a shared handle on the vocabulary, so it can live in per-request
/// state independently of the [`super::Tokenizer`].
#[derive(Debug)]
pub struct IncrementalDetokenizer {
    pieces: Arc<TokenPieces>,
    skip_special_tokens: bool,
    /// Bytes of a character not yet complete (at most 3).
    pending: Vec<u8>,
    /// The text returned by the last call.
    delta: String,
}

impl IncrementalDetokenizer {
    pub(crate) fn new(
        pieces: Arc<TokenPieces>,
        skip_special_tokens: bool,
    ) -> IncrementalDetokenizer {
        IncrementalDetokenizer {
            pieces,
            skip_special_tokens,
            pending: Vec::new(),
            delta: String::new(),
        }
    }

    /// Adds token `id` and returns the text it completes: possibly empty (a
    /// skipped special token, or part of a character), possibly including a
    /// character begun by earlier tokens. An id outside the vocabulary is an
    /// error and leaves the state unchanged.
    pub fn push(&mut self, id: u32) -> Result<&str, TokenizerError> {
        self.delta.clear();
        if let Some(bytes) = self.pieces.bytes(id, self.skip_special_tokens)? {
            self.pending.extend_from_slice(bytes);
            let consumed = drain_complete(&self.pending, &mut self.delta);
            self.pending.drain(..consumed);
        }
        Ok(&self.delta)
    }

    /// Ends the stream: returns U+FFFD if an incomplete character is pending
    /// (as a lossy decode of all the bytes would), else nothing. The
    /// detokenizer is then empty and can take a new stream.
    pub fn finish(&mut self) -> &str {
        self.delta.clear();
        if !self.pending.is_empty() {
            self.pending.clear();
            self.delta.push(char::REPLACEMENT_CHARACTER);
        }
        &self.delta
    }
}

/// Appends the text of `bytes` to `out` up to a trailing incomplete
/// character, replacing each invalid sequence with one U+FFFD the way
/// `from_utf8_lossy` does, and returns how many bytes it consumed.
fn drain_complete(bytes: &[u8], out: &mut String) -> usize {
    let mut rest = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(text) => {
                out.push_str(text);
                return bytes.len();
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                out.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        rest = &after[n..];
                    }
                    // The input ends inside a character that may still complete.
                    None => return bytes.len() - after.len(),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` as one token each and returns the deltas.
    fn deltas(chunks: &[&[u8]]) -> Vec<String> {
        let pieces = TokenPieces::new(chunks.len(), |id| {
            Some((chunks[id as usize].to_vec(), false))
        });
        let mut d = IncrementalDetokenizer::new(Arc::new(pieces), false);
        let mut out: Vec<String> = (0..chunks.len() as u32)
            .map(|id| d.push(id).unwrap().to_owned())
            .collect();
        out.push(d.finish().to_owned());
        out
    }

    #[test]
    fn emoji_split_across_tokens_waits_until_complete() {
        let smile = "😀".as_bytes();
        assert_eq!(
            deltas(&[b"a", &smile[..1], &smile[1..3], &smile[3..], b"b"]),
            ["a", "", "", "😀", "b", ""]
        );
    }

    #[test]
    fn invalid_bytes_become_one_replacement_each_like_lossy() {
        // 0xE2 0x82 is a truncated 3-byte sequence, then 'A' proves it invalid.
        let chunks: [&[u8]; 3] = [b"\xE2", b"\x82", b"A\xFF"];
        let all: Vec<u8> = chunks.concat();
        assert_eq!(deltas(&chunks).concat(), String::from_utf8_lossy(&all));
        assert_eq!(deltas(&chunks), ["", "", "\u{FFFD}A\u{FFFD}", ""]);
    }

    #[test]
    fn trailing_incomplete_character_is_flushed_by_finish() {
        assert_eq!(deltas(&[b"x\xF0\x9F"]), ["x", "\u{FFFD}"]);
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let pieces = Arc::new(TokenPieces::new(3, |id| match id {
            0 => Some((b"<s>".to_vec(), true)),
            1 => Some((b"hi".to_vec(), false)),
            _ => None,
        }));
        let mut skip = IncrementalDetokenizer::new(pieces.clone(), true);
        assert_eq!(skip.push(0).unwrap(), "");
        assert_eq!(skip.push(1).unwrap(), "hi");
        let mut keep = IncrementalDetokenizer::new(pieces, false);
        assert_eq!(keep.push(0).unwrap(), "<s>");
        assert!(matches!(
            keep.push(2),
            Err(TokenizerError::InvalidTokenId {
                id: 2,
                vocab_size: 3
            })
        ));
        assert!(matches!(
            keep.push(u32::MAX),
            Err(TokenizerError::InvalidTokenId { .. })
        ));
    }
}
