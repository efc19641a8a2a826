//! WebAssembly plugins in the real engine on the real model: a policy plugin
//! changes the admission order (observed through time to first token with
//! one request running at a time), a logits processor changes exactly the
//! requests whose `extra_args` ask for it (checked against the model's own
//! ranking from a run without plugins), and a faulting plugin does not stop
//! the engine.

use host::config::EngineConfig;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;

use e2e::plugin;

fn engine_config(paths: &[&str]) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.plugins.paths = paths.iter().map(|p| plugin(p)).collect();
    c.plugins.cache_dir = Some(std::env::temp_dir().join("host-plugin-tests-cache"));
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

fn request(text: &str, params: SamplingParams) -> GenerateRequest {
    GenerateRequest::new(Prompt::Text(text.to_string()), params)
}

/// The model's own five most likely first tokens after `prompt`, most
/// likely first, from a run without plugins.
fn first_token_ranking(prompt: &str) -> Vec<u32> {
    let mut llm = Llm::new(&engine_config(&[])).unwrap();
    let ranked = SamplingParams {
        logprobs: Some(5),
        ..greedy(1)
    };
    let base = llm
        .generate(&[request(prompt, ranked)], |_, _| {}, |_, _| {})
        .unwrap();
    let base = base[0].as_ref().unwrap();
    let top: Vec<u32> = base.logprobs[0].top.iter().map(|&(t, _)| t).collect();
    assert_eq!(base.token_ids[0], top[0]);
    top
}

/// Request indices in the order their first token came out, with the
/// requests' `priorities`, and the order of ascending prompt length.
fn admission_order(policy: &str, priorities: [i32; 5]) -> (Vec<usize>, Vec<usize>) {
    let mut c = engine_config(&["shortest_prompt_first", "fcfs", "priority"]);
    c.scheduler.policy = policy.into();
    c.scheduler.max_num_seqs = 1;
    let mut llm = Llm::new(&c).unwrap();
    let texts = [
        "Once upon a time, in a kingdom far away, there lived a wise old king who",
        "The sky is",
        "In the beginning of the story, the hero",
        "Water boils at",
        "My favourite food is pasta because",
    ];
    let lens: Vec<usize> = texts
        .iter()
        .map(|t| llm.encode(&Prompt::Text(t.to_string())).unwrap().len())
        .collect();
    let reqs: Vec<GenerateRequest> = texts
        .iter()
        .zip(priorities)
        .map(|(t, priority)| GenerateRequest {
            priority,
            ..request(t, greedy(2))
        })
        .collect();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    let ttft: Vec<f64> = done
        .iter()
        .map(|r| r.as_ref().unwrap().metrics.time_to_first_token_s.unwrap())
        .collect();
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by(|&a, &b| ttft[a].total_cmp(&ttft[b]));
    let mut by_len: Vec<usize> = (0..texts.len()).collect();
    by_len.sort_by_key(|&i| lens[i]);
    (order, by_len)
}

#[test]
fn shortest_prompt_first_admits_short_prompts_first() {
    let (order, by_len) = admission_order("engine:shortest-prompt-first", [0; 5]);
    assert_eq!(order, by_len, "admitted in ascending prompt length");
    // The same queue under FCFS, built in and as a plugin: submission order.
    for fcfs in ["builtin:fcfs", "engine:fcfs"] {
        let (order, by_len) = admission_order(fcfs, [0; 5]);
        assert_eq!(order, [0, 1, 2, 3, 4], "{fcfs}");
        assert_ne!(
            order, by_len,
            "the prompts were chosen so the two orders differ"
        );
    }
}

