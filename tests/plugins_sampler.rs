//! Sampler plugins in the real engine on the real model. Each choice is
//! checked against an expectation computed outside the plugin: a sampler
//! that always takes the host's first candidate must decode greedily (in
//! this process and through a worker process); `engine:typical-p` with a
//! tiny mass must pick, at every step, the most typical of the top-20
//! candidates, recomputed here from the logprobs the engine reports; a
//! faulting sampler falls back to the host sampler (the same tokens as a
//! run without plugins, seeded) or fails only the requests in its call,
//! and the engine counts that call's fault.

use std::collections::BTreeMap;

use host::config::EngineConfig;
use host::engine::{Completion, GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;

use e2e::plugin;

const PROMPTS: [&str; 3] = [
    "The sky is",
    "Once upon a time, in a kingdom far away,",
    "My favourite food is",
];

fn engine_config(sampler: &str, options: &str) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.plugins.paths = vec![
        plugin("typical_p"),
        plugin("misbehave_sampler"),
        plugin("fcfs"),
    ];
    c.plugins.cache_dir = Some(std::env::temp_dir().join("host-plugin-tests-cache"));
    c.plugins.sampler = sampler.into();
    if !options.is_empty() {
        c.plugins
            .options
            .insert(sampler.into(), options.parse().unwrap());
    }
    c
}

