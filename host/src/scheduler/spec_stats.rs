//! Speculative decoding's counters (vLLM's `SpecDecodingStats`): how many
//! drafts were verified and how many kept, overall and per draft position.
//! The acceptance rate per position tells an operator how many draft
//! tokens are worth verifying: when the last positions are seldom kept,
//! a smaller `num_speculative_tokens` saves their compute.

use serde::{Deserialize, Serialize};

/// Totals since the scheduler started, for logs and `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecDecodingStats {
    /// Steps of a request that verified drafts.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens kept.
    pub num_accepted_tokens: u64,
    /// One entry per draft position (`num_speculative_tokens` of them;
    /// none with speculative decoding off): how many steps kept the draft
    /// there (a draft is kept only when every draft before it was).
    pub num_accepted_tokens_per_pos: Vec<u64>,
}

impl SpecDecodingStats {
    /// Zero counts for drafts of up to `num_spec_tokens` tokens.
    pub(crate) fn new(num_spec_tokens: usize) -> SpecDecodingStats {
        SpecDecodingStats {
            num_accepted_tokens_per_pos: vec![0; num_spec_tokens],
            ..Default::default()
        }
    }

    /// Counts a step that verifies `drafts` draft tokens of one request.
    pub(crate) fn observe_draft(&mut self, drafts: usize) {
        self.num_drafts += 1;
        self.num_draft_tokens += drafts as u64;
    }

    /// Counts the drafts one request's step kept: its first `kept`.
    pub(crate) fn observe_accepted(&mut self, kept: usize) {
        self.num_accepted_tokens += kept as u64;
        for n in self.num_accepted_tokens_per_pos.iter_mut().take(kept) {
            *n += 1;
        }
    }

    /// Adds another process's or rank's counters (every rank runs the
    /// same configuration; the longer position list wins).
    pub fn add(&mut self, other: &SpecDecodingStats) {
        self.num_drafts += other.num_drafts;
        self.num_draft_tokens += other.num_draft_tokens;
        self.num_accepted_tokens += other.num_accepted_tokens;
        let per_pos = &mut self.num_accepted_tokens_per_pos;
        if per_pos.len() < other.num_accepted_tokens_per_pos.len() {
            per_pos.resize(other.num_accepted_tokens_per_pos.len(), 0);
        }
        for (n, o) in per_pos.iter_mut().zip(&other.num_accepted_tokens_per_pos) {
            *n += o;
        }
    }

    /// The counts gained since `prev`, an earlier reading of the same
    /// counters (for a log interval).
    pub fn since(&self, prev: &SpecDecodingStats) -> SpecDecodingStats {
        let before = |i: usize| prev.num_accepted_tokens_per_pos.get(i).copied();
        SpecDecodingStats {
            num_drafts: self.num_drafts.saturating_sub(prev.num_drafts),
            num_draft_tokens: self.num_draft_tokens.saturating_sub(prev.num_draft_tokens),
            num_accepted_tokens: (self.num_accepted_tokens)
                .saturating_sub(prev.num_accepted_tokens),
            num_accepted_tokens_per_pos: (self.num_accepted_tokens_per_pos.iter().enumerate())
                .map(|(i, n)| n.saturating_sub(before(i).unwrap_or(0)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_counts_the_steps_that_kept_a_draft_there() {
        let mut s = SpecDecodingStats::new(3);
        for (drafts, kept) in [(3, 0), (3, 3), (2, 1), (3, 2)] {
            s.observe_draft(drafts);
            s.observe_accepted(kept);
        }
        assert_eq!((s.num_drafts, s.num_draft_tokens), (4, 11));
        assert_eq!(s.num_accepted_tokens, 6);
        assert_eq!(s.num_accepted_tokens_per_pos, [3, 2, 1]);
        assert_eq!(
            s.num_accepted_tokens_per_pos.iter().sum::<u64>(),
            s.num_accepted_tokens,
            "every kept draft sits at one position"
        );

        let mut total = SpecDecodingStats::default();
        total.add(&s);
        total.add(&s);
        assert_eq!(total.num_drafts, 8);
        assert_eq!(total.num_accepted_tokens, 12);
        assert_eq!(total.num_accepted_tokens_per_pos, [6, 4, 2]);
    }
}
