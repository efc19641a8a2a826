//! `echo` and `prompt_logprobs` on `/v1/completions` (issue 19, part 2),
//! end to end through `host serve` with the real model: the prompt
//! logprobs against an independent numpy forward pass
//! (`tests/reference/llama_ref.py --prompt-logprobs`), and their properties
//! (the prompt token in every position, logprobs <= 0, the top-k sorted by
//! rank) unchanged by a prefix-cache hit a plain request would take, by a
//! prefill cut into chunks, and by `echo`, which prefixes the choice's text
//! and logprobs with the prompt's. Chat's `echo` (vLLM's) repeats the last
//! message before an answer that continues its role.

use crate::harness;

use e2e::{default_model, run_python};
use harness::{chunks, Server};
use serde_json::{json, Value};

/// "Once upon a time, in a small village at the edge of a great forest,
/// there lived an old woodcutter and his three children. Every morning, the
/// woodcutter" (the prose prompt of reference_agreement.rs).
const TEXT: &str = "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his three children. Every morning, the woodcutter";
/// Its token ids (checked against the `tokenizers` package there).
const IDS: &[u32] = &[
    6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 418, 260, 5595, 282, 253, 1109, 3150, 28, 665,
    4161, 354, 1573, 3180, 8692, 352, 284, 650, 1296, 1122, 30, 5081, 5738, 28, 260, 3180, 8692,
    352,
];
/// Top tokens asked for per prompt position.
const K: usize = 5;

/// The serving path multiplies 8-bit quantized activations (see
/// reference_agreement.rs: at most 4% of the logit range per logit, below
/// 1.0 on the best logits). A logprob is a logit minus the log-sum-exp,
/// which the same error moves: measured at most 0.25 on these positions
/// (mean 0.06); the bounds are 1.0 per position and 0.15 on average. A
/// position off by one (the logits of token i scored against token i + 1's
/// row) moves them by several units.
const LOGPROB_TOL: f64 = 1.0;
const MEAN_TOL: f64 = 0.15;
/// Two runs of the same server kernels, cut into steps differently, agree
/// to float rounding (reference_agreement's batching test: 1e-3 on logits;
/// measured here: identical).
const RUN_TOL: f64 = 2e-3;

/// One prompt position as the reference computed it.
struct RefEntry {
    logprob: f64,
    rank: u64,
    top: Vec<(u32, f64)>,
}

fn reference() -> Vec<Option<RefEntry>> {
    let prompts = serde_json::to_string(&[IDS]).unwrap();
    let model = default_model();
    let out = run_python(
        "llama_ref.py",
        &[
            model.to_str().unwrap(),
            "--json",
            &prompts,
            "--prompt-logprobs",
            &K.to_string(),
        ],
    );
    let v: Value = serde_json::from_str(&out).expect("the reference prints JSON");
    v["results"][0]["prompt_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (!e.is_null()).then(|| RefEntry {
                logprob: e["logprob"].as_f64().unwrap(),
                rank: e["rank"].as_u64().unwrap(),
                top: e["top"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
                    .collect(),
            })
        })
        .collect()
}

/// `(logprob, rank)` of `token` in one position's object.
fn entry(pos: &Value, token: u32) -> (f64, u64) {
    let e = &pos[token.to_string()];
    (e["logprob"].as_f64().unwrap(), e["rank"].as_u64().unwrap())
}

