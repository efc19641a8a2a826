//! Worker extensions in the real engine on the real model, with the worker
//! in the engine's process (`uni`) and in a worker process (`mp`):
//! `engine:weight-tools.stats` reads a weight through the host API and
//! agrees with llama.cpp's own Python reader; `scale` updates a weight and
//! the greedy output (tokens and logprobs) changes, and comes back exactly
//! when the weight does; unknown methods and extensions are refused naming
//! what exists. Also: a plugin
//! built against the older WIT 0.1.0 still loads and runs.

use host::config::EngineConfig;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use serde_json::{json, Value};

use e2e::plugin;

const STATS: &str = "engine:weight-tools.stats";
const SCALE: &str = "engine:weight-tools.scale";

fn engine_config(backend: &str) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.parallel.distributed_executor_backend = backend.into();
    c.plugins.paths = vec![plugin("weight_tools"), plugin("fcfs")];
    c.plugins.cache_dir = Some(std::env::temp_dir().join("host-plugin-tests-cache"));
    c.worker.extension = vec!["engine:weight-tools".into()];
    c
}

/// The greedy continuation of a fixed prompt: its token ids, and each
/// one's logprob (the bits, so "unchanged" means exactly). A weight change
/// anywhere in the forward pass moves the logprobs even where the greedy
/// tokens sit far from a tie; which tokens it flips depends on the last
/// bits of the kernels in use.
fn greedy_tokens(llm: &mut Llm) -> (Vec<u32>, Vec<u32>) {
    let req = GenerateRequest::new(
        Prompt::Text("The capital of France is".into()),
        SamplingParams {
            temperature: 0.0,
            max_tokens: 8,
            ignore_eos: true,
            logprobs: Some(0),
            ..SamplingParams::default()
        },
    );
    let done = llm.generate(&[req], |_, _| {}, |_, _| {}).unwrap();
    let done = done.into_iter().next().unwrap().unwrap();
    let logprobs = done.logprobs.iter().map(|l| l.logprob.to_bits()).collect();
    (done.token_ids, logprobs)
}

/// The one worker's reply to `method(args)`.
fn rpc(llm: &mut Llm, method: &str, args: Value) -> Result<Value, String> {
    let mut replies = llm.collective_rpc(method, Some(args))?;
    assert_eq!(replies.len(), 1, "one worker, one reply: {replies:?}");
    Ok(replies.remove(0))
}

fn assert_close(got: &Value, want: &Value, key: &str, tol: f64) {
    let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
    assert!(
        (g - w).abs() <= tol * w.abs().max(1.0),
        "{key}: engine {g}, gguf reference {w}"
    );
}

#[test]
fn stats_agree_with_the_gguf_reference_and_scale_changes_the_output() {
    let model = e2e::default_model();
    for backend in ["uni", "mp"] {
        let mut llm = Llm::new(&engine_config(backend)).unwrap();
        for name in ["blk.0.attn_q.weight", "output_norm.weight"] {
            let got = rpc(&mut llm, STATS, json!({ "name": name })).unwrap();
            let want: Value = serde_json::from_str(&e2e::run_python(
                "weight_stats.py",
                &[model.to_str().unwrap(), name],
            ))
            .unwrap();
            assert_eq!(got["shape"], want["shape"], "{name} ({backend})");
            assert_eq!(got["dtype"], want["dtype"], "{name} ({backend})");
            assert_eq!(got["count"], want["count"], "{name} ({backend})");
            for key in ["min", "max"] {
                assert_close(&got, &want, key, 0.0);
            }
            for key in ["mean", "abs_mean"] {
                assert_close(&got, &want, key, 1e-9);
            }
        }

        // Negating the final norm negates every logit: greedy then picks
        // the least likely tokens. Negating it again restores the weight
        // exactly (an F32 tensor), and with it the output.
        let before = greedy_tokens(&mut llm);
        let original = rpc(&mut llm, STATS, json!({ "name": "output_norm.weight" })).unwrap();
        let norm = json!({ "name": "output_norm.weight", "factor": -1.0 });
        let flipped = rpc(&mut llm, SCALE, norm.clone()).unwrap();
        assert_eq!(
            flipped["max"].as_f64(),
            original["min"].as_f64().map(|m| -m)
        );
        let after = greedy_tokens(&mut llm);
        assert_ne!(
            after.0, before.0,
            "a negated final norm changes the greedy output ({backend})"
        );
        rpc(&mut llm, SCALE, norm).unwrap();
        assert_eq!(greedy_tokens(&mut llm), before, "restored ({backend})");

        // A quantized weight is re-quantized to its own type (Q4_1 here),
        // so doubling it doubles its statistics up to rounding.
        let name = json!({ "name": "blk.3.ffn_down.weight" });
        let q = rpc(&mut llm, STATS, name.clone()).unwrap();
        let doubled = rpc(
            &mut llm,
            SCALE,
            json!({ "name": "blk.3.ffn_down.weight", "factor": 2.0 }),
        )
        .unwrap();
        assert_eq!(doubled["dtype"], q["dtype"]);
        assert_close(
            &doubled,
            &json!({ "abs_mean": 2.0 * q["abs_mean"].as_f64().unwrap() }),
            "abs_mean",
            1e-2,
        );
        let (_, logprobs) = greedy_tokens(&mut llm);
        assert_eq!(logprobs.len(), 8, "a logprob per token ({backend})");
        assert_ne!(
            logprobs[0], before.1[0],
            "a doubled down projection changes the first token's logprob ({backend})"
        );
    }
}

