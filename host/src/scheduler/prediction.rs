//! Drafts from the client's own guess at the output (OpenAI's predicted
//! outputs: `prediction: {"type": "content", "content": ...}`). An answer
//! that mostly repeats a text the client already holds — a file sent back
//! with a small edit — is known ahead of the model; while the output
//! follows the prediction, the next predicted tokens are verified as draft
//! tokens, so every step the model agrees with keeps several tokens. Where
//! the output departs from the prediction (the edit), drafting pauses until
//! the output's last few tokens are found in the prediction again.
//!
//! The output is the model's either way: drafts are only kept where the
//! model would have produced them (see `worker/input_batch/speculative.rs`).

/// Fewest output tokens that place a lost prediction again: one token
/// (a space, a newline) recurs everywhere, and a wrong place drafts a
/// wrong continuation every step until the next mismatch.
const MIN_ANCHOR: usize = 2;
/// Longest output suffix looked for when placing a lost prediction; the
/// longest that is found wins.
const MAX_ANCHOR: usize = 8;

/// How a request's prediction of its output fared so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PredictionTokens {
    /// Predicted tokens the model kept.
    pub accepted: u32,
    /// Predicted tokens verified as drafts and not kept (they cost compute
    /// like any token).
    pub rejected: u32,
}

impl std::ops::Add for PredictionTokens {
    type Output = PredictionTokens;

    fn add(self, other: PredictionTokens) -> PredictionTokens {
        PredictionTokens {
            accepted: self.accepted.saturating_add(other.accepted),
            rejected: self.rejected.saturating_add(other.rejected),
        }
    }
}

/// A request's prediction and where its output stands in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prediction {
    tokens: Vec<u32>,
    /// The index of the predicted token that should come next; `None`
    /// while the output has departed from the prediction.
    cursor: Option<usize>,
    /// Output tokens already matched against the prediction.
    seen: usize,
    /// Where the output last departed: placing it again looks from here
    /// first, as an edited text goes on after the edit, not before it.
    floor: usize,
    /// Whether the drafts of the step in flight came from here.
    in_flight: bool,
    tally: PredictionTokens,
}

impl Prediction {
    /// A prediction of the output's first tokens.
    pub fn new(tokens: Vec<u32>) -> Self {
        Prediction {
            tokens,
            cursor: Some(0),
            seen: 0,
            floor: 0,
            in_flight: false,
            tally: PredictionTokens::default(),
        }
    }

    /// Appends to `out` at most `limit` predicted tokens to follow
    /// `output` (the request's output tokens so far) and returns how many:
    /// none while the output has departed from the prediction.
    pub fn propose(&mut self, output: &[u32], limit: usize, out: &mut Vec<u32>) -> usize {
        self.follow(output);
        let n = match self.cursor {
            Some(c) => {
                let next = &self.tokens[c..self.tokens.len().min(c + limit)];
                out.extend_from_slice(next);
                next.len()
            }
            None => 0,
        };
        self.in_flight = n > 0;
        n
    }

    /// Counts what the step that verified `drafts` drafts kept, if they
    /// were this prediction's.
    pub fn settle(&mut self, drafts: usize, kept: usize) {
        if std::mem::take(&mut self.in_flight) {
            self.tally = self.tally
                + PredictionTokens {
                    accepted: kept as u32,
                    rejected: (drafts - kept) as u32,
                };
        }
    }

    /// Predicted tokens the model kept and those verified and not kept
    /// (OpenAI's `accepted_prediction_tokens` and
    /// `rejected_prediction_tokens`).
    pub fn tally(&self) -> PredictionTokens {
        self.tally
    }

    /// Moves the cursor over the output tokens not seen yet: along the
    /// prediction while they match it, else to where the output's end is
    /// found again (or nowhere).
    fn follow(&mut self, output: &[u32]) {
        let new = &output[self.seen.min(output.len())..];
        if new.is_empty() {
            return;
        }
        self.seen = output.len();
        let tokens = &self.tokens;
        self.cursor = match self.cursor {
            Some(c) if tokens.get(c..c + new.len()) == Some(new) => Some(c + new.len()),
            departed => {
                if let Some(c) = departed {
                    self.floor = c;
                }
                self.place(output)
            }
        };
    }

