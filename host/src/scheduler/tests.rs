//! Scheduler unit tests: budget, chunked prefill, preemption and resume,
//! rejection, abort, stop conditions, prefix caching and policy fallback.

use super::*;
use crate::sampling::SamplingParams;
use crate::step::SchedulerOutput;

const EOS: u32 = 2;

pub(super) fn config(num_blocks: u32, block_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        long_prefill_token_threshold: 0,
        enable_chunked_prefill: true,
        block_size,
        num_blocks,
        enable_prefix_caching: true,
        eos_token_id: Some(EOS),
        policy: "builtin:fcfs".into(),
        num_speculative_tokens: 0,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
    }
}

pub(super) fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    }
}

/// A request whose prompt is `len` tokens starting at `first` (never EOS).
pub(super) fn request(id: &str, first: u32, len: u32, p: SamplingParams) -> Request {
    Request::new(
        id,
        (first..first + len).map(|t| t + 100).collect(),
        p,
        0.0,
        0,
    )
}

/// Samples `token` for every request whose scheduled chunk completes its
/// sequence (what a worker returns).
fn sample_all(s: &Scheduler, out: &SchedulerOutput, token: u32) -> Vec<(ReqHandle, Vec<u32>)> {
    out.num_scheduled_tokens
        .iter()
        .filter(|(h, _)| {
            s.request(*h)
                .is_some_and(|r| r.num_computed_tokens() >= r.num_tokens())
        })
        .map(|&(h, _)| (h, vec![token]))
        .collect()
}

/// One step with `token` sampled for every completed request.
pub(super) fn step(s: &mut Scheduler, token: u32) -> (SchedulerOutput, Vec<RequestOutput>) {
    let out = s.schedule();
    let sampled = sample_all(s, &out, token);
    let outputs = s.update_from_output(&out, &sampled);
    s.check_invariants().unwrap();
    (out, outputs)
}

fn scheduled(out: &SchedulerOutput) -> Vec<(u32, u32)> {
    out.num_scheduled_tokens
        .iter()
        .map(|(h, n)| (h.0, *n))
        .collect()
}

#[test]
fn config_validation_names_the_field() {
    let mut c = config(8, 4);
    c.max_num_seqs = 0;
    let e = Scheduler::new(c).unwrap_err().to_string();
    assert!(e.contains("max_num_seqs = 0"), "{e}");
    let mut c = config(8, 4);
    c.enable_chunked_prefill = false;
    let e = Scheduler::new(c).unwrap_err().to_string();
    assert!(
        e.contains("max_num_batched_tokens = 64") && e.contains("max_model_len (256)"),
        "{e}"
    );
    let mut c = config(8, 4);
    c.policy = "nope".into();
    assert!(matches!(
        Scheduler::new(c),
        Err(SchedulerError::UnknownPolicy { .. })
    ));
}

#[test]
fn chunked_prefill_splits_a_long_prompt_within_the_budget() {
    let mut s = Scheduler::new(config(64, 4)).unwrap();
    let h = s.add_request(request("a", 0, 150, params(4))).unwrap();
    let (out, outputs) = step(&mut s, 7);
    assert_eq!(scheduled(&out), vec![(h.0, 64)]);
    assert_eq!(out.scheduled_new_reqs.len(), 1);
    assert_eq!(out.scheduled_new_reqs[0].prompt_token_ids.len(), 150);
    assert_eq!(
        out.scheduled_new_reqs[0].block_ids.len(),
        16,
        "64 tokens / 4"
    );
    assert!(outputs.is_empty(), "a partial prefill produces no token");
    let (out, _) = step(&mut s, 7);
    assert_eq!(scheduled(&out), vec![(h.0, 64)]);
    assert_eq!(out.scheduled_cached_reqs.num_computed_tokens, vec![64]);
    assert_eq!(out.scheduled_cached_reqs.new_block_ids(0).len(), 16);
    let (out, outputs) = step(&mut s, 7);
    assert_eq!(scheduled(&out), vec![(h.0, 22)]);
    assert_eq!(outputs.len(), 1);
    assert_eq!(&*outputs[0].new_token_ids, &[7]);
    let (out, _) = step(&mut s, 7);
    assert_eq!(
        scheduled(&out),
        vec![(h.0, 1)],
        "then one decode token per step"
    );
}

