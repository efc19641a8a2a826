//! Converting llguidance's token set into the WIT's allow-mask layout:
//! `u64` words, token `t` at bit `t % 64` of word `t / 64`.

use llguidance::toktrie::SimpleVob;

/// Appends the mask of `allowed` over a vocabulary of `vocab_size` ids to
/// `out` (exactly `vocab_size.div_ceil(64)` words). Returns whether any
/// token below `vocab_size` is allowed, since the host refuses an empty
/// mask.
pub fn push_words(allowed: &SimpleVob, vocab_size: u32, out: &mut Vec<u64>) -> bool {
    let n = (vocab_size as usize).div_ceil(64);
    // llguidance stores 32-bit words, least significant bit first: two of
    // them make one of ours.
    let src = allowed.as_slice();
    let word = |i: usize| u64::from(src.get(i).copied().unwrap_or(0));
    let start = out.len();
    out.extend((0..n).map(|i| word(2 * i) | (word(2 * i + 1) << 32)));
    // Bits past the vocabulary are ignored by the host, so they must not
    // count as "something is allowed".
    let tail = vocab_size % 64;
    let mut any = false;
    for (i, w) in out[start..].iter().enumerate() {
        let valid = if i + 1 == n && tail != 0 {
            w & ((1u64 << tail) - 1)
        } else {
            *w
        };
        any |= valid != 0;
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vob(size: usize, set: &[u32]) -> SimpleVob {
        let mut v = SimpleVob::alloc(size);
        set.iter().for_each(|&t| v.allow_token(t));
        v
    }

    #[test]
    fn packs_bits_least_significant_first() {
        let mut out = vec![7];
        let any = push_words(&vob(130, &[0, 33, 64, 129]), 130, &mut out);
        assert!(any);
        assert_eq!(out, vec![7, 1 | (1 << 33), 1, 2]);
    }

    #[test]
    fn pads_to_the_batch_vocabulary_and_ignores_ids_past_it() {
        // The trie knows 70 tokens, the model's rows have 200.
        let mut out = Vec::new();
        assert!(push_words(&vob(70, &[69]), 200, &mut out));
        assert_eq!(out, vec![0, 1 << 5, 0, 0]);
        // Only token 69 allowed, but the batch has 65 ids: nothing usable.
        let mut out = Vec::new();
        assert!(!push_words(&vob(70, &[69]), 65, &mut out));
        assert_eq!(out.len(), 2);
    }
}