#[test]
fn the_priority_plugin_admits_the_most_important_first() {
    // Lower value = more important (vLLM); ties keep submission order.
    let priorities = [3, 1, 2, 0, 1];
    let mut expected: Vec<usize> = (0..5).collect();
    expected.sort_by_key(|&i| priorities[i]);
    assert_eq!(expected, [3, 1, 4, 2, 0]);
    for policy in ["engine:priority", "builtin:priority"] {
        let (order, _) = admission_order(policy, priorities);
        assert_eq!(order, expected, "{policy}");
    }
    let (fcfs, _) = admission_order("engine:fcfs", priorities);
    assert_eq!(fcfs, [0, 1, 2, 3, 4], "FCFS ignores priorities");
}

#[test]
fn logit_bias_changes_only_the_requests_that_ask() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);

    let mut c = engine_config(&["logit_bias"]);
    c.plugins.logits_processors = vec!["engine:logit-bias".into()];
    let mut llm = Llm::new(&c).unwrap();
    let with = |args: serde_json::Value| SamplingParams {
        extra_args: Some(args),
        ..greedy(1)
    };
    let reqs = [
        request(prompt, greedy(1)),
        request(
            prompt,
            with(serde_json::json!({"banned_token_ids": [top[0]]})),
        ),
        request(
            prompt,
            with(serde_json::json!({"logit_bias": {top[4].to_string(): 100.0}})),
        ),
        request(
            prompt,
            with(serde_json::json!({"banned_token_ids": [top[0], top[1]]})),
        ),
    ];
    let out: Vec<u32> = llm
        .generate(&reqs, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().token_ids[0])
        .collect();
    assert_eq!(out, [top[0], top[1], top[4], top[2]], "ranking {top:?}");
}

#[test]
fn an_allow_mask_limits_greedy_output_to_its_tokens() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);

    // A 0.3 processor answering with packed allow-masks (test:allow-mask).
    let mut c = engine_config(&["allow_mask"]);
    c.plugins.logits_processors = vec!["test:allow-mask".into()];
    c.plugins.on_error = "fail".into();
    let mut llm = Llm::new(&c).unwrap();
    let with = |args: serde_json::Value, n| SamplingParams {
        extra_args: Some(args),
        ..greedy(n)
    };
    let allowed = [top[3], top[4]];
    let texts = [" the", ".", ","];
    let reqs = [
        request(prompt, greedy(1)),
        request(prompt, with(serde_json::json!({"allow_ids": allowed}), 8)),
        // By text: only possible with the vocabulary set-vocabulary gave.
        request(prompt, with(serde_json::json!({"allow_texts": texts}), 8)),
    ];
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    let out: Vec<_> = done.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(out[0].token_ids, [top[0]], "a request without a mask");
    assert_eq!(out[1].token_ids.len(), 8);
    assert_eq!(out[1].token_ids[0], top[3], "greedy among the allowed");
    assert!(
        out[1].token_ids.iter().all(|t| allowed.contains(t)),
        "{:?} not within {allowed:?}",
        out[1].token_ids
    );
    // Every token of the third is one of the texts, so the text is made of
    // them.
    let mut rest = out[2].text.as_str();
    while !rest.is_empty() {
        let t = texts
            .iter()
            .find(|t| rest.starts_with(*t))
            .unwrap_or_else(|| panic!("{:?} has text outside {texts:?}", out[2].text));
        rest = &rest[t.len()..];
    }
    assert_eq!(out[2].token_ids.len(), 8);

    // A mask that allows nothing faults the plugin, naming it; the request
    // fails and the engine serves the next.
    let none = request(prompt, with(serde_json::json!({"allow_none": true}), 2));
    let done = llm.generate(&[none], |_, _| {}, |_, _| {}).unwrap();
    let err = done[0].as_ref().unwrap_err();
    assert!(
        err.contains("plugin test:allow-mask: process failed") && err.contains("allows no token"),
        "{err}"
    );
    let later = llm
        .generate(&[request(prompt, greedy(2))], |_, _| {}, |_, _| {})
        .unwrap();
    assert_eq!(later[0].as_ref().unwrap().token_ids.len(), 2);
}

