//! A GPU worker's host fallback for device-eligible rows: when a step is
//! sampled on the host because one of its rows is not device-eligible, the
//! eligible rows still draw as the device sampler would
//! ([`host_draw::draw_like_device`]), with the same seed and position, so a
//! seeded request's tokens do not depend on its batch neighbours.

use super::CachedRequestState;
use crate::cuda::host_draw;
use crate::cuda::sampler::{device_eligible, DeviceRow};
use crate::sampling::SampledToken;

/// The token the device would sample for `req` from `logits_row`, recorded
/// in its sampler as [`RequestSampler::sample`] would; `None` when the row
/// is not the device's (a CPU worker's batch, or parameters the device
/// does not do), for the host sampler.
///
/// [`RequestSampler::sample`]: crate::sampling::RequestSampler::sample
pub(super) fn draw_like_device(
    req: &mut CachedRequestState,
    logits_row: &mut [f32],
) -> Option<SampledToken> {
    let seed = req.device_seed?;
    if !device_eligible(&req.params) {
        return None;
    }
    let row = DeviceRow::from_params(
        &req.params,
        seed,
        req.token_ids.len() as u32,
        logits_row.len(),
    );
    // Eligible rows have no penalties or min_tokens: prepare edits nothing
    // and only keeps what finish reports.
    let prepared = req.sampler.prepare(logits_row, &req.params);
    let token = host_draw::draw_like_device(logits_row, &row);
    Some(req.sampler.finish(logits_row, token, prepared))
}

#[cfg(test)]
mod tests {
    use super::super::{InputBatch, StepPlan};
    use crate::cuda::host_draw;
    use crate::cuda::sampler::DeviceRow;
    use crate::model_runner::{Logits, ModelInput};
    use crate::sampling::rng::Xoshiro256StarStar;
    use crate::sampling::{RequestSampler, SamplingParams};
    use crate::step::{NewRequestData, ReqHandle, SchedulerOutput};

    const VOCAB: usize = 500;
    const PROMPT: usize = 6;

    fn seeded() -> SamplingParams {
        SamplingParams {
            temperature: 1.5,
            top_k: 200,
            seed: Some(42),
            ..Default::default()
        }
    }

    /// A batch of `params` (one request each, whole prompts) and its plan.
    fn step(on_device: bool, params: &[SamplingParams]) -> (InputBatch, StepPlan) {
        let mut batch = InputBatch::new(None);
        if on_device {
            batch.set_samples_on_device();
        }
        let so = SchedulerOutput {
            scheduled_new_reqs: params
                .iter()
                .enumerate()
                .map(|(i, p)| NewRequestData {
                    handle: ReqHandle(i as u32),
                    request_id: format!("r{i}"),
                    prompt_token_ids: vec![1; PROMPT],
                    output_token_ids: Vec::new(),
                    sampling_params: p.clone(),
                    block_ids: vec![i as u32],
                    num_computed_tokens: 0,
                })
                .collect(),
            num_scheduled_tokens: (0..params.len())
                .map(|i| (ReqHandle(i as u32), PROMPT as u32))
                .collect(),
            ..SchedulerOutput::default()
        };
        let plan = batch.prepare(&so, &mut ModelInput::default()).unwrap();
        (batch, plan)
    }

    /// Flat-ish random logits, one row per request, the seeded row first.
    fn logits(rows: usize, seed: u64) -> Logits {
        let mut g = Xoshiro256StarStar::from_seed(seed);
        let data = (0..rows * VOCAB)
            .map(|_| (g.next_f64() * 4.0) as f32)
            .collect();
        Logits {
            num_seqs: rows,
            vocab_size: VOCAB,
            data,
        }
    }

    #[test]
    fn a_gpu_worker_falling_back_to_the_host_draws_eligible_rows_as_the_device() {
        // logprobs make the second row ineligible: the step runs on the host.
        let ineligible = SamplingParams {
            logprobs: Some(0),
            ..Default::default()
        };
        for seed in 0..8 {
            let mut l = logits(2, seed);
            let want = host_draw::draw_like_device(
                &l.data[..VOCAB],
                &DeviceRow::from_params(&seeded(), 42, PROMPT as u32, VOCAB),
            );
            let (mut batch, plan) = step(true, &[seeded(), ineligible.clone()]);
            let out = batch.sample(&plan, &mut l).unwrap();
            assert_eq!(&*out.sampled[0].1, [want], "logits seed {seed}");
            assert_eq!(
                out.logprobs[1].len(),
                1,
                "the ineligible row is the host sampler's"
            );
        }
    }

    #[test]
    fn a_cpu_worker_keeps_the_host_samplers_stream() {
        let mut l = logits(1, 5);
        let mut row = l.data.clone();
        let want = RequestSampler::new(&seeded(), &[1; PROMPT], None)
            .sample(&mut row, &seeded())
            .token;
        let (mut batch, plan) = step(false, &[seeded()]);
        assert_eq!(&*batch.sample(&plan, &mut l).unwrap().sampled[0].1, [want]);
    }
}