#[test]
fn budget_is_shared_and_long_prefill_threshold_caps_chunks() {
    let mut c = config(64, 4);
    c.long_prefill_token_threshold = 16;
    let mut s = Scheduler::new(c).unwrap();
    let a = s.add_request(request("a", 0, 40, params(4))).unwrap();
    let b = s.add_request(request("b", 50, 40, params(4))).unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(scheduled(&out), vec![(a.0, 16), (b.0, 16)]);

    let mut s = Scheduler::new(config(64, 4)).unwrap();
    let a = s.add_request(request("a", 0, 40, params(4))).unwrap();
    let b = s.add_request(request("b", 50, 40, params(4))).unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(
        scheduled(&out),
        vec![(a.0, 40), (b.0, 24)],
        "64-token budget"
    );
    assert_eq!(out.total_num_scheduled_tokens, 64);
}

#[test]
fn without_chunking_a_prompt_that_does_not_fit_stops_admission() {
    let mut c = config(64, 4);
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 100;
    c.max_model_len = 100;
    let mut s = Scheduler::new(c).unwrap();
    let a = s.add_request(request("a", 0, 80, params(4))).unwrap();
    s.add_request(request("b", 90, 30, params(4))).unwrap();
    s.add_request(request("c", 200, 10, params(4))).unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(
        scheduled(&out),
        vec![(a.0, 80)],
        "b does not fit and c may not skip ahead"
    );
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.scheduled_new_reqs.len(), 2);
}

#[test]
fn max_num_seqs_limits_the_running_batch() {
    let mut c = config(64, 4);
    c.max_num_seqs = 3;
    let mut s = Scheduler::new(c).unwrap();
    for i in 0..5 {
        s.add_request(request(&format!("r{i}"), i * 10, 4, params(3)))
            .unwrap();
    }
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.scheduled_new_reqs.len(), 3);
    assert_eq!((s.num_running(), s.num_waiting()), (3, 2));
    for _ in 0..3 {
        step(&mut s, 7);
    }
    assert_eq!(
        s.num_running(),
        2,
        "the first three finished after 3 tokens"
    );
}

#[test]
fn fcfs_preempts_the_last_request_and_resumes_it_from_the_cache() {
    // 6 blocks of 4: two 8-token prompts fit (4 blocks); growing both to 13
    // tokens needs 8 blocks, so the later one is preempted.
    let mut s = Scheduler::new(config(6, 4)).unwrap();
    let a = s.add_request(request("a", 0, 8, params(10))).unwrap();
    let b = s.add_request(request("b", 20, 8, params(10))).unwrap();
    let mut preempted_at = None;
    for i in 0..8 {
        let (out, _) = step(&mut s, 7);
        if !out.preempted_req_ids.is_empty() {
            assert_eq!(out.preempted_req_ids, vec![b]);
            assert!(scheduled(&out).iter().all(|&(h, _)| h == a.0));
            preempted_at = Some(i);
            break;
        }
    }
    assert!(preempted_at.is_some(), "b must be preempted");
    let rb = s.request(b).unwrap();
    assert_eq!(rb.status(), RequestStatus::Preempted);
    assert_eq!((rb.num_computed_tokens(), rb.block_ids().len()), (0, 0));
    assert_eq!(rb.num_preemptions(), 1);
    // Run until b is resumed; it must come back as a cached request flagged
    // resumed, with its whole table. Its three computed blocks were cached
    // when it was freed, but a's two later blocks evicted b's last two (tail
    // first), so exactly its first block (4 tokens) is a hit.
    let mut resumed = false;
    for _ in 0..40 {
        let (out, _) = step(&mut s, 7);
        let c = &out.scheduled_cached_reqs;
        if let Some(i) = c.handles.iter().position(|&h| h == b) {
            if c.resumed_from_preemption[i] {
                let rb = s.request(b).unwrap();
                assert_eq!(c.new_block_ids(i), rb.block_ids());
                assert_eq!(c.num_computed_tokens[i], 4);
                resumed = true;
                break;
            }
        }
    }
    assert!(resumed);
    while s.has_unfinished_requests() {
        step(&mut s, 7);
    }
    assert_eq!(s.kv_cache_manager().num_free_blocks(), 6);
    assert_eq!(s.make_stats().num_preemptions, 1);
}