#[test]
fn a_faulting_policy_falls_back_and_the_engine_keeps_serving() {
    let mut c = engine_config(&["misbehave"]);
    c.scheduler.policy = "test:misbehave".into();
    c.plugins
        .options
        .insert("test:misbehave".into(), "mode = \"panic\"".parse().unwrap());
    let mut llm = Llm::new(&c).unwrap();
    let reqs: Vec<GenerateRequest> = ["The sky is", "Water boils at"]
        .iter()
        .map(|t| request(t, greedy(3)))
        .collect();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    assert!(
        done.iter()
            .all(|r| r.as_ref().is_ok_and(|c| c.token_ids.len() == 3)),
        "{done:?}"
    );
}

#[test]
fn a_faulting_processor_fails_only_its_requests_when_configured_to() {
    let mut c = engine_config(&["misbehave_processor"]);
    c.plugins.logits_processors = vec!["test:misbehave-processor".into()];
    c.plugins.options.insert(
        "test:misbehave-processor".into(),
        "mode = \"nan\"".parse().unwrap(),
    );
    let reqs = [request("The sky is", greedy(2))];
    let mut llm = Llm::new(&c).unwrap();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    assert_eq!(
        done[0].as_ref().unwrap().token_ids.len(),
        2,
        "fallback: sampled without the edits"
    );
    drop(llm);

    // Under "fail" the requests whose rows were in the faulting call fail,
    // naming the plugin; the engine serves the others and later ones. One
    // request per step, so only the one that asks is in a faulting call.
    c.plugins.on_error = "fail".into();
    c.scheduler.max_num_seqs = 1;
    c.plugins.options.insert(
        "test:misbehave-processor".into(),
        "mode = \"error-if-asked\"".parse().unwrap(),
    );
    let faulty = SamplingParams {
        extra_args: Some(serde_json::json!({"fault": true})),
        ..greedy(2)
    };
    let reqs = [
        request("The sky is", greedy(2)),
        request("Water boils at", faulty),
        request("My favourite food is", greedy(2)),
    ];
    let mut llm = Llm::new(&c).unwrap();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    assert_eq!(done[0].as_ref().unwrap().token_ids.len(), 2, "{done:?}");
    let err = done[1].as_ref().unwrap_err();
    assert!(
        err.contains("plugin test:misbehave-processor: process failed")
            && err.contains("a request asked for a fault"),
        "{err}"
    );
    assert_eq!(done[2].as_ref().unwrap().token_ids.len(), 2, "{done:?}");
    let later = llm
        .generate(&[request("The sky is", greedy(3))], |_, _| {}, |_, _| {})
        .unwrap();
    assert_eq!(later[0].as_ref().unwrap().token_ids.len(), 3);
    let stats = llm.stats().scheduler;
    assert_eq!(
        (stats.num_running, stats.num_waiting, stats.kv_cache_usage),
        (0, 0, 0.0),
        "the failed request's blocks are freed"
    );
}

#[test]
fn a_faulting_policy_stops_the_engine_when_configured_to_fail() {
    let mut c = engine_config(&["misbehave"]);
    c.scheduler.policy = "test:misbehave".into();
    c.plugins.on_error = "fail".into();
    c.plugins
        .options
        .insert("test:misbehave".into(), "mode = \"panic\"".parse().unwrap());
    let mut llm = Llm::new(&c).unwrap();
    let reqs = [request("The sky is", greedy(3))];
    let err = format!(
        "{:#}",
        llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap_err()
    );
    assert!(
        err.contains("plugin test:misbehave: order-waiting failed")
            && err.contains("plugins.on_error = \"fail\""),
        "{err}"
    );
}

/// `extra_args` that `test:claims` (a 0.4 processor) claims, with `spec`
/// as its `claims` object.
fn claimed(spec: serde_json::Value, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        extra_args: Some(serde_json::json!({ "claims": spec })),
        ..greedy(max_tokens)
    }
}

