//! The engine on the real model: continuous batching must not change what a
//! request generates (batched = one at a time, also under preemption), shared
//! prefixes must hit the KV cache, and ended requests must give back every
//! block. The expectations are properties, independent of the engine's output.

use host::config::{CacheDtype, EngineConfig};
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;

fn config(kv_blocks: u64, max_num_batched_tokens: usize, prefix_caching: bool) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    // Within what the cache holds (an explicit length past it is refused).
    c.model.max_model_len = 512.min(kv_blocks as usize * 16);
    c.scheduler.max_num_batched_tokens = max_num_batched_tokens;
    c.cache.enable_prefix_caching = prefix_caching;
    // One block of SmolLM2: 30 layers x K and V x 3 heads x 64 dims x 16 slots x 4 bytes.
    c.cache.kv_cache_memory_bytes = Some(kv_blocks * 30 * 2 * 3 * 64 * 16 * 4);
    c
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// `n` prompts of mixed lengths (4 to ~90 tokens).
fn prompts(n: usize) -> Vec<String> {
    let subjects = [
        "The history of Rome",
        "A recipe for bread",
        "How rain forms",
        "The rules of chess",
        "Why the sky is blue",
    ];
    (0..n)
        .map(|i| {
            let base = subjects[i % subjects.len()];
            let filler = " and then, after some thought, we continue".repeat(i % 9);
            format!("{base}{filler} is")
        })
        .collect()
}

fn run(llm: &mut Llm, texts: &[String], params: &SamplingParams) -> Vec<Vec<u32>> {
    e2e::generate_all(llm, texts, params)
        .into_iter()
        .map(|c| c.token_ids)
        .collect()
}

fn one_at_a_time(texts: &[String], params: &SamplingParams) -> Vec<Vec<u32>> {
    let mut llm = Llm::new(&config(512, 2048, false)).unwrap();
    texts
        .iter()
        .map(|t| run(&mut llm, std::slice::from_ref(t), params).remove(0))
        .collect()
}

#[test]
fn batched_greedy_equals_one_at_a_time() {
    let texts = prompts(16);
    let params = greedy(12);
    let expected = one_at_a_time(&texts, &params);
    // A small step budget mixes prefill chunks with other requests' decodes.
    let mut llm = Llm::new(&config(512, 96, true)).unwrap();
    let batched = run(&mut llm, &texts, &params);
    for (i, (b, e)) in batched.iter().zip(&expected).enumerate() {
        assert_eq!(b, e, "prompt {i} ({:?}) differs when batched", texts[i]);
    }
    llm.core().scheduler().check_invariants().unwrap();
    assert_eq!(
        llm.stats().scheduler.kv_cache_usage,
        0.0,
        "every block is free at the end"
    );
}

/// With a half-width KV cache (f16 or bf16) a block takes half the bytes,
/// so the same memory holds twice the blocks, and batching still changes
/// nothing: each K/V value is rounded once, from f32 bits that do not
/// depend on the batch.
#[test]
fn half_width_kv_caches_hold_twice_the_blocks_and_keep_batching_invisible() {
    let texts = prompts(8);
    let params = greedy(12);
    let blocks = |c: &EngineConfig| {
        Llm::new(c)
            .unwrap()
            .stats()
            .scheduler
            .cache_config
            .num_blocks
    };
    let f32_blocks = blocks(&config(64, 96, true));
    for dtype in [CacheDtype::Float16, CacheDtype::Bfloat16] {
        let with = |mut c: EngineConfig| {
            c.cache.cache_dtype = dtype;
            c
        };
        assert_eq!(
            blocks(&with(config(64, 96, true))),
            2 * f32_blocks,
            "{dtype:?}"
        );
        let mut alone = Llm::new(&with(config(512, 2048, false))).unwrap();
        let expected: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| run(&mut alone, std::slice::from_ref(t), &params).remove(0))
            .collect();
        let mut llm = Llm::new(&with(config(512, 96, true))).unwrap();
        let batched = run(&mut llm, &texts, &params);
        for (i, (b, e)) in batched.iter().zip(&expected).enumerate() {
            assert_eq!(
                b, e,
                "{dtype:?}: prompt {i} ({:?}) differs when batched",
                texts[i]
            );
        }
    }
}

/// Preemption by recompute must not change what a request generates, with
/// the worker in the engine's process and in a worker process alike.
#[test]
fn preemption_does_not_change_outputs() {
    let texts = prompts(10);
    let params = greedy(24);
    let expected = one_at_a_time(&texts, &params);
    for backend in ["uni", "mp"] {
        // 10 blocks of 16 tokens hold three ~50-token sequences at once, so
        // preemption comes however many of the ten end early on the stop
        // token (which the kernels' last bits decide).
        let mut c = config(10, 128, true);
        c.parallel.distributed_executor_backend = backend.into();
        let mut llm = Llm::new(&c).unwrap();
        let got = run(&mut llm, &texts, &params);
        assert!(
            llm.stats().scheduler.num_preemptions > 0,
            "the cache was meant to force preemption"
        );
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "prompt {i} differs after preemption ({backend})");
        }
        assert_eq!(llm.stats().scheduler.kv_cache_usage, 0.0);
    }
}