#[test]
fn priority_preempts_the_least_important_even_if_already_scheduled() {
    // 7 blocks of 4. low (10-token prompt) runs first; high (8 tokens)
    // joins. When high needs its 4th block at 13 tokens, low (already
    // scheduled this step, not needing a block) must be preempted instead.
    let mut c = config(7, 4);
    c.policy = "builtin:priority".into();
    let mut s = Scheduler::new(c).unwrap();
    let low = s
        .add_request(Request::new(
            "low",
            (100..110).collect(),
            params(10),
            0.0,
            5,
        ))
        .unwrap();
    step(&mut s, 7);
    let high = s
        .add_request(Request::new(
            "high",
            (200..208).collect(),
            params(10),
            1.0,
            0,
        ))
        .unwrap();
    loop {
        let (out, _) = step(&mut s, 7);
        if !out.preempted_req_ids.is_empty() {
            assert_eq!(
                out.preempted_req_ids,
                vec![low],
                "FCFS would have chosen `high` (last)"
            );
            assert_eq!(
                scheduled(&out),
                vec![(high.0, 1)],
                "low's tokens were unscheduled"
            );
            assert_eq!(out.total_num_scheduled_tokens, 1);
            break;
        }
        assert!(
            s.request(high).is_some(),
            "high finished without any preemption"
        );
    }
    while s.has_unfinished_requests() {
        step(&mut s, 7);
    }
}

#[test]
fn impossible_requests_are_rejected_with_the_reason() {
    let mut s = Scheduler::new(config(8, 4)).unwrap();
    let e = s
        .add_request(request("long", 0, 200, params(100)))
        .unwrap_err();
    assert!(matches!(
        e,
        SchedulerError::ExceedsMaxModelLen { total: 300, .. }
    ));
    let msg = e.to_string();
    assert!(
        msg.contains("\"long\"")
            && msg.contains("exceeds max_model_len (256)")
            && msg.contains("at most 56"),
        "{msg}"
    );
    // 8 blocks of 4 = 32 slots; 20 + 14 - 1 = 33 tokens need 9 blocks.
    let e = s
        .add_request(request("big", 0, 20, params(14)))
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("needs 9 KV blocks") && msg.contains("has 8"),
        "{msg}"
    );
    assert!(s.add_request(request("fits", 0, 20, params(13))).is_ok());
    let e = s.add_request(request("fits", 0, 4, params(1))).unwrap_err();
    assert!(matches!(e, SchedulerError::DuplicateRequestId(_)));
    let e = s
        .add_request(Request::new("empty", vec![], params(1), 0.0, 0))
        .unwrap_err();
    assert!(e.to_string().contains("prompt is empty"));
    let bad = SamplingParams {
        top_p: 0.0,
        ..params(4)
    };
    let e = s.add_request(request("bad", 0, 4, bad)).unwrap_err();
    assert!(e.to_string().contains("top_p"), "{e}");
    let two = SamplingParams { n: 2, ..params(4) };
    assert!(matches!(
        s.add_request(request("two", 0, 4, two)),
        Err(SchedulerError::UnsupportedN { n: 2, .. })
    ));
    assert_eq!(s.num_waiting(), 1, "rejected requests leave no trace");
}

#[test]
fn abort_frees_blocks_and_is_reported_to_the_worker() {
    let mut s = Scheduler::new(config(16, 4)).unwrap();
    let a = s.add_request(request("a", 0, 10, params(5))).unwrap();
    s.add_request(request("b", 30, 10, params(5))).unwrap();
    step(&mut s, 7);
    let used = 16 - s.kv_cache_manager().num_free_blocks();
    assert_eq!(used, 6);
    assert!(s.abort_request("a"));
    assert!(!s.abort_request("a"), "already gone");
    assert!(!s.abort_request("zzz"));
    assert_eq!(s.kv_cache_manager().num_free_blocks(), 16 - 3);
    s.check_invariants().unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.finished_req_ids, vec![a]);
    assert!(scheduled(&out).iter().all(|&(h, _)| h != a.0));
    // A waiting request can be aborted too.
    let w = s.add_request(request("w", 60, 4, params(2))).unwrap();
    assert!(s.abort_request("w"));
    assert_eq!(s.num_waiting(), 0);
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.finished_req_ids, vec![w]);
}

