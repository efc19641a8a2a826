//! The persistent batch's device-sampling side: which steps it offers to
//! the device, the rows' seeds and positions, and recording the device's
//! tokens as the host sampler would.

use super::*;
use crate::step::{CachedRequestData, NewRequestData};

fn new_req(h: u32, prompt_len: usize, params: SamplingParams) -> NewRequestData {
    NewRequestData {
        handle: ReqHandle(h),
        request_id: format!("r{h}"),
        prompt_token_ids: (0..prompt_len as u32).map(|t| 100 + t).collect(),
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
        vec![(ReqHandle(0), [11]), (ReqHandle(1), [12])]
    );
    assert_eq!(out.logprobs, vec![None, None]);
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
