//! Sleep mode and weight updates in the real engine on the real model,
//! with the worker in the engine's process (`uni`) and in a worker process
//! (`mp`): sleeping at level 1 or 2 and waking (all at once, or the weights
//! then the KV cache) gives back exactly the greedy tokens of before, with
//! the cached prefixes forgotten; negating `output_norm.weight` through
//! `update_weights` makes the first greedy token the argmin of the original
//! logits (computed by a separate worker), and restoring it restores the
//! output; bad calls are refused naming what is wrong, and change nothing.

use host::config::EngineConfig;
use host::engine::{startup, EngineCoreRequest, GenerateRequest, Llm, Prompt};
use host::model::{self, dequant, LoadFormat};
use host::model_runner::ModelInput;
use host::sampling::SamplingParams;

const PROMPT: &str = "The capital of France is";
/// Longer than two KV blocks (16 tokens each), so its full blocks can be
/// cached and hit by [`CONTINUED`].
const LONG: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                    The capital of Italy is Rome. The capital of Spain is";
const CONTINUED: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                         The capital of Italy is Rome. The capital of Spain is Madrid, and";

fn engine_config(backend: &str) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.parallel.distributed_executor_backend = backend.into();
    c
}

fn greedy(prompt: &str) -> GenerateRequest {
    GenerateRequest::new(
        Prompt::Text(prompt.into()),
        SamplingParams {
            temperature: 0.0,
            max_tokens: 8,
            ignore_eos: true,
            ..SamplingParams::default()
        },
    )
}

/// Greedy token ids and cached-prompt-token counts of two prompts that
/// share a prefix, run one after the other (so the second can hit the
/// prefix cache).
fn run(llm: &mut Llm) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut tokens = Vec::new();
    let mut cached = Vec::new();
    for prompt in [LONG, CONTINUED] {
        let done = llm
            .generate(&[greedy(prompt)], |_, _| {}, |_, _| {})
            .unwrap();
        let c = done.into_iter().next().unwrap().unwrap();
        tokens.push(c.token_ids);
        cached.push(c.num_cached_tokens);
    }
    (tokens, cached)
}

#[test]
fn sleeping_and_waking_keep_the_outputs_and_forget_the_cached_prefixes() {
    for backend in ["uni", "mp"] {
        let mut llm = Llm::new(&engine_config(backend)).unwrap();
        let (want, cached) = run(&mut llm);
        assert!(
            cached[1] > 0,
            "the shared prefix hits the cache before sleeping ({backend})"
        );
        // Level 1, woken in two steps: weights, then the KV cache.
        llm.sleep(1).unwrap();
        assert!(llm.is_sleeping());
        let e = llm
            .generate(&[greedy(PROMPT)], |_, _| {}, |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("wake_up"), "{e}");
        llm.wake_up(Some(&["weights".to_string()])).unwrap();
        assert!(llm.is_sleeping(), "the KV cache still sleeps ({backend})");
        llm.wake_up(Some(&["kv_cache".to_string()])).unwrap();
        assert!(!llm.is_sleeping());
        let (got, cached) = run(&mut llm);
        assert_eq!(got, want, "after level 1 ({backend})");
        assert_eq!(
            cached[0], 0,
            "the KV cache woke empty: no prefix may hit ({backend})"
        );
        assert!(
            cached[1] > 0,
            "the prefix cache works again after waking ({backend})"
        );
        // Level 2, woken at once.
        llm.sleep(2).unwrap();
        llm.wake_up(None).unwrap();
        assert!(!llm.is_sleeping());
        let (got, cached) = run(&mut llm);
        assert_eq!(got, want, "after level 2 ({backend})");
        assert_eq!(cached[0], 0, "after level 2 ({backend})");
    }
}

/// The logits of [`LONG`]'s last token, from a worker of its own.
fn original_logits(config: &EngineConfig) -> (Vec<f32>, u32) {
    let mut started = startup::start(config).unwrap();
    let ids = started.tokenizer.encode(LONG, true).unwrap();
    let blocks = (0..ids.len().div_ceil(config.cache.block_size) as u32).collect();
    let logits = started
        .worker
        .execute_model_input(&ModelInput::single(&ids, 0, blocks))
        .unwrap();
    let row = logits.row(0).to_vec();
    let argmin = (0..row.len())
        .min_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap() as u32;
    (row, argmin)
}