/// Drives one request to completion sampling `tokens` in turn.
fn finish_with(p: SamplingParams, tokens: &[u32]) -> (Vec<u32>, FinishReason) {
    let mut s = Scheduler::new(config(32, 4)).unwrap();
    s.add_request(request("r", 0, 5, p)).unwrap();
    let mut got = Vec::new();
    for &t in tokens {
        let (_, outputs) = step(&mut s, t);
        for o in outputs {
            got.extend_from_slice(&o.new_token_ids);
            if let Some(reason) = o.finish_reason {
                assert!(!s.has_unfinished_requests());
                assert_eq!(s.kv_cache_manager().num_free_blocks(), 32);
                return (got, reason);
            }
        }
    }
    panic!("request did not finish after {got:?}");
}

#[test]
fn eos_stops_unless_ignored() {
    assert_eq!(
        finish_with(params(10), &[5, EOS]),
        (vec![5, EOS], FinishReason::Eos)
    );
    let ignore = SamplingParams {
        ignore_eos: true,
        ..params(3)
    };
    assert_eq!(
        finish_with(ignore, &[EOS; 5]),
        (vec![EOS; 3], FinishReason::Length)
    );
}

#[test]
fn min_tokens_defers_eos_and_stop_tokens() {
    let p = SamplingParams {
        min_tokens: 3,
        stop_token_ids: vec![9],
        ..params(10)
    };
    assert_eq!(
        finish_with(p.clone(), &[EOS, 9, EOS]),
        (vec![EOS, 9, EOS], FinishReason::Eos)
    );
    assert_eq!(
        finish_with(p, &[9, 9, 9]),
        (vec![9, 9, 9], FinishReason::StopToken(9))
    );
}

#[test]
fn stop_token_ids_and_max_tokens() {
    let p = SamplingParams {
        stop_token_ids: vec![9, 11],
        ..params(10)
    };
    assert_eq!(
        finish_with(p, &[5, 6, 11]),
        (vec![5, 6, 11], FinishReason::StopToken(11))
    );
    assert_eq!(
        finish_with(params(3), &[5, 6, 7, 8]),
        (vec![5, 6, 7], FinishReason::Length)
    );
    // A stop token that is also the last allowed token reports the stop.
    assert_eq!(
        finish_with(params(2), &[5, EOS]),
        (vec![5, EOS], FinishReason::Eos)
    );
}

#[test]
fn tokens_after_a_stop_in_one_step_are_dropped() {
    let mut s = Scheduler::new(config(32, 4)).unwrap();
    let h = s.add_request(request("r", 0, 5, params(10))).unwrap();
    let out = s.schedule();
    let outputs = s.update_from_output(&out, &[(h, vec![5, EOS, 6])]);
    assert_eq!(&*outputs[0].new_token_ids, &[5, EOS]);
    assert_eq!(outputs[0].finish_reason, Some(FinishReason::Eos));
    assert_eq!(
        s.request_id(outputs[0].handle),
        Some("r"),
        "still named after finishing"
    );
}

#[test]
fn stale_and_foreign_entries_are_ignored() {
    let mut s = Scheduler::new(config(32, 4)).unwrap();
    let a = s.add_request(request("a", 0, 5, params(10))).unwrap();
    let out = s.schedule();
    let outputs = s.update_from_output(
        &out,
        &[(ReqHandle(99), vec![5]), (a, vec![5]), (a, vec![6])],
    );
    assert_eq!(
        outputs.len(),
        1,
        "unknown handle and duplicate entry ignored"
    );
    assert_eq!(s.request(a).unwrap().output_token_ids(), &[5]);
    let out2 = s.schedule();
    assert!(s.abort_request("a"));
    assert!(
        s.update_from_output(&out2, &[(a, vec![5])]).is_empty(),
        "aborted meanwhile"
    );
}

#[test]
fn handles_are_reused_only_after_their_finish_was_reported() {
    let mut s = Scheduler::new(config(32, 4)).unwrap();
    let a = s.add_request(request("a", 0, 5, params(1))).unwrap();
    let (_, outputs) = step(&mut s, 7);
    assert_eq!(outputs[0].finish_reason, Some(FinishReason::Length));
    let b = s.add_request(request("b", 0, 5, params(1))).unwrap();
    assert_ne!(a, b, "a's finish is not reported yet");
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.finished_req_ids, vec![a]);
    let c = s.add_request(request("c", 0, 5, params(1))).unwrap();
    assert_ne!(c, a, "not within the output that reported it");
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.finished_req_ids, vec![b]);
    let d = s.add_request(request("d", 0, 5, params(1))).unwrap();
    assert_eq!(d, a, "now a's slot is free");
}

