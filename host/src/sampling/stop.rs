//! Incremental stop-string detection over streamed text.
//!
//! The detokenizer hands over one text delta per generated token. A stop string
//! may span several deltas, so text that could still turn out to be the start
//! of a stop string is held back until it is known to be safe; on a match the
//! text is cut before the stop string (or after it, with
//! `include_stop_str_in_output`), as vLLM's detokenizer does.

use super::params::SamplingParams;

/// What one [`StopChecker::push`] produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopUpdate {
    /// Text that is final and can be streamed to the client now.
    pub text: String,
    /// The stop string that ended generation with this delta, if any.
    pub stop: Option<String>,
}

/// Watches a request's output text for its stop strings.
///
/// Invariant: everything returned in [`StopUpdate::text`] so far followed by
/// [`StopChecker::pending`] equals everything pushed, until a stop string
/// matches; from then on the returned text ends where the output ends.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    include_stop: bool,
    /// Stop strings only count once more than this many tokens were pushed.
    min_tokens: usize,
    tokens_pushed: usize,
    /// The latest pushed text: the held-back part plus at least the last
    /// `longest stop - 1` bytes, so a match can start in text already emitted
    /// (possible with `include_stop_str_in_output`, which holds nothing back).
    recent: String,
    /// Bytes of `recent` already returned; the rest is held back.
    emitted: usize,
    /// Length in bytes of the longest stop string.
    max_stop_len: usize,
    stopped: bool,
}

impl StopChecker {
    /// A checker for `stops`; a stop string is only recognised once more than
    /// `min_tokens` deltas were pushed and it ends in the latest delta (vLLM
    /// ignores stop strings while `min_tokens` is not reached).
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool, min_tokens: usize) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            max_stop_len: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            include_stop: include_stop_str_in_output,
            min_tokens,
            tokens_pushed: 0,
            recent: String::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// A checker configured from a request's `stop`, `include_stop_str_in_output`
    /// and `min_tokens`.
    pub fn from_params(params: &SamplingParams) -> Self {
        Self::new(
            params.stop.clone(),
            params.include_stop_str_in_output,
            params.min_tokens as usize,
        )
    }

    /// Text currently held back because it might begin a stop string.
    pub fn pending(&self) -> &str {
        &self.recent[self.emitted..]
    }

    /// True once a stop string matched; later pushes return nothing.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the text delta of one generated token (possibly empty) and returns
    /// the text that became safe to emit, plus the stop string if one matched.
    ///
    /// When several stop strings occur, the one that completes first wins (the
    /// earliest end; on equal ends the longer one), so the result does not
    /// depend on how the text was split into deltas.
    pub fn push(&mut self, delta: &str) -> StopUpdate {
        if self.stopped {
            return StopUpdate::default();
        }
        self.tokens_pushed += 1;
        let old_len = self.recent.len();
        self.recent.push_str(delta);
        if self.tokens_pushed > self.min_tokens {
            if let Some((start, end, index)) = self.earliest_match(old_len) {
                self.stopped = true;
                // A cut match never starts in emitted text (it was held
                // back); the max only guards the slice.
                let cut = (if self.include_stop { end } else { start }).max(self.emitted);
                let text = self.recent[self.emitted..cut].to_string();
                self.recent.clear();
                self.emitted = 0;
                return StopUpdate {
                    text,
                    stop: Some(self.stops[index].clone()),
                };
            }
        }
        let hold = if self.include_stop {
            0
        } else {
            self.partial_suffix_len()
        };
        // Emitted text never starts a possible match, so this stays >= emitted;
        // the max guards the slice anyway.
        let safe_end = (self.recent.len() - hold).max(self.emitted);
        let text = self.recent[self.emitted..safe_end].to_string();
        self.emitted = safe_end;
        self.forget_old_text();
        StopUpdate { text, stop: None }
    }

    /// Releases the held-back text when generation ended for another reason
    /// (EOS, stop token, length); it can no longer become a stop string.
    pub fn finish(&mut self) -> String {
        let text = self.recent.split_off(self.emitted);
        self.recent.clear();
        self.emitted = 0;
        text
    }

    /// Drops emitted text that no future match can reach, keeping `recent`
    /// short so each push costs O(delta + stop lengths).
    fn forget_old_text(&mut self) {
        let lookback = self.max_stop_len.saturating_sub(1);
        let mut keep_from = self.emitted.min(self.recent.len().saturating_sub(lookback));
        while !self.recent.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        self.recent.drain(..keep_from);
        self.emitted -= keep_from;
    }

    /// The occurrence `(start, end, stop index)` with the smallest end (then
    /// smallest start) among those ending after byte `old_len` of `recent`.
    /// Earlier occurrences were already checked by previous pushes.
    fn earliest_match(&self, old_len: usize) -> Option<(usize, usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| {
                let mut from = (old_len + 1).saturating_sub(stop.len());
                while !self.recent.is_char_boundary(from) {
                    from += 1;
                }
                let start = from + self.recent[from..].find(stop.as_str())?;
                Some((start + stop.len(), start, index))
            })
            .min()
            .map(|(end, start, index)| (start, end, index))
    }

    /// Length of the longest suffix of `recent` that is a proper prefix of a
    /// stop string: that much text must wait for the next delta.
    fn partial_suffix_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .filter(|&j| stop.is_char_boundary(j))
                    .find(|&j| self.recent.ends_with(&stop[..j]))
            })
            .max()
            .unwrap_or(0)
    }
}