    /// Just past the first place in the prediction (from `floor` on, then
    /// before it) that ends like `output`, trying the longest suffix first.
    fn place(&self, output: &[u32]) -> Option<usize> {
        let p = &self.tokens;
        for n in (MIN_ANCHOR..=MAX_ANCHOR.min(output.len())).rev() {
            let suffix = &output[output.len() - n..];
            let last_start = (p.len() + 1).saturating_sub(n);
            let find = |starts: std::ops::Range<usize>| {
                starts
                    .into_iter()
                    .find(|&i| p[i] == suffix[0] && p[i..i + n] == *suffix)
            };
            let floor = self.floor.min(last_start);
            if let Some(i) = find(floor..last_start).or_else(|| find(0..floor)) {
                return Some(i + n);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The drafts proposed after each output token, the output revealed
    /// one token at a time.
    fn drafts(prediction: &[u32], output: &[u32], limit: usize) -> Vec<Vec<u32>> {
        let mut p = Prediction::new(prediction.to_vec());
        (1..=output.len())
            .map(|i| {
                let mut out = Vec::new();
                p.propose(&output[..i], limit, &mut out);
                out
            })
            .collect()
    }

    #[test]
    fn an_output_that_follows_the_prediction_drafts_its_next_tokens() {
        let p = [10, 11, 12, 13, 14, 15];
        let d = drafts(&p, &[10, 11, 12], 3);
        assert_eq!(d, [vec![11, 12, 13], vec![12, 13, 14], vec![13, 14, 15]]);
        // The limit caps, the prediction's end ends the drafts.
        assert_eq!(
            drafts(&p, &[10, 11, 12, 13, 14, 15], 2).last().unwrap(),
            &[] as &[u32]
        );
        assert_eq!(drafts(&p, &[10], 1), [vec![11]]);
    }

    #[test]
    fn drafting_resumes_after_an_edit_once_two_tokens_are_found_again() {
        // "def foo ( x ) : return x" renamed to "def bar ( x ) : ...".
        let p = [1, 2, 3, 4, 5, 6, 7, 8];
        let out = [1, 20, 3, 4, 5, 6];
        let d = drafts(&p, &out, 2);
        assert_eq!(d[0], [2, 3]); // still following
        assert_eq!(d[1], [] as [u32; 0]); // 20: departed
        assert_eq!(d[2], [] as [u32; 0]); // "20 3" is not in the prediction
        assert_eq!(d[3], [5, 6]); // "3 4" is: placed after it
        assert_eq!(d[4], [6, 7]); // following again
    }

    #[test]
    fn a_lost_prediction_is_placed_after_the_edit_before_earlier_copies() {
        // The pair 7 8 occurs twice; the output departed after the first.
        let p = [7, 8, 1, 2, 3, 7, 8, 4];
        let out = [7, 8, 1, 9, 7, 8];
        let d = drafts(&p, &out, 1);
        assert_eq!(d[2], [2]);
        assert_eq!(d[3], [] as [u32; 0]);
        // From the departure (index 3) on, 7 8 is at 5: what follows is 4.
        assert_eq!(d[5], [4]);
        // Nothing from the departure on: the earlier copy is used.
        let d = drafts(&[5, 6, 1, 2], &[5, 6, 1, 2, 3, 5, 6], 2);
        assert_eq!(d[6], [1, 2]);
    }

    #[test]
    fn the_counts_are_the_drafts_this_prediction_proposed() {
        let mut p = Prediction::new(vec![1, 2, 3, 4]);
        let mut out = Vec::new();
        assert_eq!(p.propose(&[1], 3, &mut out), 3);
        p.settle(3, 1); // kept 2, then the model said 9
        assert_eq!(p.propose(&[1, 2, 9], 3, &mut out), 0);
        p.settle(2, 2); // someone else's drafts: not counted
        assert_eq!((p.tally().accepted, p.tally().rejected), (1, 2));
    }

    proptest! {
        /// Drafts are always a run of the prediction; while the output is a
        /// prefix of the prediction they are exactly what comes next.
        #[test]
        fn drafts_are_the_prediction_where_the_output_follows_it(
            prediction in proptest::collection::vec(0u32..4, 0..30),
            output in proptest::collection::vec(0u32..4, 1..30),
            limit in 0usize..6,
        ) {
            let mut p = Prediction::new(prediction.clone());
            for i in 1..=output.len() {
                let mut out = Vec::new();
                let n = p.propose(&output[..i], limit, &mut out);
                prop_assert_eq!(n, out.len());
                prop_assert!(n <= limit);
                let is_run = n == 0 || prediction.windows(n).any(|w| w == &out[..]);
                prop_assert!(is_run, "{:?} is not in {:?}", out, prediction);
                if prediction.starts_with(&output[..i]) {
                    let end = prediction.len().min(i + limit);
                    prop_assert_eq!(&out[..], &prediction[i..end]);
                }
            }
        }
    }
}