/// Each request's tokens, or its error.
fn run(llm: &mut Llm, reqs: &[GenerateRequest]) -> Vec<Result<Vec<u32>, String>> {
    llm.generate(reqs, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|r| r.map(|c| c.token_ids))
        .collect()
}

#[test]
fn a_claiming_processor_constrains_only_its_requests_beside_an_older_one() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);
    let allowed = [top[3], top[4]];
    let reqs = [
        request(prompt, greedy(8)),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed}), 8),
        ),
        // The 0.3 processor's own key: it is given every request.
        request(
            prompt,
            SamplingParams {
                extra_args: Some(serde_json::json!({"allow_ids": allowed})),
                ..greedy(8)
            },
        ),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed, "fail_at": 2}), 8),
        ),
        request(
            prompt,
            claimed(serde_json::json!({"refuse": "no thanks"}), 8),
        ),
    ];
    let mut llm = Llm::new(&engine_config(&[])).unwrap();
    let base = run(&mut llm, &reqs[..1]);
    drop(llm);

    let mut c = engine_config(&["claims", "allow_mask"]);
    c.plugins.logits_processors = vec!["test:claims".into(), "test:allow-mask".into()];
    c.plugins.on_error = "fail".into();
    let mut llm = Llm::new(&c).unwrap();
    let out = run(&mut llm, &reqs);
    assert_eq!(out[0], base[0], "an unclaimed request is left alone");
    for (i, what) in [
        (1, "claimed by test:claims"),
        (2, "masked by test:allow-mask"),
    ] {
        let tokens = out[i].as_ref().unwrap();
        assert_eq!(tokens.len(), 8, "{what}");
        assert_eq!(tokens[0], top[3], "{what}: greedy among {allowed:?}");
        assert!(
            tokens.iter().all(|t| allowed.contains(t)),
            "{what}: {tokens:?}"
        );
    }
    assert_eq!(
        out[3].as_ref().unwrap_err(),
        "test:claims: failing at token 2 as asked"
    );
    assert_eq!(out[4].as_ref().unwrap_err(), "test:claims: no thanks");
}

#[test]
fn a_claiming_processors_fault_fails_only_the_rows_of_its_call() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);
    let allowed = [top[3], top[4]];
    // Two at a time, admitted in order: `trap` fails at its third step and
    // `late` takes its place; `check` comes when `free` finishes, with
    // `late` half done, and traps in check-request, so the recreated
    // instance must be told `late` again with its output so far (the
    // fixture fails the row if what it is told is not that output).
    let reqs = [
        request(prompt, greedy(12)),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed, "trap_at": 2}), 6),
        ),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed}), 16),
        ),
        request(
            prompt,
            claimed(serde_json::json!({"trap_in_check": true}), 4),
        ),
    ];
    let mut c = engine_config(&["claims"]);
    c.scheduler.max_num_seqs = 2;
    let mut llm = Llm::new(&c).unwrap();
    let base = run(&mut llm, &reqs[..1]);
    drop(llm);

    c.plugins.logits_processors = vec!["test:claims".into()];
    // A 0.4 processor's fault fails its rows under "fallback" too.
    c.plugins.on_error = "fallback".into();
    let mut llm = Llm::new(&c).unwrap();
    let out = run(&mut llm, &reqs);
    assert_eq!(out[0], base[0], "an unclaimed request in the same steps");
    let trapped = out[1].as_ref().unwrap_err();
    assert!(
        trapped.contains("plugin test:claims: process failed")
            && trapped.contains("trapping in process at token 2"),
        "{trapped}"
    );
    let late = out[2].as_ref().unwrap();
    assert_eq!(late.len(), 16, "continued on the recreated instance");
    assert_eq!(late[0], top[3]);
    assert!(late.iter().all(|t| allowed.contains(t)), "{late:?}");
    let refused = out[3].as_ref().unwrap_err();
    assert!(
        refused.contains("plugin test:claims: check-request failed")
            && refused.contains("trapping in check-request"),
        "{refused}"
    );
    assert_eq!(llm.stats().scheduler.num_running, 0);
}

