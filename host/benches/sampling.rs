//! Sampler benchmarks on a SmolLM2-sized row (vocabulary 49152).
//!
//! - `sample/<mode>`: one `RequestSampler::sample` call (raw log-sum-exp,
//!   penalties, the draw) for greedy, plain temperature, top-k 50, top-p 0.9
//!   (on a peaked and on a flat row, the nucleus worst case), min-p 0.05,
//!   penalties over a 1024-token prompt, and 20 top logprobs;
//! - `sample_batch/32`: 32 rows of mixed parameters, the worker's call;
//! - `stop_checker/push`: one token's text delta against three stop strings.
//!
//! The logits are synthetic (Gaussian, sigma 2.5, plus a handful of strong
//! tokens, mimicking an LM's peaked head and long tail) so the benchmark does
//! not need the model file. Each iteration first copies the pristine row into
//! a reused buffer (as the worker reuses its logits buffer); that copy, a few
//! microseconds, is included in the times.
//!
//! Run: `cargo bench -p host --bench sampling`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use host::sampling::rng::Xoshiro256StarStar;
use host::sampling::{sample_batch, RequestSampler, SamplingParams, StopChecker};

const VOCAB: usize = 49152;

/// Gaussian logits (Box-Muller) with a few boosted tokens.
fn lm_like_logits(seed: u64) -> Vec<f32> {
    let mut g = Xoshiro256StarStar::from_seed(seed);
    let mut logits: Vec<f32> = (0..VOCAB)
        .map(|_| {
            let (u1, u2) = (1.0 - g.next_f64(), g.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 2.5) as f32
        })
        .collect();
    for i in 0..8 {
        logits[(g.next_u64() % VOCAB as u64) as usize] = 14.0 - i as f32;
    }
    logits
}

/// Nearly uniform logits: the largest possible top-p nucleus.
fn flat_logits(seed: u64) -> Vec<f32> {
    let mut g = Xoshiro256StarStar::from_seed(seed);
    (0..VOCAB).map(|_| g.next_f64() as f32 * 0.5).collect()
}

fn bench_sample(c: &mut Criterion) {
    let peaked = lm_like_logits(1);
    let flat = flat_logits(2);
    let prompt: Vec<u32> = (0..1024).map(|i| (i * 37 % VOCAB) as u32).collect();
    let seeded = |p: SamplingParams| SamplingParams { seed: Some(7), ..p };
    let d = SamplingParams::default();
    let cases: Vec<(&str, SamplingParams, &[f32], &[u32])> = vec![
        (
            "greedy",
            SamplingParams {
                temperature: 0.0,
                ..d.clone()
            },
            &peaked,
            &[],
        ),
        (
            "temperature_0.8",
            seeded(SamplingParams {
                temperature: 0.8,
                ..d.clone()
            }),
            &peaked,
            &[],
        ),
        (
            "top_k_50",
            seeded(SamplingParams {
                top_k: 50,
                ..d.clone()
            }),
            &peaked,
            &[],
        ),
        (
            "top_p_0.9",
            seeded(SamplingParams {
                top_p: 0.9,
                ..d.clone()
            }),
            &peaked,
            &[],
        ),
        (
            "top_p_0.9_flat",
            seeded(SamplingParams {
                top_p: 0.9,
                ..d.clone()
            }),
            &flat,
            &[],
        ),
        (
            "min_p_0.05",
            seeded(SamplingParams {
                min_p: 0.05,
                ..d.clone()
            }),
            &peaked,
            &[],
        ),
        (
            "penalties_prompt_1k",
            seeded(SamplingParams {
                repetition_penalty: 1.1,
                frequency_penalty: 0.5,
                presence_penalty: 0.5,
                ..d.clone()
            }),
            &peaked,
            &prompt,
        ),
        (
            "logprobs_20",
            seeded(SamplingParams {
                logprobs: Some(20),
                ..d.clone()
            }),
            &peaked,
            &[],
        ),
    ];
    let mut group = c.benchmark_group("sample");
    for (name, params, logits, prompt) in cases {
        let mut sampler = RequestSampler::new(&params, prompt, Some(0));
        let mut row = logits.to_vec();
        group.bench_function(name, |b| {
            b.iter(|| {
                row.copy_from_slice(logits);
                black_box(sampler.sample(&mut row, &params))
            })
        });
    }
    group.finish();
}

fn bench_batch(c: &mut Criterion) {
    const ROWS: usize = 32;
    let logits: Vec<f32> = (0..ROWS as u64).flat_map(lm_like_logits).collect();
    let params: Vec<SamplingParams> = (0..ROWS)
        .map(|i| SamplingParams {
            temperature: if i % 4 == 0 { 0.0 } else { 0.8 },
            top_p: if i % 2 == 0 { 0.95 } else { 1.0 },
            top_k: if i % 3 == 0 { 40 } else { 0 },
            seed: Some(i as u64),
            ..SamplingParams::default()
        })
        .collect();
    let mut samplers: Vec<RequestSampler> = params
        .iter()
        .map(|p| RequestSampler::new(p, &[], Some(0)))
        .collect();
    let mut batch = logits.clone();
    c.bench_function("sample_batch/32", |b| {
        b.iter(|| {
            batch.copy_from_slice(&logits);
            let mut rows: Vec<(&SamplingParams, &mut RequestSampler)> =
                params.iter().zip(samplers.iter_mut()).collect();
            black_box(sample_batch(&mut batch, VOCAB, &mut rows))
        })
    });
}

fn bench_stop(c: &mut Criterion) {
    let stops = vec![
        "<|im_end|>".to_string(),
        "\n\nUser:".to_string(),
        "###".to_string(),
    ];
    let deltas = [
        " the", " quick", " brown", " fox", "\n", " jumps", " #", " over",
    ];
    c.bench_function("stop_checker/push", |b| {
        let mut checker = StopChecker::new(stops.clone(), false, 0);
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % deltas.len();
            black_box(checker.push(deltas[i]))
        })
    });
}

criterion_group!(benches, bench_sample, bench_batch, bench_stop);
criterion_main!(benches);