#[test]
fn update_weights_in_the_rlhf_order_changes_exactly_what_it_should() {
    let config = engine_config("uni");
    let (_, argmin) = original_logits(&config);
    let weights = model::load(&config.model.path, LoadFormat::Auto).unwrap();
    let norm = dequant::dequantize(&weights.final_norm);
    let negated: Vec<f32> = norm.iter().map(|v| -v).collect();
    let name = weights.final_norm.name.clone();
    for backend in ["uni", "mp"] {
        let mut llm = Llm::new(&engine_config(backend)).unwrap();
        let (want, _) = run(&mut llm);
        // RLHF's order: sleep, wake the weights, update, wake the cache.
        llm.sleep(2).unwrap();
        let e = llm.update_weights(&[(&name, &negated)]).unwrap_err();
        assert!(e.contains("wake_up"), "updating sleeping weights: {e}");
        llm.wake_up(Some(&["weights".to_string()])).unwrap();
        llm.update_weights(&[(&name, &negated)]).unwrap();
        llm.wake_up(Some(&["kv_cache".to_string()])).unwrap();
        // h·(−w) = −(h·w): every logit changes sign, so greedy picks the
        // original argmin.
        let (got, _) = run(&mut llm);
        assert_eq!(
            got[0][0], argmin,
            "first token after negating {name} ({backend})"
        );
        llm.update_weights(&[(&name, &norm)]).unwrap();
        let (got, _) = run(&mut llm);
        assert_eq!(
            got, want,
            "restoring {name} restores the output ({backend})"
        );
        // Awake, through collective_rpc as the HTTP endpoint sends it: the
        // prefixes cached with the old weights are forgotten all the same.
        llm.collective_rpc(
            "update_weights",
            Some(serde_json::json!({ &name: negated })),
        )
        .unwrap();
        let (got, cached) = run(&mut llm);
        assert_eq!(
            got[0][0], argmin,
            "negated through collective_rpc ({backend})"
        );
        assert_eq!(
            cached[0], 0,
            "a prefix cached with the old weights was reused ({backend})"
        );
        llm.collective_rpc("update_weights", Some(serde_json::json!({ &name: norm })))
            .unwrap();
        assert_eq!(
            run(&mut llm).0,
            want,
            "restored through collective_rpc ({backend})"
        );
    }
}

#[test]
fn bad_calls_are_refused_naming_what_is_wrong_and_change_nothing() {
    let mut llm = Llm::new(&engine_config("mp")).unwrap();
    let (want, _) = run(&mut llm);
    let e = llm.sleep(3).unwrap_err();
    assert!(e.contains("level 3") && e.contains("use 1"), "{e}");
    assert!(!llm.is_sleeping(), "a refused sleep sleeps nothing");
    let e = llm
        .update_weights(&[("no.such.weight", &[1.0])])
        .unwrap_err();
    assert!(
        e.contains("no weight named \"no.such.weight\"") && e.contains("output_norm.weight"),
        "{e}"
    );
    let e = llm
        .update_weights(&[("output_norm.weight", &[1.0, 2.0])])
        .unwrap_err();
    assert!(
        e.contains("576 values") && e.contains("2 were given"),
        "{e}"
    );
    // One good update and one bad one: the good one must not land either.
    let zeros = vec![0.0f32; 576];
    let e = llm
        .update_weights(&[
            ("output_norm.weight", &zeros),
            ("blk.0.attn_norm.weight", &[1.0; 3]),
        ])
        .unwrap_err();
    assert!(e.contains("blk.0.attn_norm.weight has 576 values"), "{e}");
    let e = llm
        .update_weights(&[("output_norm.weight", &[f32::NAN; 576])])
        .unwrap_err();
    assert!(e.contains("finite"), "{e}");
    llm.sleep(1).unwrap();
    let e = llm.wake_up(Some(&["kv".to_string()])).unwrap_err();
    assert!(e.contains("`kv`") && e.contains("weights, kv_cache"), "{e}");
    let e = llm.wake_up(Some(&["kv_cache".to_string()])).unwrap_err();
    assert!(e.contains("wake `weights` first"), "{e}");
    let e = llm.sleep(1).unwrap_err();
    assert!(e.contains("already sleeps"), "{e}");
    llm.wake_up(None).unwrap();
    assert_eq!(run(&mut llm).0, want, "nothing changed");
}

#[test]
fn sleep_waits_for_no_one_it_refuses_while_requests_are_unfinished() {
    let (mut core, tokenizer) = startup::build_engine_core(&engine_config("uni")).unwrap();
    let request = EngineCoreRequest {
        request_id: "r0".into(),
        prompt_token_ids: tokenizer.encode(PROMPT, true).unwrap(),
        sampling_params: greedy(PROMPT).params,
        priority: 0,
        output_token_ids: Vec::new(),
        prediction: Vec::new(),
        cache_salt: None,
    };
    core.add_request(request).unwrap();
    // One step: the request is in the worker's batch (and, under async
    // scheduling, its step still in flight).
    core.step().unwrap();
    let e = core.sleep(1).unwrap_err();
    assert!(e.contains("1 requests are unfinished"), "{e}");
    core.abort_requests(&["r0".to_string()]);
    // The aborted request stays in the worker's batch until a step tells
    // the worker; sleep collects the step in flight and sends that one.
    core.sleep(1).unwrap();
    assert!(core.is_sleeping() && !core.has_work());
    core.wake_up(None).unwrap();
    assert!(!core.is_sleeping());
}