/// Starting a claimed request (compiling its constraint, say) is work per
/// request, not per step: the host announces it in a call of its own under
/// the per-request budget (`init_deadline_ms`), so a start far over the
/// step's 20 ms serves its request, and a start that never ends fails that
/// request alone while the one beside it keeps its constraint.
#[test]
fn a_claimed_requests_start_has_the_per_request_budget() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);
    let allowed = [top[3], top[4]];
    // 100 million dependent multiplications: over 100 ms on any CPU, well
    // within the 2 s a start is given here.
    let slow = serde_json::json!({"allow_ids": allowed, "start_spins": 100_000_000u64});
    let endless = serde_json::json!({"allow_ids": allowed, "start_spins": u64::MAX});
    let reqs = [
        request(prompt, claimed(slow, 8)),
        request(prompt, claimed(endless, 8)),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed}), 8),
        ),
    ];
    let mut c = engine_config(&["claims"]);
    c.plugins.logits_processors = vec!["test:claims".into()];
    assert_eq!(c.plugins.deadline_ms, 20, "the default step budget");
    c.plugins.init_deadline_ms = 2000;
    let mut llm = Llm::new(&c).unwrap();
    let out = run(&mut llm, &reqs);
    for i in [0, 2] {
        let tokens = out[i].as_ref().unwrap();
        assert_eq!(tokens.len(), 8, "request {i}");
        assert_eq!(tokens[0], top[3], "request {i}: greedy among {allowed:?}");
        assert!(tokens.iter().all(|t| allowed.contains(t)), "{tokens:?}");
    }
    let hung = out[1].as_ref().unwrap_err();
    assert!(
        hung.contains("plugin test:claims: process failed: exceeded its deadline of 2000 ms"),
        "{hung}"
    );
    assert_eq!(llm.stats().scheduler.num_running, 0);
}

/// Two claimed requests in the same calls: when one makes the processor
/// trap, the recreated instance is asked for each row alone, so only the
/// row that traps again fails and the other keeps its constraint.
#[test]
fn a_fault_fails_only_the_claimed_row_that_faults_again() {
    let prompt = "The capital of France is";
    let top = first_token_ranking(prompt);
    let allowed = [top[3], top[4]];
    let reqs = [
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed, "trap_at": 2}), 6),
        ),
        request(
            prompt,
            claimed(serde_json::json!({"allow_ids": allowed}), 8),
        ),
    ];
    let mut c = engine_config(&["claims"]);
    c.scheduler.max_num_seqs = 2;
    c.plugins.logits_processors = vec!["test:claims".into()];
    let mut llm = Llm::new(&c).unwrap();
    let out = run(&mut llm, &reqs);
    let trapped = out[0].as_ref().unwrap_err();
    assert!(
        trapped.contains("trapping in process at token 2"),
        "{trapped}"
    );
    let beside = out[1].as_ref().unwrap();
    assert_eq!(beside.len(), 8, "the request beside it runs to its end");
    assert!(beside.iter().all(|t| allowed.contains(t)), "{beside:?}");
    assert_eq!(llm.stats().scheduler.num_running, 0);
}

