//! The persistent batch's device-sampling side: which steps it offers to
//! the device, the rows' seeds and positions, and recording the device's
//! tokens as the host sampler would.

use super::step_plan::prompt_logprob;
use super::*;
use crate::step::{CachedRequestData, NewRequestData};

fn new_req(h: u32, prompt_len: usize, params: SamplingParams) -> NewRequestData {
    NewRequestData {
        handle: ReqHandle(h),
        request_id: format!("r{h}"),
        prompt_token_ids: (0..prompt_len as u32).map(|t| 100 + t).collect(),
        output_token_ids: Vec::new(),
        sampling_params: params,
        block_ids: vec![h],
        num_computed_tokens: 0,
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// The first step: A (seeded, 5 prompt tokens) and B (unseeded, 4) whole,
/// C (10) only its first 6 tokens, so C samples nothing yet.
fn first_step() -> SchedulerOutput {
    SchedulerOutput {
        scheduled_new_reqs: vec![
            new_req(0, 5, seeded(7)),
            new_req(
                1,
                4,
                SamplingParams {
                    temperature: 1.0,
                    ..SamplingParams::default()
                },
            ),
            new_req(2, 10, SamplingParams::default()),
        ],
        num_scheduled_tokens: vec![(ReqHandle(0), 5), (ReqHandle(1), 4), (ReqHandle(2), 6)],
        ..SchedulerOutput::default()
    }
}

/// The second step: A and B decode one token, C finishes its prompt.
fn second_step() -> SchedulerOutput {
    SchedulerOutput {
        scheduled_cached_reqs: CachedRequestData {
            handles: vec![ReqHandle(0), ReqHandle(1), ReqHandle(2)],
            resumed_from_preemption: vec![false; 3],
            num_computed_tokens: vec![5, 4, 6],
            new_block_offsets: vec![0, 0, 0, 0],
            new_block_ids: Vec::new(),
        },
        num_scheduled_tokens: vec![(ReqHandle(0), 1), (ReqHandle(1), 1), (ReqHandle(2), 4)],
        ..SchedulerOutput::default()
    }
}

/// `(seed, position, logits_row)` of each device row.
fn rows(batch: &InputBatch, plan: &StepPlan) -> Vec<(u64, u32, usize)> {
    let rows = batch
        .device_rows(plan)
        .expect("a GPU batch without plugins offers its rows");
    rows.iter()
        .map(|r| (r.seed, r.position, r.logits_row))
        .collect()
}

#[test]
fn a_cpu_batch_never_offers_its_rows_to_a_device() {
    let mut batch = InputBatch::new(None);
    let plan = batch
        .prepare(&first_step(), &mut ModelInput::default())
        .unwrap();
    assert!(batch.device_rows(&plan).is_none());
    assert!(batch
        .requests
        .iter()
        .flatten()
        .all(|r| r.device_seed.is_none()));
}

#[test]
fn device_rows_keep_each_seed_across_steps_at_the_sampled_tokens_position() {
    let mut batch = InputBatch::new(None);
    batch.set_samples_on_device();
    let mut input = ModelInput::default();
    let plan = batch.prepare(&first_step(), &mut input).unwrap();
    let first = rows(&batch, &plan);
    // A's own seed; B's drawn one; both sample the token after their
    // prompt, from their sequence's logits row; C is mid-prefill.
    assert_eq!(first.len(), 2, "{first:?}");
    assert_eq!((first[0].0, first[0].1, first[0].2), (7, 5, 0));
    assert_eq!((first[1].1, first[1].2), (4, 1));
    let b_seed = first[1].0;
    batch.record_sampled(&plan, &[11, 12]).unwrap();

    let plan = batch.prepare(&second_step(), &mut input).unwrap();
    // The sampled tokens are the decode inputs.
    assert_eq!(&input.token_ids[..2], &[11, 12]);
    let second = rows(&batch, &plan);
    assert_eq!(second.len(), 3, "{second:?}");
    assert_eq!(second[0], (7, 6, 0));
    assert_eq!(
        second[1],
        (b_seed, 5, 1),
        "an unseeded request keeps its seed"
    );
    assert_eq!((second[2].1, second[2].2), (10, 2));
    // Two unseeded requests draw different seeds (2^-64 odds otherwise).
    assert_ne!(second[2].0, b_seed);
}

#[test]
fn recording_device_tokens_advances_requests_as_the_host_sampler_does() {
    let mut batch = InputBatch::new(None);
    batch.set_samples_on_device();
    let plan = batch
        .prepare(&first_step(), &mut ModelInput::default())
        .unwrap();
    let out = batch.record_sampled(&plan, &[11, 12]).unwrap();
    assert_eq!(
        out.sampled,
        vec![(ReqHandle(0), [11].into()), (ReqHandle(1), [12].into())]
    );
    assert_eq!(out.logprobs, vec![vec![], vec![]]);
    let a = batch.requests[0].as_ref().unwrap();
    assert_eq!((a.token_ids.len(), a.token_ids[5]), (6, 11));
    // The penalties' history counts it, as after `RequestSampler::sample`.
    assert_eq!(
        (a.sampler.num_output_tokens(), a.sampler.output_count(11)),
        (1, 1)
    );

    let plan = batch
        .prepare(&second_step(), &mut ModelInput::default())
        .unwrap();
    let err = batch
        .record_sampled(&plan, &[1, 2])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no token for request ReqHandle(2)"), "{err}");
}

// Prompt logprobs: which rows a step asks logits of, and each token once.

/// A step that computes tokens `start..start + n` of request `h`, known
/// to the batch already (`resumed` after a preemption).
fn continue_step(h: u32, start: u32, n: u32, resumed: bool) -> SchedulerOutput {
    let mut cached = CachedRequestData::default();
    cached.push(
        ReqHandle(h),
        resumed,
        start,
        if resumed { &[0] } else { &[] },
    );
    SchedulerOutput {
        scheduled_cached_reqs: cached,
        num_scheduled_tokens: vec![(ReqHandle(h), n)],
        ..SchedulerOutput::default()
    }
}

/// `(seq, first, len)` of each span and the prompt tokens they predict.
fn spans(plan: &StepPlan) -> Vec<(usize, usize, usize, u32, Vec<u32>)> {
    plan.spans
        .iter()
        .zip(&plan.span_requests)
        .zip(&plan.prompt_logprobs)
        .map(|((s, r), (_, p))| {
            let SpanRequest::PromptLogprobs { tokens, .. } = r else {
                panic!("a draft span in a step without drafts")
            };
            (s.seq, s.first, s.len, p.start, tokens.clone())
        })
        .collect()
}

#[test]
fn prompt_logprob_spans_cover_each_prompt_token_once_across_chunks_and_preemption() {
    let mut batch = InputBatch::new(None);
    let mut input = ModelInput::default();
    let wants = SamplingParams {
        prompt_logprobs: Some(2),
        ..SamplingParams::default()
    };
    // Request 0 (no prompt logprobs, 3 tokens) beside request 1 (asks, 10
    // tokens 100..110) prefilled in chunks of 4, 4 and 2.
    let so = SchedulerOutput {
        scheduled_new_reqs: vec![
            new_req(0, 3, SamplingParams::default()),
            new_req(1, 10, wants),
        ],
        num_scheduled_tokens: vec![(ReqHandle(0), 3), (ReqHandle(1), 4)],
        ..SchedulerOutput::default()
    };
    let plan = batch.prepare(&so, &mut input).unwrap();
    // Rows 0..4 of sequence 1 predict prompt tokens 1..5.
    assert_eq!(spans(&plan), vec![(1, 0, 4, 1, vec![101, 102, 103, 104])]);
    let plan = batch
        .prepare(&continue_step(1, 4, 4, false), &mut input)
        .unwrap();
    assert_eq!(spans(&plan), vec![(0, 0, 4, 5, vec![105, 106, 107, 108])]);
    // The last chunk: its last position predicts the first output, not a
    // prompt token.
    let plan = batch
        .prepare(&continue_step(1, 8, 2, false), &mut input)
        .unwrap();
    assert_eq!(spans(&plan), vec![(0, 0, 1, 9, vec![109])]);
    // Preempted and recomputed from scratch: nothing is reported twice.
    let plan = batch
        .prepare(&continue_step(1, 0, 10, true), &mut input)
        .unwrap();
    assert!(plan.spans.is_empty() && plan.is_last_rows_only());
}

#[test]
fn a_recompute_after_a_preemption_mid_prefill_reports_only_what_is_missing() {
    let mut batch = InputBatch::new(None);
    let mut input = ModelInput::default();
    let wants = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::default()
    };
    let so = SchedulerOutput {
        scheduled_new_reqs: vec![new_req(0, 8, wants)],
        num_scheduled_tokens: vec![(ReqHandle(0), 5)],
        ..SchedulerOutput::default()
    };
    let plan = batch.prepare(&so, &mut input).unwrap();
    assert_eq!(
        spans(&plan),
        vec![(0, 0, 5, 1, vec![101, 102, 103, 104, 105])]
    );
    // Resumed from position 0 with the whole prompt: rows 5 and 6 only.
    let plan = batch
        .prepare(&continue_step(0, 0, 8, true), &mut input)
        .unwrap();
    assert_eq!(spans(&plan), vec![(0, 5, 2, 6, vec![106, 107])]);
}

#[test]
fn a_runner_without_prompt_logprobs_fails_only_the_requests_that_ask() {
    let mut batch = InputBatch::new(None);
    batch.set_no_prompt_logprobs(Some("not on this device".into()));
    let mut input = ModelInput::default();
    let so = SchedulerOutput {
        scheduled_new_reqs: vec![
            new_req(0, 3, SamplingParams::default()),
            new_req(
                1,
                4,
                SamplingParams {
                    prompt_logprobs: Some(1),
                    ..SamplingParams::default()
                },
            ),
        ],
        num_scheduled_tokens: vec![(ReqHandle(0), 3), (ReqHandle(1), 4)],
        ..SchedulerOutput::default()
    };
    let mut plan = batch.prepare(&so, &mut input).unwrap();
    assert_eq!(input.seqs.len(), 1, "only request 0 runs");
    assert!(plan.has_failures());
    let mut out = ModelRunnerOutput::default();
    plan.finish_output(&mut out);
    assert_eq!(
        out.failed,
        vec![(ReqHandle(1), "not on this device".to_string())]
    );
}

#[test]
fn a_prompt_logprob_entry_has_the_tokens_rank_and_the_sorted_top_k() {
    let logits = [1.0f32, 3.0, 2.0, 0.5, 3.0];
    let mut scratch = Vec::new();
    let e = prompt_logprob(&logits, 2, 3, &mut scratch);
    let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
    assert_eq!(e.token, 2);
    assert!((e.logprob - (2.0 - lse)).abs() < 1e-6);
    // Two tokens are more likely: rank 3.
    assert_eq!(e.rank, 3);
    let top: Vec<u32> = e.top.iter().map(|&(t, _)| t).collect();
    assert_eq!(top, vec![1, 4, 2]);
    assert!(e.top.windows(2).all(|w| w[0].1 >= w[1].1));
    assert!(e.top.iter().all(|&(_, l)| l <= 0.0));
    // k = 0: the token alone.
    assert!(prompt_logprob(&logits, 0, 0, &mut scratch).top.is_empty());
}
