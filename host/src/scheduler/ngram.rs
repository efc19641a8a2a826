//! The n-gram proposer of speculative decoding (vLLM's `method = "ngram"`,
//! also called prompt lookup): the next tokens are guessed by finding the
//! sequence's last few tokens earlier in the sequence and copying what
//! followed them there. It costs no model, only a scan of the request's
//! tokens, and pays off where output repeats its input or itself (quoting,
//! editing, code, lists).

/// Finds draft tokens for a request from its own tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramProposer {
    /// Most draft tokens per step.
    pub num_speculative_tokens: usize,
    /// Shortest suffix that may match.
    pub min_n: usize,
    /// Longest suffix tried first.
    pub max_n: usize,
}

impl NgramProposer {
    /// Appends to `out` at most `limit` (and at most
    /// `num_speculative_tokens`) draft tokens for the sequence `tokens`:
    /// for the longest suffix of `max_n` down to `min_n` tokens found
    /// earlier in `tokens` and followed there by at least one token, the
    /// tokens after its latest such occurrence. Returns how many it
    /// appended (0 when no suffix recurs).
    pub fn propose(&self, tokens: &[u32], limit: usize, out: &mut Vec<u32>) -> usize {
        let limit = limit.min(self.num_speculative_tokens);
        let len = tokens.len();
        if limit == 0 || self.min_n == 0 {
            return 0;
        }
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Latest start first: a sequence that loops repeats its most
            // recent pass. An occurrence must end before the last token, so
            // that a token follows it.
            let found = (0..len - n)
                .rev()
                .find(|&i| tokens[i] == suffix[0] && tokens[i..i + n] == *suffix);
            if let Some(i) = found {
                let next = &tokens[i + n..len.min(i + n + limit)];
                out.extend_from_slice(next);
                return next.len();
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn propose(p: &NgramProposer, tokens: &[u32], limit: usize) -> Vec<u32> {
        let mut out = vec![99];
        let n = p.propose(tokens, limit, &mut out);
        assert_eq!(n, out.len() - 1, "the count is what was appended");
        out.split_off(1)
    }

    /// The definition, written as plainly as possible: every
    /// (n, occurrence) pair, longest n first, latest occurrence first.
    fn reference(p: &NgramProposer, tokens: &[u32], limit: usize) -> Vec<u32> {
        let len = tokens.len();
        let limit = limit.min(p.num_speculative_tokens);
        for n in (p.min_n.max(1)..=p.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = tokens[len - n..].to_vec();
            let mut starts: Vec<usize> = (0..len - n)
                .filter(|&i| tokens[i..i + n].to_vec() == suffix)
                .collect();
            if let Some(i) = starts.pop() {
                return tokens[i + n..].iter().take(limit).copied().collect();
            }
        }
        Vec::new()
    }

    #[test]
    fn copies_what_followed_the_latest_match_of_the_longest_suffix() {
        let p = NgramProposer {
            num_speculative_tokens: 3,
            min_n: 1,
            max_n: 3,
        };
        // "1 2 3" recurs: what followed its latest earlier run is 7 8 9.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 6, 1, 2, 3];
        assert_eq!(propose(&p, &t, 10), [7, 8, 9]);
        // The caller's limit caps the drafts.
        assert_eq!(propose(&p, &t, 2), [7, 8]);
        assert_eq!(propose(&p, &t, 0), [] as [u32; 0]);
        // Nothing recurs: no drafts.
        assert_eq!(propose(&p, &[1, 2, 3, 4], 3), [] as [u32; 0]);
        // A run of one token predicts more of it (overlapping match).
        assert_eq!(propose(&p, &[5, 5, 5, 5], 3), [5]);
        // Only a shorter suffix recurs.
        let min2 = NgramProposer { min_n: 2, ..p };
        assert_eq!(propose(&min2, &[4, 1, 9, 9, 1], 3), [] as [u32; 0]);
        assert_eq!(propose(&p, &[4, 1, 9, 9, 1], 3), [9, 9, 1]);
    }

    proptest! {
        #[test]
        fn matches_the_definition(
            tokens in proptest::collection::vec(0u32..4, 0..40),
            k in 0usize..6,
            min_n in 0usize..4,
            extra in 0usize..3,
            limit in 0usize..8,
        ) {
            let p = NgramProposer { num_speculative_tokens: k, min_n, max_n: min_n + extra };
            let want = if min_n == 0 { Vec::new() } else { reference(&p, &tokens, limit) };
            prop_assert_eq!(propose(&p, &tokens, limit), want);
        }
    }
}
