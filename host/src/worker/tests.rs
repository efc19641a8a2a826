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
    assert_eq!(out.sampled, vec![(crate::step::ReqHandle(0), [want])]);
}

#[test]
fn a_missing_model_file_is_a_load_error_naming_it() {
    let mut w = Worker::new(config()).unwrap();
    w.init_device().unwrap();
    let err = w.load_model().unwrap_err().to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}
