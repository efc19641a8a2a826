//! Speculative decoding (n-gram drafts, or a predicted output's, verified
//! in one step) on the real model: it may only change how many tokens a
//! step yields, never which. Every request, greedy or seeded random, with
//! logprobs, prompt logprobs, penalties, bad words and stop tokens, must
//! produce the tokens, logprobs and finish it produces without drafts,
//! while drafts are in fact kept; in-process and with worker processes
//! (tensor parallel too), with and without async scheduling, with and
//! without predictions (verified from the prefill on); and over HTTP with
//! the structured-output plugin masking every position.

use crate::harness::{structured_outputs_args, Server};
use host::config::EngineConfig;
use host::engine::{GenerateRequest, Llm, Prompt};
use host::sampling::SamplingParams;
use serde_json::json;
use std::time::{Duration, Instant};

/// Prompts whose continuations repeat what came before (so n-gram drafts
/// are often right) and ones that do not, each with a guess at its
/// continuation to predict it by (right, partly right, or wrong).
fn prompts() -> Vec<(String, &'static str)> {
    let mut p: Vec<(String, &str)> = [
        (
            "Repeat the line three times.\nThe quick brown fox jumps over the lazy dog.\nThe quick brown fox jumps over the lazy dog.\n",
            "The quick brown fox jumps over the lazy dog.\n",
        ),
        (
            "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
            " 13, 14, 15, 16, 17, 18, 19, 20,",
        ),
        (
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
            "    return a * b\n\ndef div(a, b):\n    return a / b\n",
        ),
        ("The history of Rome", " is long."),
        ("Why the sky is blue", "\n\nThe sky is blue because"),
    ]
    .map(|(t, guess)| (String::from(t), guess))
    .to_vec();
    p.push(("red, green, blue, ".repeat(6), "red, green, blue, red,"));
    p
}

/// Each prompt with its own sampling parameters.
fn params(llm: &Llm, n: usize) -> Vec<SamplingParams> {
    let stop_token_ids = llm.encode(&Prompt::Text(";".into())).unwrap();
    let bad_words = llm.encode(&Prompt::Text(" lazy dog".into())).unwrap();
    (0..n as u64)
        .map(|i| match i % 3 {
            0 => SamplingParams {
                temperature: 0.0,
                max_tokens: 40,
                logprobs: Some(3),
                prompt_logprobs: Some(2),
                ..SamplingParams::default()
            },
            1 => SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                seed: Some(i),
                max_tokens: 40,
                logprobs: Some(1),
                stop_token_ids: stop_token_ids.clone(),
                ..SamplingParams::default()
            },
            _ => SamplingParams {
                temperature: 0.7,
                top_k: 20,
                seed: Some(100 + i),
                max_tokens: 40,
                min_tokens: 5,
                repetition_penalty: 1.1,
                frequency_penalty: 0.2,
                bad_words_token_ids: vec![bad_words.clone()],
                ..SamplingParams::default()
            },
        })
        .collect()
}

/// What a run produced: per request its tokens, their logprobs and its
/// prompt logprobs (bits) and its finish; the speculative counters; and
/// the predicted tokens kept, summed over the requests.
type Run = (
    Vec<(Vec<u32>, Vec<Vec<u32>>, Vec<Vec<u32>>, String)>,
    (u64, u64),
    u32,
);

/// Generates every prompt with `num_speculative_tokens` drafts per step,
/// each request predicting its guess if `predict`.
fn run(
    num_speculative_tokens: usize,
    async_scheduling: bool,
    backend: &str,
    tp: usize,
    predict: bool,
) -> Run {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 512;
    c.cache.kv_cache_memory_bytes = Some(64 << 20);
    c.scheduler.async_scheduling = async_scheduling;
    c.parallel.distributed_executor_backend = backend.into();
    c.parallel.tensor_parallel_size = tp;
    c.speculative.num_speculative_tokens = num_speculative_tokens;
    c.speculative.prompt_lookup_min = Some(1);
    c.speculative.prompt_lookup_max = Some(3);
    let mut llm = Llm::new(&c).unwrap();
    let texts = prompts();
    let requests: Vec<GenerateRequest> = texts
        .iter()
        .zip(params(&llm, texts.len()))
        .map(|((t, guess), p)| GenerateRequest {
            prediction: predict.then(|| guess.to_string()),
            ..GenerateRequest::new(Prompt::Text(t.clone()), p)
        })
        .collect();
    let mut predicted_kept = 0;
    let got = llm
        .generate(&requests, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|r| {
            let c = r.unwrap();
            assert_eq!(c.logprobs.len() % c.token_ids.len().max(1), 0);
            assert_eq!(c.prediction_tokens.is_some(), predict);
            predicted_kept += c.prediction_tokens.map_or(0, |p| p.accepted);
            let logprobs = c
                .logprobs
                .iter()
                .map(|l| {
                    let mut bits = vec![l.logprob.to_bits()];
                    bits.extend(l.top.iter().flat_map(|&(t, p)| [t, p.to_bits()]));
                    bits
                })
                .collect();
            let prompt_logprobs = c
                .prompt_logprobs
                .iter()
                .flatten()
                .map(|l| {
                    let mut bits = vec![l.token, l.logprob.to_bits(), l.rank];
                    bits.extend(l.top.iter().flat_map(|&(t, p)| [t, p.to_bits()]));
                    bits
                })
                .collect();
            (
                c.token_ids,
                logprobs,
                prompt_logprobs,
                c.finish.finish_reason,
            )
        })
        .collect();
    llm.core().scheduler().check_invariants().unwrap();
    let stats = llm.stats().scheduler;
    assert_eq!(stats.kv_cache_usage, 0.0, "every block is free at the end");
    let spec = stats.spec_decoding;
    assert_eq!(
        spec.num_accepted_tokens_per_pos.iter().sum::<u64>(),
        spec.num_accepted_tokens,
        "every kept draft counted at its position"
    );
    (
        got,
        (spec.num_draft_tokens, spec.num_accepted_tokens),
        predicted_kept,
    )
}

