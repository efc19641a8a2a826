//! The worker's lifecycle checks and its step on the real model.

use super::*;

fn config() -> WorkerConfig {
    WorkerConfig::for_unit_tests()
}

#[test]
fn rejects_zero_sizes() {
    let err = Worker::new(WorkerConfig {
        block_size: 0,
        ..config()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("block_size is 0"), "{err}");
    let err = Worker::new(WorkerConfig {
        max_model_len: Some(0),
        eos_token_id: None,
        ..config()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("max_model_len is 0"), "{err}");
}

#[test]
fn names_the_missing_lifecycle_step() {
    let mut w = Worker::new(config()).unwrap();
    let err = w.load_model().unwrap_err().to_string();
    assert!(err.contains("load_model needs init_device"), "{err}");
    let err = w.determine_available_memory().unwrap_err().to_string();
    assert!(err.contains("needs load_model"), "{err}");
    let err = w.initialize_from_config(4).unwrap_err().to_string();
    assert!(err.contains("needs load_model"), "{err}");
    let err = w.compile_or_warm_up_model().unwrap_err().to_string();
    assert!(err.contains("needs initialize_from_config"), "{err}");
    let err = w
        .execute_model_input(&ModelInput::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs load_model"), "{err}");
}

#[test]
fn the_cpu_worker_samples_on_the_host_even_when_every_row_is_device_eligible() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut w = Worker::new(WorkerConfig {
        model: crate::config::default_model_path(&root),
        ..config()
    })
    .unwrap();
    w.init_device().unwrap();
    w.load_model().unwrap();
    w.initialize_from_config(8).unwrap();
    let prompt = vec![1u32, 504, 3458, 282];
    let so = SchedulerOutput {
        scheduled_new_reqs: vec![crate::step::NewRequestData {
            handle: crate::step::ReqHandle(0),
            request_id: "r0".into(),
            prompt_token_ids: prompt.clone(),
            output_token_ids: Vec::new(),
            // Greedy, no logprobs: a row the device sampler could take.
            sampling_params: crate::sampling::SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            block_ids: vec![0],
            num_computed_tokens: 0,
        }],
        num_scheduled_tokens: vec![(crate::step::ReqHandle(0), prompt.len() as u32)],
        ..SchedulerOutput::default()
    };
    // The CPU runner does not sample on a device.
    let rows = [crate::model_runner::DeviceSampleRow {
        params: &crate::sampling::SamplingParams::default(),
        seed: 0,
        position: 4,
        logits_row: 0,
    }];
    let input = ModelInput::single(&prompt, 0, vec![0]);
    assert!(w
        .runner_mut("test")
        .unwrap()
        .execute_and_sample(&input, &rows)
        .is_none());
    w.execute_model(&so).unwrap();
    let Some(Pending::Host(_, logits)) = &w.pending else {
        panic!("the CPU worker left no logits for the host sampler");
    };
    let want = crate::sampling::select::argmax(&logits.data[..logits.vocab_size]) as u32;
    let out = w.sample_tokens().unwrap();
    assert_eq!(
        out.sampled,
        vec![(crate::step::ReqHandle(0), [want].into())]
    );
}

#[test]
fn a_missing_model_file_is_a_load_error_naming_it() {
    let mut w = Worker::new(config()).unwrap();
    w.init_device().unwrap();
    let err = w.load_model().unwrap_err().to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn prompt_logprobs_of_a_chunked_prefill_are_the_log_softmax_of_each_prefix() {
    use crate::step::{CachedRequestData, NewRequestData, ReqHandle};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut w = Worker::new(WorkerConfig {
        model: crate::config::default_model_path(&root),
        ..config()
    })
    .unwrap();
    w.init_device().unwrap();
    w.load_model().unwrap();
    w.initialize_from_config(8).unwrap();
    // "The quick brown fox jumps over", prefilled in chunks of 4 and 2.
    let prompt = vec![504u32, 2365, 6354, 16438, 27003, 690];
    let h = ReqHandle(0);
    let first = SchedulerOutput {
        step_id: 1,
        scheduled_new_reqs: vec![NewRequestData {
            handle: h,
            request_id: "r0".into(),
            prompt_token_ids: prompt.clone(),
            output_token_ids: Vec::new(),
            sampling_params: crate::sampling::SamplingParams {
                temperature: 0.0,
                prompt_logprobs: Some(3),
                ..Default::default()
            },
            block_ids: vec![0],
            num_computed_tokens: 0,
        }],
        num_scheduled_tokens: vec![(h, 4)],
        ..SchedulerOutput::default()
    };
    w.execute_model(&first).unwrap();
    let out1 = w.sample_tokens().unwrap();
    assert!(out1.sampled.is_empty(), "a partial prefill samples nothing");
    let mut cached = CachedRequestData::default();
    cached.push(h, false, 4, &[]);
    let second = SchedulerOutput {
        step_id: 2,
        scheduled_cached_reqs: cached,
        num_scheduled_tokens: vec![(h, 2)],
        ..SchedulerOutput::default()
    };
    w.execute_model(&second).unwrap();
    let out2 = w.sample_tokens().unwrap();
    assert_eq!(out2.sampled.len(), 1);
    let chunks: Vec<_> = out1
        .prompt_logprobs
        .iter()
        .chain(&out2.prompt_logprobs)
        .map(|(ch, p)| {
            assert_eq!(*ch, h);
            p
        })
        .collect();
    assert_eq!(
        chunks.iter().map(|p| p.start).collect::<Vec<_>>(),
        vec![1, 5]
    );
    let entries: Vec<_> = chunks.iter().flat_map(|p| &p.entries).collect();
    assert_eq!(entries.len(), prompt.len() - 1);
    for (i, e) in entries.iter().enumerate() {
        // Token i + 1 from the logits after tokens 0..=i, run alone in
        // other blocks.
        assert_eq!(e.token, prompt[i + 1]);
        let input = ModelInput::single(&prompt[..=i], 0, vec![4]);
        let logits = w.execute_model_input(&input).unwrap();
        let row = logits.row(0);
        let lse = crate::sampling::select::log_sum_exp(row);
        let want = row[e.token as usize] - lse;
        assert!(
            (e.logprob - want).abs() < 1e-3,
            "token {}: logprob {} vs {want}",
            i + 1,
            e.logprob
        );
        let rank = 1 + row.iter().filter(|&&l| l > row[e.token as usize]).count() as u32;
        assert_eq!(e.rank, rank, "token {}", i + 1);
        assert_eq!(e.top.len(), 3);
        let best = crate::sampling::select::argmax(row) as u32;
        assert_eq!(e.top[0].0, best);
        assert!((e.top[0].1 - (row[best as usize] - lse)).abs() < 1e-3);
    }
}

#[test]
fn the_cpu_kv_cache_defaults_to_what_the_configuration_can_fill() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let available = |max_num_seqs, max_model_len, bytes| {
        let mut w = Worker::new(WorkerConfig {
            model: crate::config::default_model_path(&root),
            kv_cache_memory_bytes: bytes,
            max_num_seqs,
            max_model_len,
            ..config()
        })
        .unwrap();
        w.init_device().unwrap();
        w.load_model().unwrap();
        let per_block = w.bytes_per_block().unwrap();
        (w.determine_available_memory().unwrap(), per_block)
    };
    // SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V in f32.
    let (small, per_block) = available(16, Some(260), None);
    assert_eq!(per_block, 16 * 30 * 2 * 3 * 64 * 4);
    // 16 sequences of 260 tokens: 17 blocks each.
    assert_eq!(small, 16 * 17 * per_block);
    // The model's own context (8192) at the default 256 sequences would
    // take gigabytes: the default budget caps it.
    let (default, _) = available(256, None, None);
    assert_eq!(default as u64, crate::config::DEFAULT_CPU_KV_CACHE_BYTES);
    // An explicit budget is taken as it is, even past what can be used.
    let (explicit, _) = available(1, Some(16), Some(1 << 30));
    assert_eq!(explicit, 1 << 30);
}