#[test]
fn model_info_and_kv_cache_stats_describe_the_engine() {
    let mut llm = Llm::new(&engine_config("uni")).unwrap();
    let info = rpc(&mut llm, "engine:weight-tools.model_info", Value::Null).unwrap();
    // SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads, vocab 49152.
    assert_eq!(
        (
            &info["num_layers"],
            &info["hidden_size"],
            &info["num_heads"],
            &info["num_kv_heads"]
        ),
        (&json!(30), &json!(576), &json!(9), &json!(3))
    );
    assert_eq!(
        (&info["vocab_size"], &info["max_model_len"]),
        (&json!(49152), &json!(256))
    );
    let kv = rpc(&mut llm, "engine:weight-tools.kv_cache_stats", Value::Null).unwrap();
    let c = engine_config("uni");
    let per_block = kv["bytes_per_block"].as_u64().unwrap();
    // K and V, 30 layers, 3 heads of 64 floats per slot.
    assert_eq!(
        per_block,
        2 * 30 * 3 * 64 * 4 * kv["block_size"].as_u64().unwrap()
    );
    assert_eq!(
        kv["num_blocks"].as_u64().unwrap(),
        c.cache.kv_cache_memory_bytes.unwrap() / per_block
    );
    let names = rpc(&mut llm, "engine:weight-tools.weight_names", Value::Null).unwrap();
    // The embedding, the final norm and 9 per layer (the LM head is tied).
    assert_eq!(names.as_array().unwrap().len(), 2 + 30 * 9);
}

#[test]
fn unknown_methods_weights_and_extensions_are_named() {
    let mut llm = Llm::new(&engine_config("uni")).unwrap();
    let err = rpc(&mut llm, "engine:weight-tools.nope", Value::Null).unwrap_err();
    assert!(
        err.contains("unknown worker method `engine:weight-tools.nope`") && err.contains(STATS),
        "{err}"
    );
    let err = rpc(&mut llm, STATS, json!({ "name": "blk.99.nope" })).unwrap_err();
    assert!(
        err.contains("engine:weight-tools.stats failed")
            && err.contains("no weight named \"blk.99.nope\""),
        "{err}"
    );
    let err = rpc(
        &mut llm,
        SCALE,
        json!({ "name": "output_norm.weight", "factor": "x" }),
    )
    .unwrap_err();
    assert!(err.contains("finite number"), "{err}");
    // The engine serves on after refused calls.
    assert_eq!(greedy_tokens(&mut llm).0.len(), 8);

    let mut c = engine_config("uni");
    c.worker.extension = vec!["engine:nope".into()];
    let err = format!("{:#}", Llm::new(&c).err().unwrap());
    assert!(
        err.contains("engine:nope") && err.contains("engine:weight-tools"),
        "{err}"
    );
    c.worker.extension = vec!["engine:fcfs".into()];
    let err = format!("{:#}", Llm::new(&c).err().unwrap());
    assert!(
        err.contains("scheduling policy, not a worker extension"),
        "{err}"
    );
}

#[test]
fn worker_extension_is_one_name_or_a_list_in_toml() {
    let one: EngineConfig =
        toml::from_str("[worker]\nextension = \"engine:weight-tools\"").unwrap();
    let many: EngineConfig =
        toml::from_str("[worker]\nextension = [\"engine:weight-tools\", \"acme:x\"]").unwrap();
    assert_eq!(one.worker.extension, ["engine:weight-tools"]);
    assert_eq!(many.worker.extension, ["engine:weight-tools", "acme:x"]);
    let err = toml::from_str::<EngineConfig>("[worker]\nextension = 3").unwrap_err();
    assert!(err.to_string().contains("qualified name"), "{err}");
}

/// `test:old-wit` was built against `engine:plugins@0.1.0` (pinned to
/// `wit/v0.1.0`): it loads, says so, and its order is the one used.
#[test]
fn a_plugin_built_against_wit_0_1_still_loads_and_runs() {
    let mut c = engine_config("uni");
    c.worker.extension.clear();
    c.plugins.paths = vec![plugin("old_wit")];
    let host = host::plugins::host_from_config(&c.plugins).unwrap();
    let info = host.plugins().next().unwrap();
    assert_eq!(
        (info.name.as_str(), info.wit_version.as_str()),
        ("test:old-wit", "engine:plugins@0.1.0")
    );

    // One request at a time: the admission order is the policy's. Last
    // come, first served reverses the submission order.
    c.scheduler.policy = "test:old-wit".into();
    c.scheduler.max_num_seqs = 1;
    let mut llm = Llm::new(&c).unwrap();
    let reqs: Vec<GenerateRequest> = ["The sky is", "Water boils at", "My name is"]
        .iter()
        .map(|t| {
            GenerateRequest::new(
                Prompt::Text(t.to_string()),
                SamplingParams {
                    temperature: 0.0,
                    max_tokens: 2,
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
            )
        })
        .collect();
    let done = llm.generate(&reqs, |_, _| {}, |_, _| {}).unwrap();
    let ttft: Vec<f64> = done
        .iter()
        .map(|r| r.as_ref().unwrap().metrics.time_to_first_token_s.unwrap())
        .collect();
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by(|&a, &b| ttft[a].total_cmp(&ttft[b]));
    assert_eq!(order, [2, 1, 0], "first tokens came in the order {order:?}");
}