#[test]
fn a_request_asking_for_prompt_logprobs_computes_its_whole_prompt() {
    // The second request shares the first one's 32-token prefix, but asks
    // for prompt logprobs: every prompt position is computed (as in vLLM).
    let mut s = Scheduler::new(config(64, 16)).unwrap();
    let prompt: Vec<u32> = (1000..1040).collect();
    s.add_request(Request::new("a", prompt.clone(), params(2), 0.0, 0))
        .unwrap();
    step(&mut s, 7);
    let wants = SamplingParams {
        prompt_logprobs: Some(1),
        ..params(2)
    };
    s.add_request(Request::new("b", prompt.clone(), wants, 1.0, 0))
        .unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.scheduled_new_reqs[0].num_computed_tokens, 0);
    assert!(scheduled(&out).contains(&(out.scheduled_new_reqs[0].handle.0, 40)));
    // A third without them still hits the cache.
    s.add_request(Request::new("c", prompt, params(2), 2.0, 0))
        .unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.scheduled_new_reqs[0].num_computed_tokens, 32);
}

#[test]
fn shared_prefixes_hit_the_cache() {
    // Ten requests share a 64-token system prefix (4 blocks of 16) and add 8
    // tokens of their own; each arrives after the previous one's prefill, so
    // every later one should find exactly the 64 shared tokens cached.
    let mut c = config(64, 16);
    c.max_num_batched_tokens = 128;
    let mut s = Scheduler::new(c).unwrap();
    let system: Vec<u32> = (1000..1064).collect();
    for i in 0..10u32 {
        let mut prompt = system.clone();
        prompt.extend((0..8).map(|k| 5000 + i * 8 + k));
        let h = s
            .add_request(Request::new(
                format!("r{i}"),
                prompt,
                params(2),
                i as f64,
                0,
            ))
            .unwrap();
        let (out, _) = step(&mut s, 7);
        let new = &out.scheduled_new_reqs[0];
        let expected_hit = if i == 0 { 0 } else { 64 };
        assert_eq!(new.num_computed_tokens, expected_hit, "request {i}");
        assert_eq!(scheduled(&out).last(), Some(&(h.0, 72 - expected_hit)));
    }
    while s.has_unfinished_requests() {
        step(&mut s, 7);
    }
    let stats = s.make_stats().prefix_cache;
    assert_eq!((stats.queries, stats.hits), (720, 576));
    assert!((stats.hit_rate() - 0.8).abs() < 1e-12);
    // Resetting forgets the prefix.
    s.reset_prefix_cache();
    let mut prompt = system.clone();
    prompt.push(1);
    s.add_request(Request::new("after-reset", prompt, params(1), 20.0, 0))
        .unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(out.scheduled_new_reqs[0].num_computed_tokens, 0);
}

#[test]
fn a_cache_salt_shares_the_prefix_cache_with_the_same_salt_alone() {
    let mut c = config(64, 16);
    c.max_num_batched_tokens = 128;
    let mut s = Scheduler::new(c).unwrap();
    let system: Vec<u32> = (1000..1064).collect();
    // Each request follows the earlier ones' prefills; the hit is what the
    // earlier requests with the same salt (or none) left cached.
    let cases = [
        (Some("tenant-a"), 0),
        (Some("tenant-a"), 64),
        (Some("tenant-b"), 0),
        (None, 0),
        (None, 64),
        (Some("tenant-b"), 64),
    ];
    for (i, (salt, hit)) in cases.into_iter().enumerate() {
        let mut prompt = system.clone();
        prompt.push(5000 + i as u32);
        let req = Request::new(format!("r{i}"), prompt, params(1), i as f64, 0);
        s.add_request(req.with_cache_salt(salt)).unwrap();
        let (out, _) = step(&mut s, 7);
        let new = &out.scheduled_new_reqs[0];
        assert_eq!(new.num_computed_tokens, hit, "request {i}, salt {salt:?}");
    }
}