#[test]
fn shared_prefixes_hit_the_cache() {
    let shared = "You are a careful assistant. Answer briefly and precisely. ".repeat(6);
    let texts: Vec<String> = [
        "Name a color.",
        "Name a fruit.",
        "Name a river.",
        "Name a city.",
    ]
    .iter()
    .map(|q| format!("{shared}{q}"))
    .collect();
    let mut llm = Llm::new(&config(512, 2048, true)).unwrap();
    let shared_len = llm.encode(&Prompt::Text(shared.clone())).unwrap().len();
    let params = greedy(4);
    for t in &texts {
        run(&mut llm, std::slice::from_ref(t), &params);
    }
    let stats = llm.stats().scheduler.prefix_cache;
    // Every request after the first finds at least the shared prefix's full blocks.
    let min_hits = (texts.len() as u64 - 1) * (shared_len as u64 / 16 * 16);
    assert!(
        stats.hits >= min_hits,
        "{} cached tokens, expected at least {min_hits}",
        stats.hits
    );
    assert!(stats.hit_rate() > 0.5, "hit rate {}", stats.hit_rate());
}

#[test]
fn stop_strings_abort_and_free_every_block() {
    let texts = prompts(6);
    let params = SamplingParams {
        stop: vec![" ".into()],
        ..greedy(40)
    };
    let mut llm = Llm::new(&config(512, 2048, true)).unwrap();
    let requests: Vec<GenerateRequest> = texts
        .iter()
        .map(|t| GenerateRequest::new(Prompt::Text(t.clone()), params.clone()))
        .collect();
    let results = llm.generate(&requests, |_, _| {}, |_, _| {}).unwrap();
    for r in results {
        let c = r.unwrap();
        assert!(
            !c.text.contains(' '),
            "the stop string ends the text: {:?}",
            c.text
        );
        assert!(c.token_ids.len() < 40, "stopped early");
    }
    llm.core().scheduler().check_invariants().unwrap();
    assert_eq!(
        llm.stats().scheduler.kv_cache_usage,
        0.0,
        "aborted requests gave their blocks back"
    );
    assert_eq!(llm.stats().scheduler.num_running, 0);
}

/// Async scheduling (step N+1 scheduled while step N runs) must give the
/// same tokens as synchronous steps: seeded random sampling, stop tokens
/// (the step after a stop is already in flight) and preemption included,
/// in-process and with a worker process.
#[test]
fn async_scheduling_does_not_change_outputs() {
    let texts = prompts(10);
    let run_with = |async_scheduling: bool, backend: &str| {
        // 10 blocks of 16 tokens hold three ~50-token sequences at once, so
        // preemption comes however many of the ten end early on the stop
        // token (which the kernels' last bits decide).
        let mut c = config(10, 128, true);
        c.scheduler.async_scheduling = async_scheduling;
        c.parallel.distributed_executor_backend = backend.into();
        let mut llm = Llm::new(&c).unwrap();
        let stop_token_ids = llm.encode(&Prompt::Text(",".into())).unwrap();
        let params: Vec<SamplingParams> = (0..texts.len() as u64)
            .map(|i| SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: Some(i),
                max_tokens: 24,
                stop_token_ids: stop_token_ids.clone(),
                ..SamplingParams::default()
            })
            .collect();
        let requests: Vec<GenerateRequest> = texts
            .iter()
            .zip(&params)
            .map(|(t, p)| GenerateRequest::new(Prompt::Text(t.clone()), p.clone()))
            .collect();
        let got: Vec<(Vec<u32>, String)> = llm
            .generate(&requests, |_, _| {}, |_, _| {})
            .unwrap()
            .into_iter()
            .map(|r| {
                let c = r.unwrap();
                (c.token_ids, c.finish.finish_reason)
            })
            .collect();
        let stats = llm.stats().scheduler;
        assert!(
            stats.num_preemptions > 0,
            "the cache was meant to force preemption ({backend})"
        );
        assert_eq!(
            stats.kv_cache_usage, 0.0,
            "every block is free at the end ({backend})"
        );
        got
    };
    let expected = run_with(false, "uni");
    let stopped = expected
        .iter()
        .filter(|(_, reason)| reason == "stop")
        .count();
    assert!(
        stopped > 0 && stopped < texts.len(),
        "some requests, not all, should end on the stop token"
    );
    for backend in ["uni", "mp"] {
        let got = run_with(true, backend);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                g, e,
                "prompt {i} differs under async scheduling ({backend})"
            );
        }
    }
}
