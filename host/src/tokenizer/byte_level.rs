//! GPT-2's byte-level alphabet: byte-level BPE stores each byte of the text
//! as one printable character, so a token's string spells its bytes. The
//! incremental detokenizer needs a token's raw bytes (a token may end in the
//! middle of a multi-byte character), so it reverses that mapping here.

/// Bytes that GPT-2 keeps as the character of the same code point: printable
/// Latin-1 except the soft hyphen.
const fn is_kept(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Number of bytes that are not kept (controls, space, DEL, C1, NBSP, soft hyphen).
const SHIFTED_LEN: usize = 68;

/// The bytes that are not kept, in increasing order: the `n`-th of them is
/// spelled as code point `256 + n`.
const SHIFTED: [u8; SHIFTED_LEN] = {
    let mut out = [0u8; SHIFTED_LEN];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !is_kept(b as u8) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

/// The byte that character `c` spells, if `c` is one of the 256 characters of
/// the byte-level alphabet.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = u32::from(c);
    match u8::try_from(cp) {
        Ok(b) => is_kept(b).then_some(b),
        Err(_) => SHIFTED.get(usize::try_from(cp - 256).ok()?).copied(),
    }
}

/// The character that spells byte `b` in the byte-level alphabet (tests
/// build synthetic vocabularies with it).
#[cfg(test)]
pub(crate) fn byte_to_char(b: u8) -> char {
    if is_kept(b) {
        return char::from(b);
    }
    // SHIFTED holds every byte that is not kept, so the search always finds it.
    let n = SHIFTED.iter().position(|&s| s == b).unwrap_or(0) as u32;
    char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The bytes a token stands for, exactly as the `tokenizers` ByteLevel
/// decoder computes them: every character mapped back to its byte, or — when
/// some character is outside the alphabet, as in special tokens such as
/// `<|im_start|>` that only use kept characters or added tokens that do not —
/// the token's own UTF-8 bytes.
pub(crate) fn token_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    #[test]
    fn alphabet_matches_the_tokenizers_crate() {
        // An independent source: the crate's own 256-character alphabet.
        let alphabet = ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        let mut seen = [false; 256];
        for c in alphabet {
            let b = char_to_byte(c).unwrap_or_else(|| panic!("{c:?} is in the alphabet"));
            assert!(!seen[usize::from(b)], "byte {b} spelled twice");
            seen[usize::from(b)] = true;
            assert_eq!(byte_to_char(b), c);
        }
    }

    #[test]
    fn known_spellings() {
        // GPT-2 spells space as 'Ġ' (U+0120) and newline as 'Ċ' (U+010A).
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('€'), None);
        assert_eq!(char_to_byte(char::from_u32(256 + 68).unwrap()), None);
    }

    #[test]
    fn token_bytes_falls_back_to_utf8() {
        assert_eq!(token_bytes("Ġhello"), b" hello");
        assert_eq!(token_bytes("ðŁĺ"), vec![0xF0, 0x9F, 0x98]);
        assert_eq!(token_bytes("<|im_start|>"), b"<|im_start|>");
        assert_eq!(token_bytes("a€"), "a€".as_bytes());
    }
}