fn params(temperature: f32, seed: u64, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn run(c: &EngineConfig, params: &[SamplingParams]) -> Vec<Result<Completion, String>> {
    run_counting(c, params).0
}

/// [`run`], and the engine's count of each plugin's faults after it.
fn run_counting(
    c: &EngineConfig,
    params: &[SamplingParams],
) -> (Vec<Result<Completion, String>>, BTreeMap<String, u64>) {
    let reqs: Vec<GenerateRequest> = PROMPTS
        .iter()
        .zip(params)
        .map(|(t, p)| GenerateRequest::new(Prompt::Text(t.to_string()), p.clone()))
        .collect();
    let mut llm = Llm::new(c).unwrap();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    (done, llm.stats().plugin_faults)
}

fn tokens(done: &[Result<Completion, String>]) -> Vec<Vec<u32>> {
    done.iter()
        .map(|r| r.as_ref().expect("request failed").token_ids.clone())
        .collect()
}

/// Sampled (temperature 0.8, seeded) and greedy requests.
fn mixed() -> Vec<SamplingParams> {
    vec![params(0.8, 1, 6), params(0.0, 2, 6), params(1.2, 3, 6)]
}

#[test]
fn a_sampler_taking_the_first_candidate_decodes_greedily_in_both_executors() {
    let greedy = tokens(&run(&engine_config("", ""), &vec![params(0.0, 0, 6); 3]));
    let sampled = tokens(&run(&engine_config("", ""), &mixed()));
    assert_ne!(
        sampled, greedy,
        "the sampled requests must differ from greedy without the plugin"
    );
    for backend in ["uni", "mp"] {
        let mut c = engine_config("test:misbehave-sampler", "mode = \"first\"");
        c.parallel.distributed_executor_backend = backend.into();
        let got = tokens(&run(&c, &mixed()));
        assert_eq!(got, greedy, "{backend}");
    }
}

/// Locally typical choice with a vanishing mass: the candidate whose
/// surprisal is closest to the entropy of the renormalised candidates.
fn most_typical(top: &[(u32, f32)]) -> u32 {
    let max = top.iter().map(|c| f64::from(c.1)).fold(f64::MIN, f64::max);
    let total: f64 = top.iter().map(|c| (f64::from(c.1) - max).exp()).sum();
    let p: Vec<f64> = top
        .iter()
        .map(|c| (f64::from(c.1) - max).exp() / total)
        .collect();
    let h: f64 = p.iter().map(|p| -p * p.ln()).sum();
    let best = (0..p.len())
        .min_by(|&a, &b| (-p[a].ln() - h).abs().total_cmp(&(-p[b].ln() - h).abs()))
        .unwrap();
    top[best].0
}

#[test]
fn typical_p_with_a_tiny_mass_picks_the_most_typical_candidate() {
    let c = engine_config("engine:typical-p", "mass = 1e-6");
    // Temperature 1 and no penalties: the candidates are exactly the raw
    // top-20 logprobs the engine reports (plugins.sampler_top_k = 20).
    let asked = SamplingParams {
        logprobs: Some(20),
        ..params(1.0, 5, 12)
    };
    let done = run(&c, &vec![asked; 3]);
    let mut off_top = 0;
    for r in &done {
        let r = r.as_ref().unwrap();
        assert_eq!(r.logprobs.len(), r.token_ids.len());
        for (token, lp) in r.token_ids.iter().zip(&r.logprobs) {
            assert_eq!(*token, most_typical(&lp.top), "top-20 {:?}", lp.top);
            off_top += usize::from(*token != lp.top[0].0);
        }
    }
    assert!(
        off_top > 0,
        "every choice was the most likely: not distinguished from greedy"
    );

    // With the default mass the choice is random but seeded: reproducible,
    // and always among the host's top-20 candidates.
    let c = engine_config("engine:typical-p", "");
    let asked = SamplingParams {
        logprobs: Some(20),
        ..params(1.0, 9, 12)
    };
    let a = run(&c, &vec![asked.clone(); 3]);
    let b = run(&c, &vec![asked; 3]);
    assert_eq!(tokens(&a), tokens(&b));
    for r in &a {
        let r = r.as_ref().unwrap();
        for (token, lp) in r.token_ids.iter().zip(&r.logprobs) {
            assert!(
                lp.top.iter().any(|c| c.0 == *token),
                "{token} not in {:?}",
                lp.top
            );
        }
    }
}

#[test]
fn an_invalid_answer_falls_back_to_the_host_sampler() {
    // The fallback draws with the same uniform the host would have, so the
    // seeded output equals a run without plugins.
    let plain = tokens(&run(&engine_config("", ""), &mixed()));
    for mode in ["out-of-range", "short", "panic"] {
        let c = engine_config("test:misbehave-sampler", &format!("mode = \"{mode}\""));
        assert_eq!(tokens(&run(&c, &mixed())), plain, "{mode}");
    }
}

#[test]
fn a_faulting_sampler_fails_only_the_requests_in_its_call_when_configured_to() {
    let mut c = engine_config("test:misbehave-sampler", "mode = \"out-of-range-if-asked\"");
    c.plugins.on_error = "fail".into();
    // One request per step, so only the one that asks is in a faulting call.
    c.scheduler.max_num_seqs = 1;
    let mut p = mixed();
    p[1].extra_args = Some(serde_json::json!({"fault": true}));
    let (done, faults) = run_counting(&c, &p);
    assert_eq!(done[0].as_ref().unwrap().token_ids.len(), 6, "{done:?}");
    let err = done[1].as_ref().unwrap_err();
    assert!(
        err.contains("plugin test:misbehave-sampler: choose failed")
            && err.contains("out of range"),
        "{err}"
    );
    assert_eq!(done[2].as_ref().unwrap().token_ids.len(), 6, "{done:?}");
    // That one call was the only fault, and the engine counted it (the
    // policy `auto` picked, the `engine:fcfs` plugin, is listed with none).
    let expected = [("engine:fcfs", 0), ("test:misbehave-sampler", 1)];
    assert_eq!(faults, expected.map(|(n, c)| (n.to_string(), c)).into());
}

/// Why `Llm::new` refused `c`.
fn refusal(c: &EngineConfig) -> String {
    match Llm::new(c) {
        Ok(_) => panic!("the configuration was accepted"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn the_sampler_is_resolved_by_name_and_kind() {
    let c = engine_config("acme:nope", "");
    let err = refusal(&c);
    assert!(
        err.contains("unknown sampler \"acme:nope\"")
            && err.contains("engine:typical-p")
            && err.contains("test:misbehave-sampler"),
        "{err}"
    );
    let c = engine_config("engine:fcfs", "");
    let err = refusal(&c);
    assert!(
        err.contains("plugins.sampler = \"engine:fcfs\"") && err.contains("not a sampler"),
        "{err}"
    );
    let mut c = engine_config("engine:typical-p", "");
    c.plugins.sampler_top_k = 0;
    let err = refusal(&c);
    assert!(err.contains("sampler_top_k = 0"), "{err}");
}
