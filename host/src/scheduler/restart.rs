//! The scheduler's side of a worker-group restart: the new workers hold no
//! request and an empty KV cache, so every live request becomes a
//! preempted one, to be recomputed from its prompt and the tokens it
//! already produced.

use super::{RequestStatus, Scheduler};

impl Scheduler {
    /// Forgets everything the workers held, after they died and before new
    /// ones take their place: every running request is preempted (its blocks
    /// freed, its computation to be redone) and moves to the front of the
    /// queue in its running order; every request's tokens sampled (and
    /// drafts verified) by steps that will never report are forgotten; the
    /// prefix cache is emptied
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
            req.num_draft_tokens = 0;
            req.seen_by_worker = false;
        }
        self.kv.reset_prefix_cache();
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{config, params, request, step};
    use super::super::*;

    /// Two requests decoding with a step in flight (async scheduling) and a
    /// third waiting behind a full batch.
    fn mid_decode() -> (Scheduler, Vec<ReqHandle>) {
        let mut c = config(64, 4);
        c.max_num_seqs = 2;
        let mut s = Scheduler::new(c).unwrap();
        let handles = vec![
            s.add_request(request("a", 0, 6, params(10))).unwrap(),
            s.add_request(request("b", 20, 5, params(10))).unwrap(),
            s.add_request(request("c", 40, 7, params(10))).unwrap(),
        ];
        step(&mut s, 7);
        step(&mut s, 8);
        // Scheduled, never answered: the worker died with it.
        let lost = s.schedule();
        assert_eq!(lost.num_scheduled_tokens.len(), 2);
        (s, handles)
    }

    #[test]
    fn every_request_is_replayed_from_its_reported_tokens() {
        let (mut s, h) = mid_decode();
        let before: Vec<Vec<u32>> = h
            .iter()
            .map(|&h| s.request(h).unwrap().all_token_ids().to_vec())
            .collect();
        assert_eq!(s.forget_worker_state(), 3);
        s.check_invariants().unwrap();
        assert_eq!(s.kv_cache_manager().usage(), 0.0, "every block is free");
        // The running order is kept, ahead of the request that waited.
        assert_eq!(s.waiting.iter().copied().collect::<Vec<_>>(), h);
        for (&h, tokens) in h.iter().zip(&before) {
            let r = s.request(h).unwrap();
            assert_eq!(r.all_token_ids(), &tokens[..], "reported tokens stay");
            assert_eq!(r.num_output_placeholders(), 0, "lost tokens are dropped");
        }
        // The new workers see each as new, with its output so far, and
        // recompute all of it.
        let out = s.schedule();
        let news: Vec<(&str, usize, usize, u32)> = out
            .scheduled_new_reqs
            .iter()
            .map(|n| {
                let r = s.request(n.handle).unwrap();
                (
                    n.request_id.as_str(),
                    n.prompt_token_ids.len() + n.output_token_ids.len(),
                    r.num_tokens(),
                    n.num_computed_tokens,
                )
            })
            .collect();
        assert_eq!(news, [("a", 8, 8, 0), ("b", 7, 7, 0)]);
        assert!(out.scheduled_cached_reqs.handles.is_empty());
        assert_eq!(out.scheduled_new_reqs[0].output_token_ids, [7, 8]);
    }

    #[test]
    fn a_replayed_request_counts_its_output_against_max_tokens() {
        let mut s = Scheduler::new(config(64, 4)).unwrap();
        let resumed = request("r", 0, 6, params(4)).with_output(&[9, 9, 9]);
        let h = s.add_request(resumed).unwrap();
        let (_, outs) = step(&mut s, 5);
        assert_eq!(outs[0].handle, h);
        assert_eq!(outs[0].new_token_ids.to_vec(), [5]);
        assert_eq!(outs[0].finish_reason, Some(FinishReason::Length));
        let done = request("d", 0, 6, params(3)).with_output(&[9, 9, 9]);
        let e = s.add_request(done).unwrap_err().to_string();
        assert!(e.contains("replayed with 3 output tokens"), "{e}");
    }
}