/// A policy that answers nonsense, to exercise validation.
struct Broken;

impl SchedulingPolicy for Broken {
    fn name(&self) -> &str {
        "test:broken"
    }
    fn order_waiting(&mut self, view: &WaitingView<'_>, out: &mut Vec<u32>) {
        out.extend([0, 0, view.len() as u32]);
    }
    fn pick_victim(&mut self, view: &RunningView<'_>) -> Option<u32> {
        Some(view.len() as u32 + 3)
    }
}

#[test]
fn invalid_policy_answers_fall_back_to_fcfs() {
    let mut s = Scheduler::with_policy(config(6, 4), Box::new(Broken)).unwrap();
    assert_eq!(s.policy_name(), "test:broken");
    let a = s.add_request(request("a", 0, 8, params(10))).unwrap();
    let b = s.add_request(request("b", 20, 8, params(10))).unwrap();
    let (out, _) = step(&mut s, 7);
    assert_eq!(scheduled(&out), vec![(a.0, 8), (b.0, 8)], "FCFS order");
    assert_eq!(s.make_stats().num_policy_fallbacks, 1);
    let mut preempted = Vec::new();
    while s.has_unfinished_requests() {
        let (out, _) = step(&mut s, 7);
        preempted.extend(out.preempted_req_ids);
    }
    assert_eq!(preempted.first(), Some(&b), "FCFS victim: the last");
    assert!(s.make_stats().num_policy_fallbacks >= 2);
}

#[test]
fn async_scheduling_schedules_placeholders_and_stops_at_max_tokens() {
    let mut s = Scheduler::new(config(32, 4)).unwrap();
    let a = s.add_request(request("a", 0, 5, params(3))).unwrap();
    // Step 1 prefills and samples output 1; step 2 is scheduled before
    // output 1 is known and computes it as a placeholder.
    let out1 = s.schedule();
    assert_eq!(scheduled(&out1), vec![(a.0, 5)]);
    let out2 = s.schedule();
    assert_eq!(scheduled(&out2), vec![(a.0, 1)]);
    assert_eq!(s.request(a).unwrap().num_output_placeholders(), 2);
    let o = s.update_from_output(&out1, &[(a, vec![7])]);
    assert_eq!(
        (&o[0].new_token_ids[..], o[0].finish_reason),
        (&[7][..], None)
    );
    let out3 = s.schedule();
    assert_eq!(scheduled(&out3), vec![(a.0, 1)]);
    // Output 1 is known and outputs 2 and 3 are in flight: max_tokens is
    // reached, so nothing more is computed for it.
    assert!(s.schedule().is_empty());
    let o = s.update_from_output(&out2, &[(a, vec![8])]);
    assert_eq!(
        (&o[0].new_token_ids[..], o[0].finish_reason),
        (&[8][..], None)
    );
    let o = s.update_from_output(&out3, &[(a, vec![9])]);
    assert_eq!(
        (&o[0].new_token_ids[..], o[0].finish_reason),
        (&[9][..], Some(FinishReason::Length))
    );
    s.check_invariants().unwrap();
    assert_eq!(s.kv_cache_manager().num_free_blocks(), 32);
}

#[test]
fn a_request_preempted_with_a_step_in_flight_keeps_its_token() {
    // Two 7-token prompts fill the four 4-token blocks; the first decode
    // that needs a fifth block preempts b while its decode is in flight.
    let mut s = Scheduler::new(config(4, 4)).unwrap();
    let a = s.add_request(request("a", 0, 7, params(4))).unwrap();
    let b = s.add_request(request("b", 10, 7, params(4))).unwrap();
    let out1 = s.schedule();
    let out2 = s.schedule();
    assert_eq!(scheduled(&out2), vec![(a.0, 1), (b.0, 1)]);
    s.update_from_output(&out1, &[(a, vec![20]), (b, vec![30])]);
    let out3 = s.schedule();
    assert_eq!(out3.preempted_req_ids, vec![b]);
    assert_eq!(scheduled(&out3), vec![(a.0, 1)]);
    let o = s.update_from_output(&out2, &[(a, vec![21]), (b, vec![31])]);
    assert_eq!(
        o.len(),
        2,
        "the preempted request's token is applied: the worker has it"
    );
    let rb = s.request(b).unwrap();
    assert_eq!(
        (rb.status(), rb.output_token_ids()),
        (RequestStatus::Preempted, &[30, 31][..])
    );
    assert_eq!(rb.num_output_placeholders(), 0);
    s.update_from_output(&out3, &[(a, vec![22])]);
    s.check_invariants().unwrap();
    // Synchronous steps from here: b resumes with all its tokens.
    let mut tokens_b = vec![30, 31];
    for _ in 0..40 {
        let (_, outputs) = step(&mut s, 40);
        for o in outputs.iter().filter(|o| o.handle == b) {
            tokens_b.extend_from_slice(&o.new_token_ids);
        }
        if !s.has_unfinished_requests() {
            break;
        }
    }
    assert_eq!(tokens_b, vec![30, 31, 40, 40]);
    assert_eq!(s.kv_cache_manager().num_free_blocks(), 4);
}