/// Checks one choice's `prompt_logprobs` for the properties every answer
/// has, and returns each position's prompt-token logprob (`None` first).
fn check_properties(p: &Value) -> Vec<Option<f64>> {
    let list = p
        .as_array()
        .unwrap_or_else(|| panic!("no prompt_logprobs list: {p}"));
    assert_eq!(list.len(), IDS.len(), "one entry per prompt token");
    assert!(list[0].is_null(), "the first token has none");
    let mut out = vec![None];
    for (i, pos) in list.iter().enumerate().skip(1) {
        let obj = pos.as_object().unwrap();
        // The prompt token, plus the top K (which may include it).
        assert!(obj.contains_key(&IDS[i].to_string()), "position {i}: {pos}");
        assert!(obj.len() == K || obj.len() == K + 1, "position {i}: {pos}");
        let mut by_rank: Vec<(u64, f64)> = Vec::new();
        for (id, e) in obj {
            let lp = e["logprob"].as_f64().unwrap();
            assert!(lp <= 0.0, "position {i}: logprob {lp} of {id}");
            assert!(e["decoded_token"].is_string(), "{e}");
            by_rank.push((e["rank"].as_u64().unwrap(), lp));
        }
        by_rank.sort_by_key(|r| r.0);
        // Ranks 1..=K are the top K, their logprobs non-increasing.
        let ranks: Vec<u64> = by_rank.iter().take(K).map(|r| r.0).collect();
        assert_eq!(ranks, (1..=K as u64).collect::<Vec<_>>(), "position {i}");
        assert!(
            by_rank.windows(2).all(|w| w[0].1 >= w[1].1),
            "position {i}: logprobs not sorted by rank: {by_rank:?}"
        );
        out.push(Some(entry(pos, IDS[i]).0));
    }
    out
}

