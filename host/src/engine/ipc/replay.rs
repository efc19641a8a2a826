//! What a new engine-core process needs to resume a request whose process
//! died, kept beside the request's stream (`engine::shared`) and updated
//! with every output dispatched to it.

use crate::engine::core::{EngineCoreOutput, EngineCoreRequest};
use crate::scheduler::PredictionTokens;

/// A live request as a replacement process must receive it: the request as
/// sent, with every token dispatched to its stream since folded into
/// `output_token_ids`, so the replay recomputes exactly what the client
/// already has and samples on from there.
pub(crate) struct Replay {
    request: EngineCoreRequest,
    /// The prompt position after the last prompt logprob dispatched (1
    /// before any: the first token has none). A replay re-requests only
    /// what is missing, and a recomputed chunk is cut to what is new.
    prompt_logprobs_next: u32,
    /// Whether an engine-core process has received the request; one added
    /// while the process was being replaced is first sent by the replay,
    /// which then does not count as replaying it.
    sent: bool,
    /// The prediction counts of the processes that ran the request before
    /// the current one (each process counts from zero).
    prediction_before: PredictionTokens,
    /// The current process's latest prediction counts.
    prediction_now: PredictionTokens,
}

impl Replay {
    /// `request` (under its internal id), `sent` to the current process or
    /// waiting for the replay to send it.
    pub(crate) fn new(request: EngineCoreRequest, sent: bool) -> Replay {
        Replay {
            request,
            prompt_logprobs_next: 1,
            sent,
            prediction_before: PredictionTokens::default(),
            prediction_now: PredictionTokens::default(),
        }
    }

    /// Folds an output into the request, first cutting from it the prompt
    /// logprobs its stream already got; false when nothing is left to send.
    pub(crate) fn record(&mut self, out: &mut EngineCoreOutput) -> bool {
        self.request
            .output_token_ids
            .extend_from_slice(&out.new_token_ids);
        if let Some(now) = out.prediction_tokens.as_mut() {
            self.prediction_now = *now;
            *now = self.prediction_before + self.prediction_now;
        }
        let Some(chunk) = out.new_prompt_logprobs.as_mut() else {
            return true;
        };
        let end = chunk.start.saturating_add(chunk.entries.len() as u32);
        let seen = self.prompt_logprobs_next.saturating_sub(chunk.start) as usize;
        self.prompt_logprobs_next = self.prompt_logprobs_next.max(end);
        if seen == 0 {
            return true;
        }
        if seen < chunk.entries.len() {
            chunk.entries.drain(..seen);
            chunk.start += seen as u32;
            return true;
        }
        out.new_prompt_logprobs = None;
        !out.new_token_ids.is_empty() || out.finish_reason.is_some() || out.error.is_some()
    }

    /// Whether an earlier process had the request (it is replayed, not new);
    /// from now on it counts as sent.
    pub(crate) fn take_sent(&mut self) -> bool {
        std::mem::replace(&mut self.sent, true)
    }