/// A scheduler over `config(16, 4)` drafting up to `k` tokens by looking
/// up `min..=max` of the sequence's last tokens.
fn drafting(k: u32, min: u32, max: u32) -> Scheduler {
    let mut c = config(16, 4);
    (
        c.num_speculative_tokens,
        c.prompt_lookup_min,
        c.prompt_lookup_max,
    ) = (k, min, max);
    Scheduler::new(c).unwrap()
}

#[test]
fn a_decode_verifies_ngram_drafts_and_gives_back_the_slots_of_refused_ones() {
    let mut s = drafting(3, 1, 2);
    let prompt = vec![101, 102, 103, 101, 102];
    let h = s
        .add_request(Request::new("r", prompt, params(10), 0.0, 0))
        .unwrap();
    // The prefill samples 103: the sequence ends "102 103", seen at 1..3,
    // followed there by 101 102 103 (three drafts, the most allowed).
    let (out, _) = step(&mut s, 103);
    assert!(
        out.scheduled_spec_decode_tokens.is_empty(),
        "no drafts in a prefill"
    );
    let out = s.schedule();
    assert_eq!(
        scheduled(&out),
        [(h.0, 4)],
        "the last token and three drafts"
    );
    let spec = &out.scheduled_spec_decode_tokens;
    assert_eq!(
        (spec.handles.as_slice(), spec.drafts(0)),
        (&[h][..], &[101, 102, 103][..])
    );
    assert_eq!(s.request(h).unwrap().num_computed_tokens(), 9);
    // The worker kept two drafts and sampled 7 in place of the third.
    let outputs = s.update_from_output(&out, &[(h, vec![101, 102, 7])]);
    assert_eq!(&*outputs[0].new_token_ids, &[101, 102, 7]);
    let r = s.request(h).unwrap();
    assert_eq!((r.num_tokens(), r.num_computed_tokens()), (9, 8));
    s.check_invariants().unwrap();
    let stats = s.make_stats().spec_decoding;
    assert_eq!(
        (
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens
        ),
        (1, 3, 2)
    );
    assert_eq!(stats.num_accepted_tokens_per_pos, [1, 1, 0]);
    let out = s.schedule();
    assert_eq!(
        out.total_num_scheduled_tokens, 1,
        "7 never appeared before: no draft"
    );
    s.check_invariants().unwrap();
}

#[test]
fn drafts_never_carry_a_request_past_max_tokens() {
    for (max_tokens, want) in [(2, &[][..]), (3, &[101][..]), (9, &[101, 102][..])] {
        let mut s = drafting(3, 1, 1);
        let prompt = vec![101, 102, 101];
        let h = s
            .add_request(Request::new("r", prompt, params(max_tokens), 0.0, 0))
            .unwrap();
        step(&mut s, 102);
        // One output so far, and the step yields its drafts kept plus one:
        // max_tokens 2 leaves no room for a draft, 3 for one; with room,
        // all that follows the earlier 102 (two tokens) is drafted.
        let out = s.schedule();
        assert_eq!(
            out.scheduled_spec_decode_tokens.token_ids, want,
            "max_tokens {max_tokens}"
        );
        assert_eq!(scheduled(&out), [(h.0, want.len() as u32 + 1)]);
    }
}