fn completion(server: &Server, body: Value) -> Value {
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The prompt logprobs of TEXT with the top K.
fn prompt_logprobs(server: &Server) -> Value {
    let v = completion(
        server,
        json!({"prompt": TEXT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": K}),
    );
    assert_eq!(v["usage"]["prompt_tokens"], IDS.len());
    v["choices"][0]["prompt_logprobs"].clone()
}

fn max_diff(a: &[Option<f64>], b: &[Option<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => (x - y).abs(),
            (None, None) => 0.0,
            _ => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

#[test]
fn prompt_logprobs_agree_with_the_reference_and_survive_caching_and_chunking() {
    let want = reference();
    let server = Server::start(&[]);
    let cold = prompt_logprobs(&server);
    let got = check_properties(&cold);

    // Against the reference.
    let mut sum = 0.0;
    let mut decisive = 0;
    for i in 1..IDS.len() {
        let r = want[i].as_ref().unwrap();
        let (lp, rank) = entry(&cold[i], IDS[i]);
        let err = (lp - r.logprob).abs();
        assert!(
            err <= LOGPROB_TOL,
            "position {i}: logprob {lp} vs the reference's {} (rank {rank} vs {})",
            r.logprob,
            r.rank
        );
        sum += err;
        // Where the reference's best token leads clearly, it is ours too.
        if r.top[0].1 - r.top[1].1 > 2.0 * LOGPROB_TOL {
            decisive += 1;
            let best = cold[i]
                .as_object()
                .unwrap()
                .iter()
                .find(|(_, e)| e["rank"] == 1)
                .map(|(id, _)| id.parse::<u32>().unwrap());
            assert_eq!(best, Some(r.top[0].0), "position {i}: the best token");
        }
    }
    let mean = sum / (IDS.len() - 1) as f64;
    assert!(
        mean <= MEAN_TOL,
        "mean |logprob error| {mean:.3} > {MEAN_TOL}"
    );
    assert!(
        decisive >= 5,
        "only {decisive} positions had a clear best token"
    );

    // The prompt's blocks are cached now: a plain request hits them, one
    // asking for prompt logprobs computes every position again.
    let hits = server.metric("vllm:prefix_cache_hits_total");
    completion(
        &server,
        json!({"prompt": TEXT, "max_tokens": 1, "temperature": 0}),
    );
    assert!(
        server.metric("vllm:prefix_cache_hits_total") > hits,
        "a plain request reuses the cached prefix"
    );
    let warm = check_properties(&prompt_logprobs(&server));
    assert!(max_diff(&got, &warm) <= RUN_TOL, "{got:?}\n{warm:?}");
    // A second prompt sharing the first's prefix, with a suffix of its
    // own: its shared positions are the same.
    let longer = completion(
        &server,
        json!({"prompt": format!("{TEXT} went"), "max_tokens": 1, "temperature": 0,
               "prompt_logprobs": 0}),
    );
    let list = longer["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(list.len(), IDS.len() + 1);
    for i in 1..IDS.len() {
        let obj = list[i].as_object().unwrap();
        assert_eq!(obj.len(), 1, "k = 0: the prompt token alone");
        let lp = entry(&list[i], IDS[i]).0;
        assert!((lp - got[i].unwrap()).abs() <= RUN_TOL, "position {i}");
    }
    drop(server);

    // A prefill cut into chunks of at most 16 tokens (three steps).
    let server = Server::start(&["--max-num-batched-tokens", "16"]);
    let chunked = check_properties(&prompt_logprobs(&server));
    assert!(max_diff(&got, &chunked) <= RUN_TOL, "{got:?}\n{chunked:?}");
    // Echo with logprobs there too: the prompt's logprobs lead.
    let v = completion(
        &server,
        json!({"prompt": TEXT, "max_tokens": 0, "echo": true, "logprobs": 1}),
    );
    let lps = &v["choices"][0]["logprobs"]["token_logprobs"];
    for i in 1..IDS.len() {
        assert!((lps[i].as_f64().unwrap() - got[i].unwrap()).abs() <= RUN_TOL);
    }
}

#[test]
fn echo_prefixes_the_prompt_and_its_logprobs() {
    let server = Server::start(&[]);
    let plain = completion(
        &server,
        json!({"prompt": TEXT, "max_tokens": 8, "temperature": 0, "logprobs": 2}),
    );
    let generated = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let v = completion(
        &server,
        json!({"prompt": TEXT, "max_tokens": 8, "temperature": 0, "logprobs": 2,
               "echo": true, "prompt_logprobs": 2}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["text"].as_str().unwrap(), format!("{TEXT}{generated}"));
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let prompt_lps = c["prompt_logprobs"].as_array().unwrap();
    let lp = &c["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    let offsets = lp["text_offset"].as_array().unwrap();
    let n = IDS.len();
    assert_eq!(tokens.len(), n + 8);
    assert_eq!(
        (token_logprobs.len(), top.len(), offsets.len()),
        (n + 8, n + 8, n + 8)
    );
    // The tokens spell out the prompt, then the completion.
    let spelled: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(spelled, format!("{TEXT}{generated}"));
    assert!(token_logprobs[0].is_null() && top[0].is_null());
    for i in 1..n {
        let want = entry(&prompt_lps[i], IDS[i]).0;
        let got = token_logprobs[i].as_f64().unwrap();
        assert!((got - want).abs() < 1e-4, "position {i}: {got} vs {want}");
        // The prompt token and the top 2 (as vLLM gives an echoed prompt).
        let alternatives = top[i].as_object().unwrap();
        assert!(
            alternatives.contains_key(tokens[i].as_str().unwrap()),
            "{alternatives:?}"
        );
        assert!((2..=3).contains(&alternatives.len()), "{alternatives:?}");
    }
    // The generated part is the plain answer's.
    let plain_lp = &plain["choices"][0]["logprobs"];
    assert_eq!(
        &tokens[n..],
        plain_lp["tokens"].as_array().unwrap().as_slice()
    );
    for (a, b) in token_logprobs[n..]
        .iter()
        .zip(plain_lp["token_logprobs"].as_array().unwrap())
    {
        assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
    }

    // Streamed: the first chunk carries the prompt, the rest add up to the
    // same text, and the usage counts only what was generated.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": TEXT, "max_tokens": 8, "temperature": 0, "echo": true,
                "logprobs": 0, "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let cs = chunks(&r.events());
    let first = &cs[0]["choices"][0];
    assert!(first["text"].as_str().unwrap().starts_with(TEXT), "{first}");
    let first_tokens = first["logprobs"]["tokens"].as_array().unwrap();
    assert!(first_tokens.len() > n, "the prompt's tokens lead: {first}");
    assert!(first["logprobs"]["token_logprobs"][0].is_null());
    let text: String = cs
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, format!("{TEXT}{generated}"));
    assert_eq!(cs.last().unwrap()["usage"]["completion_tokens"], 8);

    // `max_tokens: 0` scores the prompt alone.
    let v = completion(
        &server,
        json!({"prompt": TEXT, "max_tokens": 0, "echo": true, "logprobs": 0}),
    );
    let c = &v["choices"][0];
    assert_eq!(c["text"], TEXT);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["logprobs"]["tokens"].as_array().unwrap().len(), n);
    assert_eq!(v["usage"]["completion_tokens"], 0);
    // Token-id prompts echo their decoded text; two choices each echo it.
    let v = completion(
        &server,
        json!({"prompt": IDS, "max_tokens": 2, "temperature": 0, "echo": true, "n": 2}),
    );
    for c in v["choices"].as_array().unwrap() {
        assert!(c["text"].as_str().unwrap().starts_with(TEXT), "{c}");
    }

    // Refusals: prompt logprobs are not streamed (as in vLLM), are bounded
    // like logprobs, and chat does not echo.
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": TEXT, "prompt_logprobs": 1, "stream": true}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "prompt_logprobs");
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": TEXT, "prompt_logprobs": 21}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "prompt_logprobs");
    // Chat gives the prompt's logprobs beside its choices, as vLLM does.
    let v = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "prompt_logprobs": 0}),
        )
        .json();
    let list = v["prompt_logprobs"].as_array().unwrap();
    assert!(list[0].is_null() && list.len() == v["usage"]["prompt_tokens"]);
}

/// vLLM's chat `echo`: an answer that continues the last message's role
/// (an assistant message, or any last message without a generation
/// prompt) starts with that message's text, followed by what the same
/// request answers without `echo`, streamed (in the first chunk) or not,
/// in every choice; after a user's message it repeats nothing.
#[test]
fn chat_echo_repeats_the_message_the_answer_continues() {
    let server = Server::start(&[]);
    let chat = |body: &Value| {
        let r = server.post("/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let contents = |answer: &Value| -> Vec<String> {
        let choices = answer["choices"].as_array().unwrap();
        choices
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    let begun = "The moon is";
    let question = json!({"role": "user", "content": "Write a sentence about the moon."});
    let cases = [
        (
            json!({"messages": [question, {"role": "assistant", "content": begun}],
                "add_generation_prompt": false, "continue_final_message": true}),
            begun,
        ),
        (
            json!({"messages": [question, {"role": "assistant", "content": begun}]}),
            begun,
        ),
        (json!({"messages": [question]}), ""),
    ];
    for (body, echoed) in cases {
        let mut body = body;
        for (k, v) in [
            ("max_tokens", json!(8)),
            ("temperature", json!(1)),
            ("seed", json!(5)),
            ("n", json!(2)),
        ] {
            body[k] = v;
        }
        let plain = contents(&chat(&body));
        body["echo"] = json!(true);
        let want: Vec<String> = plain.iter().map(|t| format!("{echoed}{t}")).collect();
        assert_eq!(contents(&chat(&body)), want, "{body}");

        body["stream"] = json!(true);
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let cs = chunks(&r.events());
        let mut streamed = vec![String::new(); 2];
        for c in &cs {
            let choice = &c["choices"][0];
            if let Some(text) = choice["delta"]["content"].as_str() {
                streamed[choice["index"].as_u64().unwrap() as usize].push_str(text);
            }
        }
        assert_eq!(streamed, want, "{body}");
        assert_eq!(cs[0]["choices"][0]["delta"]["content"], echoed);
    }
}