#[test]
fn drafts_change_how_many_tokens_a_step_yields_never_which() {
    let (expected, (drafted, _), _) = run(0, false, "uni", 1, false);
    assert_eq!(drafted, 0, "no drafts without speculative decoding");
    assert!(
        expected.iter().step_by(3).all(|r| !r.2.is_empty()),
        "prompt logprobs were asked for"
    );
    // Under tensor parallelism every rank samples the rounds itself and
    // feeds its own tokens back, so the ranks must agree position by
    // position; its sums run in another order, so it has its own baseline.
    let (expected_tp, ..) = run(0, false, "mp", 3, false);
    let runs = [
        (4, false, "uni", 1, false),
        (4, true, "uni", 1, false),
        (4, false, "uni", 1, true),
        (2, false, "mp", 1, true),
        (3, false, "mp", 3, true),
    ];
    for (k, async_scheduling, backend, tp, predict) in runs {
        let (got, (drafted, accepted), predicted_kept) =
            run(k, async_scheduling, backend, tp, predict);
        let expected = if tp == 1 { &expected } else { &expected_tp };
        for (i, (g, e)) in got.iter().zip(expected).enumerate() {
            assert_eq!(
                g, e,
                "request {i} differs with {k} speculative tokens \
                 (async {async_scheduling}, {backend}, TP {tp}, predictions {predict})"
            );
        }
        assert_eq!(predicted_kept > 0, predict, "predictions drafted, and kept");
        assert!(
            accepted > 0 && accepted < drafted,
            "drafts were proposed ({drafted}) and some, not all, kept ({accepted})"
        );
    }
}

/// Over HTTP with the structured-output plugin loaded: constrained
/// requests (a JSON schema, a regex) and a free one with logprobs get the
/// same answers with drafts as without, since every position is masked and
/// sampled as in plain decoding; `/metrics` counts the drafts kept.
#[test]
fn constrained_outputs_over_http_do_not_change_with_drafts() {
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;
    // Both log their stats every half second, unless told not to.
    let every = "server.log_stats_interval_s=0.5";
    let plain = Server::start_logged(&structured_outputs_args(&[
        "--set",
        every,
        "--disable-log-stats",
    ]));
    let drafting = Server::start_logged(&structured_outputs_args(&[
        "--set",
        every,
        "--speculative-config",
        spec,
    ]));
    let schema = json!({
        "type": "object",
        "properties": {
            "cities": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 6}
        },
        "required": ["cities"]
    });
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "List some cities of France as JSON."}],
                "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "cities", "schema": schema}}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "ab ab ab", "max_tokens": 24, "temperature": 0.9, "seed": 7,
                "structured_outputs": {"regex": "( ab){2,10}"}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 30, "temperature": 0, "logprobs": 2}),
        ),
    ];
    for (path, body) in &bodies {
        let (a, b) = (plain.post(path, body), drafting.post(path, body));
        assert_eq!(
            (a.status, b.status),
            (200, 200),
            "{} / {}",
            a.text(),
            b.text()
        );
        assert_eq!(a.json()["choices"], b.json()["choices"], "{path} {body}");
    }
    let accepted = "vllm:spec_decode_num_accepted_tokens_total";
    assert_eq!(plain.metric(accepted), 0.0);
    assert!(drafting.metric(accepted) > 0.0, "drafts were kept");
    // One series per draft position, together the kept total; none
    // without drafts.
    let per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    let positions = drafting.metric_by_rank(per_pos);
    assert_eq!(positions.len(), 4, "one series per draft position");
    assert!(positions.windows(2).all(|w| w[0] >= w[1]), "{positions:?}");
    assert_eq!(positions.iter().sum::<f64>(), drafting.metric(accepted));
    let text = plain.get("/metrics").text();
    assert!(!text.contains(&format!("{per_pos}{{")), "{text}");

    // The stats lines' per-interval counts add up to the counter (once
    // the interval after the last request was logged), and the server
    // started with --disable-log-stats logs none.
    let kept = drafting.metric(accepted) as u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut log = drafting.log();
    while logged_accepted(&log) != kept && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        log = drafting.log();
    }
    assert_eq!(
        logged_accepted(&log),
        kept,
        "the logged intervals add up to /metrics:\n{log}"
    );
    assert!(log.contains("Engine 000: Avg prompt throughput: "), "{log}");
    let line = log
        .lines()
        .find(|l| l.contains("SpecDecoding metrics: "))
        .unwrap();
    let rates = line.split("Per-position acceptance rate: ").nth(1).unwrap();
    let rates: Vec<f64> = (rates.split(", Avg Draft").next().unwrap().split(", "))
        .map(|r| r.parse().unwrap())
        .collect();
    assert_eq!(rates.len(), 4, "{line}");
    assert!(rates.windows(2).all(|w| w[0] >= w[1]), "{line}");
    let quiet = plain.log();
    assert!(!quiet.contains("Avg prompt throughput"), "{quiet}");
}

/// The drafts kept, summed over the speculative stats lines of `log`.
fn logged_accepted(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| l.split("SpecDecoding metrics: ").nth(1))
        .map(|l| number_after(l, "Accepted: "))
        .sum()
}

/// The whole number that follows `key` in `line`.
fn number_after(line: &str, key: &str) -> u64 {
    let rest = line
        .split(key)
        .nth(1)
        .unwrap_or_else(|| panic!("no {key} in {line}"));
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {key} in {line}"))
}