#[test]
fn the_request_checker_asks_the_claiming_processors() {
    use host::plugins::{host_from_config, RequestChecker, Vocabulary};
    let mut c = engine_config(&["claims", "allow_mask"]);
    let host = host_from_config(&c.plugins).unwrap();
    let tokenizer = host::engine::startup::load_tokenizer(&c).unwrap();
    let vocabulary = Vocabulary::from_tokens(tokenizer.tokens(), tokenizer.eos_token_id());
    c.plugins.logits_processors = vec!["test:allow-mask".into(), "test:claims".into()];
    let checker = RequestChecker::new(&host, &c.plugins.logits_processors, "", &vocabulary)
        .unwrap()
        .expect("test:claims checks requests");
    // The server shares it between its threads.
    fn shareable<T: Send + Sync>(_: &T) {}
    shareable(&checker);
    let check = |args: serde_json::Value| checker.check(Some(&args));
    assert_eq!(checker.check(None), Ok(()));
    assert_eq!(check(serde_json::json!({"allow_ids": [1]})), Ok(()));
    assert_eq!(
        check(serde_json::json!({"claims": {"allow_ids": [1, 2]}})),
        Ok(())
    );
    assert_eq!(
        check(serde_json::json!({"claims": {"allow_ids": "a"}})),
        Err("test:claims: claims.allow_ids must be a list of token ids".into())
    );
    assert_eq!(
        check(serde_json::json!({"claims": {"refuse": "no thanks"}})),
        Err("test:claims: no thanks".into())
    );
    let trapped = check(serde_json::json!({"claims": {"trap_in_check": true}})).unwrap_err();
    assert!(
        trapped.contains("plugin test:claims: check-request failed"),
        "{trapped}"
    );
    assert_eq!(
        check(serde_json::json!({"claims": {"allow_ids": [3]}})),
        Ok(()),
        "the recreated instance answers"
    );
    // Only a 0.3 processor: nothing to check.
    let old = RequestChecker::new(&host, &["test:allow-mask".into()], "", &vocabulary).unwrap();
    assert!(old.is_none());
}

/// The structured-output backend claims only requests carrying
/// `structured_outputs`, so it is given the vocabulary (llguidance's token
/// trie, its largest state) only when the first of them comes: an instance
/// told at once holds that memory from the start, one marked with
/// `claim_only_with` holds it only after such a request, and answers it the
/// same.
#[test]
fn the_structured_output_backend_learns_the_vocabulary_when_first_asked() {
    use host::plugins::{host_from_config, Vocabulary};
    use host::sampling::STRUCTURED_OUTPUTS_KEY;
    use serde_json::json;
    const BACKEND: &str = "engine:structured-output";
    let mut c = engine_config(&["structured_output"]);
    c.plugins.logits_processors = vec![BACKEND.into()];
    let host = host_from_config(&c.plugins).unwrap();
    let tokenizer = host::engine::startup::load_tokenizer(&c).unwrap();
    let vocabulary = Vocabulary::from_tokens(tokenizer.tokens(), tokenizer.eos_token_id());
    let processors = || {
        host.logits_processors(&c.plugins.logits_processors)
            .unwrap()
            .unwrap()
    };
    let memory = |p: &host::plugins::LogitsProcessors| p.memory_used()[0].1;

    let mut eager = processors();
    eager.set_vocabulary(&vocabulary).unwrap();
    let mut lazy = processors();
    lazy.claim_only_with(BACKEND, STRUCTURED_OUTPUTS_KEY);
    lazy.set_vocabulary(&vocabulary).unwrap();
    let idle = memory(&lazy);
    assert!(
        memory(&eager) >= idle + (4 << 20),
        "told the vocabulary, the instance holds {} bytes; untold, {idle}",
        memory(&eager)
    );
    // Requests that do not ask for structured output are not its business.
    lazy.check(None).unwrap();
    lazy.check(Some(&json!({"temperature": 0}))).unwrap();
    lazy.check(Some(&json!({STRUCTURED_OUTPUTS_KEY: null})))
        .unwrap();
    assert_eq!(memory(&lazy), idle);

    let schema = json!({STRUCTURED_OUTPUTS_KEY: {"json": {"type": "object"}}});
    let bad = json!({STRUCTURED_OUTPUTS_KEY: {"regex": "(unclosed"}});
    for p in [&mut eager, &mut lazy] {
        assert_eq!(p.check(Some(&schema)), Ok(()));
        let err = p.check(Some(&bad)).unwrap_err();
        assert!(err.starts_with(BACKEND), "{err}");
    }
    assert!(
        memory(&lazy) >= idle + (4 << 20),
        "told at the first request"
    );
}