#[test]
fn a_predicted_output_is_drafted_before_the_ngram_lookup_and_tallied() {
    let mut s = drafting(3, 1, 2);
    // The prompt recurs ("101 102"), but the prediction wins while the
    // output follows it.
    let prompt = vec![101, 102, 103, 101, 102];
    let req = Request::new("r", prompt, params(10), 0.0, 0).with_prediction(vec![7, 8, 9, 10]);
    let h = s.add_request(req).unwrap();
    // The prefill verifies the prediction's first tokens.
    let out = s.schedule();
    assert_eq!(scheduled(&out), [(h.0, 8)], "the prompt and three drafts");
    assert_eq!(out.scheduled_spec_decode_tokens.drafts(0), [7, 8, 9]);
    // The model kept 7 and 8, then said 5: two kept, one not.
    s.update_from_output(&out, &[(h, vec![7, 8, 5])]);
    let r = s.request(h).unwrap();
    assert_eq!((r.num_tokens(), r.num_computed_tokens()), (8, 7));
    assert_eq!(
        r.prediction_tokens(),
        Some(PredictionTokens {
            accepted: 2,
            rejected: 1
        })
    );
    // "8 5" is nowhere in the prediction; the n-gram lookup drafts instead
    // (5 never appeared: nothing) and the tally stays.
    let out = s.schedule();
    assert_eq!(out.total_num_scheduled_tokens, 1);
    s.update_from_output(&out, &[(h, vec![102])]);
    // "5 102" is not predicted either; the lookup finds 102 latest before
    // the output.
    let out = s.schedule();
    assert_eq!(out.scheduled_spec_decode_tokens.drafts(0), [7, 8, 5]);
    s.update_from_output(&out, &[(h, vec![7, 9])]);
    assert_eq!(
        s.request(h).unwrap().prediction_tokens(),
        Some(PredictionTokens {
            accepted: 2,
            rejected: 1
        }),
        "the lookup's drafts are not the prediction's"
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_chunked_prefill_drafts_its_prediction_in_the_last_chunk_alone() {
    let mut s = drafting(2, 1, 2);
    s.config.long_prefill_token_threshold = 4;
    let req = request("r", 0, 6, params(10)).with_prediction(vec![7, 8, 9]);
    let h = s.add_request(req).unwrap();
    let out = s.schedule();
    assert_eq!(scheduled(&out), [(h.0, 4)]);
    assert!(
        out.scheduled_spec_decode_tokens.is_empty(),
        "a first chunk samples nothing"
    );
    s.update_from_output(&out, &[] as &[(ReqHandle, Vec<u32>)]);
    let out = s.schedule();
    assert_eq!(
        scheduled(&out),
        [(h.0, 4)],
        "the last two prompt tokens, two drafts"
    );
    assert_eq!(out.scheduled_spec_decode_tokens.drafts(0), [7, 8]);
    s.update_from_output(&out, &[(h, vec![7, 8, 9])]);
    assert_eq!(
        s.request(h).unwrap().prediction_tokens(),
        Some(PredictionTokens {
            accepted: 2,
            rejected: 0
        })
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_prompt_goes_in_without_its_drafts_where_the_cache_cannot_hold_them() {
    let mut c = config(4, 4);
    c.num_speculative_tokens = 3;
    let mut s = Scheduler::new(c).unwrap();
    // The first request takes two of the four blocks; the second's prompt
    // fits in the other two, with its three drafts it would not.
    let first = s.add_request(request("a", 0, 8, params(8))).unwrap();
    let req = request("b", 20, 7, params(9)).with_prediction(vec![7, 8, 9]);
    let h = s.add_request(req).unwrap();
    let out = s.schedule();
    assert_eq!(scheduled(&out), [(first.0, 8), (h.0, 7)]);
    assert!(out.scheduled_spec_decode_tokens.is_empty());
    s.update_from_output(&out, &[(first, vec![3]), (h, vec![7])]);
    s.check_invariants().unwrap();
}

#[test]
fn a_prediction_without_speculative_decoding_is_refused_saying_how_to_turn_it_on() {
    let mut s = Scheduler::new(config(16, 4)).unwrap();
    let req = Request::new("r", vec![1, 2], params(10), 0.0, 0).with_prediction(vec![3]);
    let e = s.add_request(req).unwrap_err().to_string();
    assert!(e.contains("--speculative-config"), "{e}");
    // An empty prediction is none.
    let req = Request::new("r", vec![1, 2], params(10), 0.0, 0).with_prediction(Vec::new());
    s.add_request(req).unwrap();
}
