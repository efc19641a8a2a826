//! What `update_from_output` tells the engine: each request's new tokens and
//! finish. What a step tells the worker is [`crate::step::SchedulerOutput`].

use super::request::FinishReason;
use crate::step::ReqHandle;

/// Token ids stored inline up to four (a decode step yields one), so building
/// a step's outputs does not allocate per request.
#[derive(Clone, Default)]
pub struct NewTokens {
    len: u32,
    inline: [u32; 4],
    spill: Vec<u32>,
}

impl NewTokens {
    /// Appends a token.
    pub fn push(&mut self, t: u32) {
        let n = self.len as usize;
        if n < self.inline.len() {
            self.inline[n] = t;
        } else {
            if n == self.inline.len() {
                self.spill.extend_from_slice(&self.inline);
            }
            self.spill.push(t);
        }
        self.len += 1;
    }

    /// The tokens.
    pub fn as_slice(&self) -> &[u32] {
        let n = self.len as usize;
        if n <= self.inline.len() {
            &self.inline[..n]
        } else {
            &self.spill
        }
    }
}

impl std::ops::Deref for NewTokens {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl std::fmt::Debug for NewTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl PartialEq for NewTokens {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// What one request produced in one step. It names the request by handle
/// only (cloning the id string per token would cost more than the rest of
/// the step); [`Scheduler::request_id`](super::Scheduler::request_id) maps it
/// back, including for requests that just finished.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    /// The scheduler's handle.
    pub handle: ReqHandle,
    /// Tokens appended this step (a stop token is included).
    pub new_token_ids: NewTokens,
    /// Set when the request finished this step; its blocks are freed.
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub num_cached_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_tokens_spill_past_inline_capacity() {
        let mut t = NewTokens::default();
        assert!(t.is_empty());
        for i in 0..7 {
            t.push(i);
            assert_eq!(&*t, (0..=i).collect::<Vec<_>>().as_slice());
        }
    }
}
