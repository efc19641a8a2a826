//! vLLM's beam search (`use_beam_search`, `length_penalty`), over real HTTP
//! with the real model, against a reference written here from vLLM's
//! published algorithm that runs each step as plain one-token completions
//! with top logprobs: the same beams, in the same order, with the same
//! finish reasons; width 1 is greedy decoding; chat searches from the
//! prompt its template renders; what beam search does not use is a 400.

use crate::harness::Server;
use serde_json::{json, Value};

/// One finished beam: its tokens and whether it drew the EOS token.
type Beam = (Vec<u64>, bool);

/// vLLM's beam search, step by step through `/v1/completions`: every live
/// beam asks for one token with the `2 × width` most likely tokens'
/// logprobs; the `width` best extensions live on, those ending in `eos`
/// are complete; the answer is the `width` best of both. A beam scores
/// its cumulative logprob over its length (prompt included, a final EOS
/// not) to the power `length_penalty`.
fn reference(
    server: &Server,
    prompt: &[u64],
    width: usize,
    max_tokens: usize,
    length_penalty: f64,
    eos: Option<u64>,
) -> Vec<Beam> {
    let ends = |tokens: &[u64]| tokens.last().is_some_and(|t| Some(*t) == eos);
    let score = |(tokens, cum): &(Vec<u64>, f64)| {
        let len = prompt.len() + tokens.len() - usize::from(ends(tokens));
        cum / (len as f64).powf(length_penalty)
    };
    let by_score = |beams: &mut Vec<(Vec<u64>, f64)>| {
        beams.sort_by(|a, b| score(b).partial_cmp(&score(a)).unwrap());
        beams.truncate(width);
    };
    let mut live = vec![(Vec::new(), 0.0)];
    let mut complete = Vec::new();
    for _ in 0..max_tokens {
        let mut extended = Vec::new();
        for (tokens, cum) in &live {
            let ids: Vec<u64> = prompt.iter().chain(tokens).copied().collect();
            let body = json!({"prompt": ids, "max_tokens": 1, "temperature": 0,
                "logprobs": 2 * width, "return_tokens_as_token_ids": true});
            let r = server.post("/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0].clone();
            let mut next: Vec<(u64, f64)> = top
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let id = k.strip_prefix("token_id:").unwrap().parse().unwrap();
                    // The server's logprobs are f32s.
                    (id, f64::from(v.as_f64().unwrap() as f32))
                })
                .collect();
            next.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
            for (id, logprob) in next {
                let mut tokens = tokens.clone();
                tokens.push(id);
                extended.push((tokens, cum + logprob));
            }
        }
        let (done, mut next): (Vec<_>, Vec<_>) = extended.into_iter().partition(|b| ends(&b.0));
        complete.extend(done);
        by_score(&mut next);
        live = next;
        if live.is_empty() {
            break;
        }
    }
    complete.extend(live);
    by_score(&mut complete);
    complete
        .into_iter()
        .map(|(tokens, _)| {
            let stopped = ends(&tokens);
            (tokens, stopped)
        })
        .collect()
}

/// The beams of an answer, best first.
fn beams(answer: &Value) -> Vec<Beam> {
    answer["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let tokens = serde_json::from_value(c["token_ids"].clone()).unwrap();
            (tokens, c["finish_reason"] == "stop")
        })
        .collect()
}

#[test]
fn beam_search_finds_the_beams_vllms_algorithm_finds() {
    let server = Server::start(&[]);
    let tokens = |body: Value| -> Vec<u64> {
        let r = server.post("/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        serde_json::from_value(r.json()["tokens"].clone()).unwrap()
    };
    let eos = tokens(json!({"prompt": "<|im_end|>", "add_special_tokens": false}))[0];
    let search = |prompt: &[u64], extra: Value| {
        let mut body = json!({"prompt": prompt, "use_beam_search": true, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let capital = tokens(json!({"prompt": "The capital of France is"}));
    let answer = search(&capital, json!({"n": 3, "max_tokens": 6}));
    assert_eq!(
        beams(&answer),
        reference(&server, &capital, 3, 6, 1.0, Some(eos))
    );
    assert_eq!(answer["usage"]["prompt_tokens"], capital.len());
    let generated: usize = beams(&answer).iter().map(|b| b.0.len()).sum();
    assert_eq!(answer["usage"]["completion_tokens"], generated);

    let story = tokens(json!({"prompt": "Once upon a time, a small robot"}));
    let answer = search(
        &story,
        json!({"n": 2, "max_tokens": 5, "length_penalty": 0.5, "ignore_eos": true}),
    );
    assert_eq!(beams(&answer), reference(&server, &story, 2, 5, 0.5, None));
    for c in answer["choices"].as_array().unwrap() {
        let text = server.post("/detokenize", &json!({"tokens": c["token_ids"]}));
        assert_eq!(c["text"], text.json()["prompt"], "{c}");
    }

    // Width 1 is greedy decoding.
    let greedy = server.post(
        "/v1/completions",
        &json!({"prompt": story, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
            "return_token_ids": true}),
    );
    let one = search(&story, json!({"n": 1, "max_tokens": 8, "ignore_eos": true}));
    assert_eq!(
        one["choices"][0]["token_ids"],
        greedy.json()["choices"][0]["token_ids"]
    );

    // Chat searches from the prompt its template renders.
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let rendered = tokens(json!({"messages": messages}));
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "n": 2, "max_tokens": 4, "use_beam_search": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let chat = r.json();
    let completion = search(&rendered, json!({"n": 2, "max_tokens": 4}));
    for i in 0..2 {
        assert_eq!(
            chat["choices"][i]["message"]["content"],
            completion["choices"][i]["text"]
        );
    }
}

#[test]
fn what_beam_search_does_not_use_is_refused() {
    let server = Server::start(&[]);
    let beam = |extra: Value| {
        let mut body = json!({"prompt": "Hi", "max_tokens": 2, "use_beam_search": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (path, body, field) in [
        ("/v1/completions", beam(json!({"stream": true})), "stream"),
        ("/v1/completions", beam(json!({"logprobs": 2})), "logprobs"),
        ("/v1/completions", beam(json!({"top_p": 0.5})), "top_p"),
        ("/v1/completions", beam(json!({"stop": ["."]})), "stop"),
        ("/v1/completions", beam(json!({"n": 11})), "n"),
        ("/v1/completions", beam(json!({"echo": true})), "echo"),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "length_penalty": 0.5}),
            "length_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "use_beam_search": true,
                "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            "/v1/responses",
            json!({"input": "Hi", "use_beam_search": true}),
            "use_beam_search",
        ),
    ] {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], field, "{body}: {}", r.text());
    }
}
