//! The scheduler's side of a worker-group restart: the new workers hold no
//! request and an empty KV cache, so every live request becomes a
//! preempted one, to be recomputed from its prompt and the tokens it
//! already produced.

use super::{RequestStatus, Scheduler};

impl Scheduler {
    /// Forgets everything the workers held, after they died and before new
    /// ones take their place: every running request is preempted (its blocks
    /// freed, its computation to be redone) and moves to the front of the
    /// queue in its running order; every request's tokens sampled by steps
    /// that will never report are forgotten; the prefix cache is emptied
    /// (the KV it pointed at is gone); and each request is announced to the
    /// new workers as new, with its output so far. Returns how many requests
    /// will be replayed.
    ///
    /// Tokens already reported stay: they were streamed, and are recomputed,
    /// not sampled again, so nothing is lost, repeated or reordered.
    pub fn forget_worker_state(&mut self) -> usize {
        for &h in self.running.iter().rev() {
            let req = self.slots[h.index()]
                .as_mut()
                .expect("a running handle names a live request");
            self.kv
                .free(&mut req.kv, &req.all_token_ids, req.num_computed_tokens);
            req.num_computed_tokens = 0;
            req.status = RequestStatus::Preempted;
            self.waiting.push_front(h);
        }
        self.running.clear();
        for &h in &self.waiting {
            let req = self.slots[h.index()]
                .as_mut()
                .expect("a waiting handle names a live request");
            req.num_output_placeholders = 0;
            req.seen_by_worker = false;
        }
        self.kv.reset_prefix_cache();
        self.waiting.len()
    }
}