    /// The request to send a new engine-core process, which counts its
    /// prediction's tokens from zero again.
    pub(crate) fn resubmission(&mut self) -> EngineCoreRequest {
        self.prediction_before = self.prediction_before + std::mem::take(&mut self.prediction_now);
        let mut req = self.request.clone();
        if self.prompt_logprobs_next as usize >= req.prompt_token_ids.len() {
            // All delivered: recomputing them would only be cut again.
            req.sampling_params.prompt_logprobs = None;
        }
        req
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::client::EngineCoreError;
    use crate::engine::core::EngineStats;
    use crate::engine::shared::Shared;
    use crate::engine::{PrefixCacheStats, SchedulerStats, SpecDecodingStats};
    use crate::sampling::SamplingParams;
    use crate::step::{PromptLogprob, PromptLogprobs};

    fn request(prompt_logprobs: Option<u32>) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: "r#1".into(),
            prompt_token_ids: (100..110).collect(),
            sampling_params: SamplingParams {
                prompt_logprobs,
                ..SamplingParams::default()
            },
            priority: 0,
            output_token_ids: Vec::new(),
            prediction: Vec::new(),
            cache_salt: None,
        }
    }

    fn output(tokens: &[u32], prompt: Option<(u32, u32)>) -> EngineCoreOutput {
        let chunk = prompt.map(|(start, end)| PromptLogprobs {
            start,
            entries: (start..end)
                .map(|i| PromptLogprob {
                    token: 100 + i,
                    logprob: -1.0,
                    rank: 1,
                    top: Vec::new(),
                })
                .collect(),
        });
        EngineCoreOutput {
            request_id: "r#1".into(),
            new_token_ids: tokens.to_vec(),
            finish_reason: None,
            num_cached_tokens: 0,
            new_logprobs: Vec::new(),
            error: None,
            new_prompt_logprobs: chunk,
            prediction_tokens: None,
        }
    }

    #[test]
    fn prediction_counts_add_up_over_the_processes_that_ran_the_request() {
        let tally = |accepted, rejected| Some(PredictionTokens { accepted, rejected });
        let predicted = EngineCoreRequest {
            prediction: vec![7, 8, 9],
            ..request(None)
        };
        let mut replay = Replay::new(predicted, true);
        let mut out = output(&[7], None);
        out.prediction_tokens = tally(2, 1);
        assert!(replay.record(&mut out));
        assert_eq!(out.prediction_tokens, tally(2, 1));
        let again = replay.resubmission();
        assert_eq!(again.prediction, [7, 8, 9]);
        // The new process counts from zero; the stream sees the sum.
        let mut out = output(&[8], None);
        out.prediction_tokens = tally(3, 0);
        assert!(replay.record(&mut out));
        assert_eq!(out.prediction_tokens, tally(5, 1));
        // A request without a prediction has no tally.
        let mut out = output(&[9], None);
        assert!(replay.record(&mut out));
        assert_eq!(out.prediction_tokens, None);
    }

    #[test]
    fn a_resubmission_carries_every_token_dispatched() {
        let mut replay = Replay::new(request(None), true);
        for tokens in [&[7][..], &[8, 9], &[]] {
            assert!(replay.record(&mut output(tokens, None)));
        }
        let again = replay.resubmission();
        assert_eq!(again.output_token_ids, [7, 8, 9]);
        assert_eq!(again.prompt_token_ids, request(None).prompt_token_ids);
        assert_eq!(again.request_id, "r#1");
        assert!(replay.take_sent());
        // Added during a restart: first sent by the replay, then counted.
        let mut late = Replay::new(request(None), false);
        assert!(!late.take_sent());
        assert!(late.take_sent());
    }

    #[test]
    fn prompt_logprobs_are_delivered_once_across_a_replay() {
        let mut replay = Replay::new(request(Some(2)), true);
        // A chunked prefill delivered positions 1..6 before the death.
        let mut first = output(&[], Some((1, 6)));
        assert!(replay.record(&mut first));
        assert_eq!(first.new_prompt_logprobs.unwrap().entries.len(), 5);
        // Incomplete: the replay asks again, and the recomputed chunks are
        // cut to what is new.
        assert_eq!(
            replay.resubmission().sampling_params.prompt_logprobs,
            Some(2)
        );
        let mut repeat = output(&[], Some((1, 4)));
        assert!(!replay.record(&mut repeat), "nothing new: not sent");
        let mut rest = output(&[42], Some((4, 10)));
        assert!(replay.record(&mut rest));
        let rest = rest.new_prompt_logprobs.unwrap();
        assert_eq!(rest.start, 6);
        assert_eq!(
            rest.entries.iter().map(|e| e.token).collect::<Vec<_>>(),
            (106..110).collect::<Vec<_>>()
        );
        // Complete: a later replay does not ask for them at all.
        let again = replay.resubmission();
        assert_eq!(again.sampling_params.prompt_logprobs, None);
        assert_eq!(again.output_token_ids, [42]);
    }

    fn stats(generated: u64, worker_restarts: u64, running: usize) -> EngineStats {
        EngineStats {
            scheduler: SchedulerStats {
                num_running: running,
                num_waiting: 0,
                kv_cache_usage: 0.0,
                prefix_cache: PrefixCacheStats::default(),
                num_preemptions: 1,
                num_policy_fallbacks: 0,
                spec_decoding: SpecDecodingStats {
                    num_accepted_tokens: generated,
                    num_accepted_tokens_per_pos: vec![generated],
                    ..Default::default()
                },
                ..Default::default()
            },
            num_prompt_tokens: 10,
            num_generation_tokens: generated,
            last_step: Default::default(),
            num_worker_restarts: worker_restarts,
            num_worker_replayed_requests: 3 * worker_restarts,
            plugin_faults: [("test:p".to_string(), worker_restarts)].into(),
        }
    }

    #[test]
    fn shared_keeps_the_replay_set_and_counts_over_processes() {
        let shared = Shared::new(stats(0, 0, 0));
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut req = request(None);
        req.request_id = "a".into();
        assert_eq!(shared.register(&mut req, tx, Some(true)), Ok("a".into()));
        let mut out = output(&[5, 6], None);
        out.request_id = req.request_id.clone();
        shared.dispatch(vec![out]);
        let (requests, replayed) = shared.take_replay();
        assert_eq!(replayed, 1);
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].request_id, req.request_id);
        assert_eq!(requests[0].output_token_ids, [5, 6]);

        // Counters add up over the dead processes; gauges are the latest's.
        shared.publish_stats(stats(40, 1, 16));
        shared.carry_over(stats(0, 0, 0));
        shared.publish_stats(stats(2, 0, 16));
        shared.carry_over(stats(0, 0, 0));
        shared.publish_stats(stats(5, 1, 4));
        let total = shared.stats();
        assert_eq!(total.num_generation_tokens, 47);
        assert_eq!(total.num_prompt_tokens, 30);
        assert_eq!(total.scheduler.num_preemptions, 3);
        let spec = &total.scheduler.spec_decoding;
        assert_eq!(spec.num_accepted_tokens, 47);
        assert_eq!(spec.num_accepted_tokens_per_pos, [47]);
        assert_eq!(total.num_worker_restarts, 2);
        assert_eq!(total.num_worker_replayed_requests, 6);
        assert_eq!(total.plugin_faults, [("test:p".to_string(), 2)].into());
        assert_eq!(total.scheduler.num_running, 4);

        // Once stopped, nothing registers (its stream would never end).
        shared.stop(Some("gone".into()));
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut late = request(None);
        late.request_id = "b".into();
        assert_eq!(
            shared.register(&mut late, tx, Some(true)),
            Err(EngineCoreError::Dead("gone".into()))
        );
    }
}
