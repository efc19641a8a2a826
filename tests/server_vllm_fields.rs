//! vLLM's own request fields on chat and completions, over real HTTP with
//! the real model: `cache_salt` (prefix-cache isolation, seen in the
//! server's prefix-cache counters), `truncate_prompt_tokens` (checked
//! against the same request with the kept tokens sent alone),
//! `return_token_ids` and `return_tokens_as_token_ids` (checked against
//! `/tokenize`, the text and the usage, streamed and not), and
//! `continue_final_message` (against the prompt `/tokenize` renders),
//! `chat_template_kwargs`, `documents` under an operator's
//! `--chat-template` (against the template rendered by hand), and
//! `spaces_between_special_tokens` (adjacent special tokens, forced by
//! `logit_bias`, against their own text).

use crate::harness::{chunks, Server};
use serde_json::{json, Value};

/// vLLM's `cache_salt`: a request reuses the prefix-cache blocks of
/// requests with the same salt only (unsalted ones share among
/// themselves), on every generation endpoint; a bad salt is a 400 naming
/// the field.
#[test]
fn a_cache_salt_shares_cached_prefixes_with_the_same_salt_alone() {
    let server = Server::start(&[]);
    // About a hundred tokens: several full 16-token blocks.
    let system = "You answer every question about the sea in one short word. ".repeat(8);
    // The prefix-cache hits (tokens) of one request.
    let hits_of = |path: &str, mut body: Value, salt: Option<&str>| {
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let before = server.metric("vllm:prefix_cache_hits_total");
        let r = server.post(path, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        server.metric("vllm:prefix_cache_hits_total") - before
    };
    let completion = |q: &str| json!({"prompt": format!("{system}{q}"), "max_tokens": 1});
    let chat = |q: &str| {
        json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "max_tokens": 1})
    };
    let responses = |q: &str| json!({"instructions": system, "input": q, "max_output_tokens": 1});
    let cases = [
        (
            "/v1/completions",
            completion("Salt?"),
            Some("tenant-a"),
            false,
        ),
        (
            "/v1/completions",
            completion("Waves?"),
            Some("tenant-a"),
            true,
        ),
        (
            "/v1/completions",
            completion("Tides?"),
            Some("tenant-b"),
            false,
        ),
        ("/v1/completions", completion("Fish?"), None, false),
        ("/v1/completions", completion("Ships?"), None, true),
        (
            "/v1/chat/completions",
            chat("Salt?"),
            Some("tenant-a"),
            false,
        ),
        (
            "/v1/chat/completions",
            chat("Waves?"),
            Some("tenant-a"),
            true,
        ),
        (
            "/v1/chat/completions",
            chat("Tides?"),
            Some("tenant-b"),
            false,
        ),
        ("/v1/responses", responses("Salt?"), Some("tenant-a"), true),
        (
            "/v1/responses",
            responses("Tides?"),
            Some("tenant-c"),
            false,
        ),
    ];
    for (i, (path, body, salt, shared)) in cases.into_iter().enumerate() {
        let hits = hits_of(path, body, salt);
        if shared {
            assert!(
                hits >= 64.0,
                "case {i} ({path}, {salt:?}) reused {hits} tokens"
            );
        } else {
            assert_eq!(
                hits, 0.0,
                "case {i} ({path}, {salt:?}) reused another salt's blocks"
            );
        }
    }
    for (salt, why) in [
        (json!(""), "non-empty"),
        (json!(7), "cache_salt"),
        (json!("s".repeat(1025)), "1025 bytes"),
    ] {
        let mut body = completion("Salt?");
        body["cache_salt"] = salt;
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["param"], "cache_salt", "{}", r.text());
        assert!(r.text().contains(why), "{}", r.text());
    }
}

/// vLLM's `truncate_prompt_tokens`: a prompt keeps its last k tokens, so
/// the answer is the one to those tokens sent alone; a prompt longer than
/// the context runs once cut, text or token ids, on completions and chat;
/// a bad value is a 400 naming the field.
#[test]
fn truncate_prompt_tokens_keeps_the_prompts_end() {
    let server = Server::start(&["--set", "model.max_model_len=256"]);
    let long = "The lighthouse keeper counted the ships that passed each night. ".repeat(30);
    let tokens = |body: Value| -> Vec<u64> {
        let r = server.post("/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        serde_json::from_value(r.json()["tokens"].clone()).unwrap()
    };
    let ids = tokens(json!({"prompt": long}));
    assert!(ids.len() > 300, "{} tokens", ids.len());
    let last = |n: usize| &ids[ids.len() - n..];
    let complete = |body: Value| {
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let greedy = json!({"max_tokens": 8, "temperature": 0, "echo": true});
    let with = |fields: Value| {
        let mut body = greedy.clone();
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        body
    };
    let r = server.post("/v1/completions", &with(json!({"prompt": long})));
    assert_eq!(r.status, 400, "too long without truncation: {}", r.text());

    let want = complete(with(json!({"prompt": last(100)})));
    for prompt in [json!(long), json!(ids)] {
        let got = complete(with(
            json!({"prompt": prompt, "truncate_prompt_tokens": 100}),
        ));
        assert_eq!(got["usage"]["prompt_tokens"], 100, "{got}");
        // The echo is the prompt the model saw, then the same answer.
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    }

    // Chat keeps the end of its rendered prompt: the last message and the
    // assistant's turn.
    let messages = json!([{"role": "system", "content": long},
        {"role": "user", "content": "How many ships?"}]);
    let chat_ids = tokens(json!({"messages": messages}));
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "temperature": 0,
            "truncate_prompt_tokens": 60}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let chat = r.json();
    assert_eq!(chat["usage"]["prompt_tokens"], 60, "{chat}");
    let want = complete(json!({"prompt": &chat_ids[chat_ids.len() - 60..],
        "max_tokens": 8, "temperature": 0}));
    assert_eq!(
        chat["choices"][0]["message"]["content"],
        want["choices"][0]["text"]
    );

    // -1 keeps the whole context, which leaves no room for the answer;
    // 0, -2 and more than the context are refused.
    for (k, says) in [
        (json!(-1), "256 tokens"),
        (json!(0), "at least 1"),
        (json!(-2), "at least 1"),
        (json!(257), "at most 256"),
    ] {
        let body = with(json!({"prompt": long, "truncate_prompt_tokens": k}));
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{k}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], "truncate_prompt_tokens", "{k}");
        assert!(r.text().contains(says), "{k}: {}", r.text());
    }
}

/// The `data:` chunks of a streamed answer.
fn streamed(server: &Server, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    chunks(&r.events())
}

/// `ids` as a JSON list's numbers.
fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v}"))
}

/// vLLM's `return_token_ids`: the prompt's ids are what `/tokenize` gives
/// for it, the choice's ids spell its text and count as its usage, and a
/// stream's chunks carry the same ids (the prompt's in the first chunk),
/// a tool answer's held-back text included. `return_tokens_as_token_ids`
/// names every logprobs token `token_id:<id>`, those same ids.
#[test]
fn token_ids_are_returned_and_name_the_logprobs_tokens() {
    let server = Server::start(&[]);
    let prompt = "The three primary colours are";
    let prompt_ids = ids(&server.post("/tokenize", &json!({"prompt": prompt})).json()["tokens"]);
    let detokenize = |ids: &[u64]| {
        let r = server.post("/detokenize", &json!({"tokens": ids}));
        r.json()["prompt"].as_str().unwrap().to_string()
    };
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2,
        "return_token_ids": true, "return_tokens_as_token_ids": true});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json();
    let choice = &answer["choices"][0];
    assert_eq!(ids(&choice["prompt_token_ids"]), prompt_ids);
    let token_ids = ids(&choice["token_ids"]);
    assert_eq!(token_ids.len() as u64, answer["usage"]["completion_tokens"]);
    assert_eq!(detokenize(&token_ids), choice["text"].as_str().unwrap());
    let named: Vec<String> = token_ids.iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(choice["logprobs"]["tokens"], json!(named));
    for top in choice["logprobs"]["top_logprobs"].as_array().unwrap() {
        for key in top.as_object().unwrap().keys() {
            assert!(
                key.strip_prefix("token_id:")
                    .is_some_and(|t| t.parse::<u32>().is_ok()),
                "{key}"
            );
        }
    }
    let chunks = streamed(&server, "/v1/completions", &body);
    assert_eq!(
        ids(&chunks[0]["choices"][0]["prompt_token_ids"]),
        prompt_ids
    );
    let streamed_ids: Vec<u64> = chunks
        .iter()
        .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(streamed_ids, token_ids, "streamed as returned whole");
    // Without the fields, neither key.
    let plain = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "logprobs": 1}),
    );
    let plain = &plain.json()["choices"][0];
    assert!(plain.get("token_ids").is_none() && plain.get("prompt_token_ids").is_none());
    assert!(!plain["logprobs"]["tokens"][0]
        .as_str()
        .unwrap()
        .starts_with("token_id:"));

    // Chat: the rendered prompt's ids beside the choices; with tools, the
    // stream holds text back until it knows it is no call, and the ids
    // travel with it.
    let messages = json!([{"role": "user", "content": "Name three colours."}]);
    let chat_prompt = ids(&server
        .post("/tokenize", &json!({"messages": messages}))
        .json()["tokens"]);
    let tool = json!({"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {}}}});
    for tools in [Value::Null, json!([tool])] {
        let mut body = json!({"messages": messages, "max_tokens": 16, "temperature": 0,
            "logprobs": true, "top_logprobs": 1, "return_token_ids": true,
            "return_tokens_as_token_ids": true});
        if !tools.is_null() {
            body["tools"] = tools.clone();
        }
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let answer = r.json();
        let returned_prompt = ids(&answer["prompt_token_ids"]);
        assert_eq!(
            returned_prompt.len() as u64,
            answer["usage"]["prompt_tokens"]
        );
        if tools.is_null() {
            // (With tools, their description joins the prompt.)
            assert_eq!(returned_prompt, chat_prompt);
        }
        let choice = &answer["choices"][0];
        let token_ids = ids(&choice["token_ids"]);
        assert_eq!(token_ids.len() as u64, answer["usage"]["completion_tokens"]);
        let content = choice["logprobs"]["content"].as_array().unwrap();
        for (entry, id) in content.iter().zip(&token_ids) {
            let name = format!("token_id:{id}");
            assert_eq!(entry["token"], name.as_str());
            assert_eq!(entry["bytes"], json!(name.as_bytes()));
        }
        let chunks = streamed(&server, "/v1/chat/completions", &body);
        assert_eq!(ids(&chunks[0]["prompt_token_ids"]), returned_prompt);
        let streamed_ids: Vec<u64> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0).and_then(|c| c.get("token_ids")))
            .flat_map(ids)
            .collect();
        assert_eq!(streamed_ids, token_ids, "tools {}", body["tools"]);
    }
}

/// `continue_final_message`: the model continues the last message (a
/// prefilled answer) instead of starting a new turn, so the answer is
/// the completion of the prompt `/tokenize` renders for the same messages
/// (checked there against jinja2); with `add_generation_prompt` left on,
/// a 400 naming the field.
#[test]
fn chat_continues_the_final_message_when_asked() {
    let server = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Write a sentence about the moon."},
        {"role": "assistant", "content": "The moon is"}]);
    let open = json!({"messages": messages, "add_generation_prompt": false,
        "continue_final_message": true});
    let r = server.post("/tokenize", &open);
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt = ids(&r.json()["tokens"]);
    let mut chat = open.clone();
    chat["max_tokens"] = json!(10);
    chat["temperature"] = json!(0);
    let r = server.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json();
    assert_eq!(answer["usage"]["prompt_tokens"], prompt.len());
    let want = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        want.json()["choices"][0]["text"]
    );
    // A new turn would answer something else.
    let mut new_turn = chat.clone();
    new_turn["continue_final_message"] = json!(false);
    new_turn["add_generation_prompt"] = json!(true);
    let r = server.post("/v1/chat/completions", &new_turn);
    assert!(r.json()["usage"]["prompt_tokens"].as_u64().unwrap() > prompt.len() as u64);

    chat.as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let r = server.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "continue_final_message");
}

/// `chat_template_kwargs`: clients written for templates that read them
/// (Qwen3's `enable_thinking`) send them to every model; a template that
/// does not read one renders as without it, as transformers does, on chat
/// and `/tokenize` alike. A variable the server sets itself is refused.
#[test]
fn chat_template_kwargs_reach_the_template_and_unread_ones_change_nothing() {
    let server = Server::start(&[]);
    let messages = json!([{"role": "user", "content": "Say hello."}]);
    let body = |kwargs: Value| {
        json!({"messages": messages, "max_tokens": 8, "temperature": 0,
            "chat_template_kwargs": kwargs})
    };
    let plain = server
        .post("/v1/chat/completions", &body(Value::Null))
        .json();
    let r = server.post(
        "/v1/chat/completions",
        &body(json!({"enable_thinking": false, "documents": [{"text": "x"}]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let with = r.json();
    assert_eq!(
        with["choices"][0]["message"],
        plain["choices"][0]["message"]
    );
    // The same prompt, so the second run's prompt came from the cache.
    for field in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(with["usage"][field], plain["usage"][field], "{field}");
    }
    let tokenized = server.post(
        "/tokenize",
        &json!({"messages": messages, "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(tokenized.json()["count"], plain["usage"]["prompt_tokens"]);
    for (path, body) in [
        (
            "/v1/chat/completions",
            body(json!({"add_generation_prompt": false})),
        ),
        (
            "/tokenize",
            json!({"messages": messages, "chat_template_kwargs": {"messages": []}}),
        ),
    ] {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let param = r.json()["error"]["param"].as_str().unwrap().to_string();
        assert!(param.starts_with("chat_template_kwargs."), "{param}");
    }
    let r = server.post(
        "/v1/chat/completions",
        &body(json!(["not", "an", "object"])),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "chat_template_kwargs");
}

/// An operator's chat template (vLLM's `--chat-template`, here a file)
/// replaces the model's, and vLLM's `documents` reach it as its
/// `documents` variable unless `chat_template_kwargs` sets one: each chat
/// answers as completions answer the prompt the test renders by hand.
#[test]
fn documents_reach_an_operators_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("rag.jinja");
    std::fs::write(
        &template,
        "{%- if documents %}<|im_start|>system\nSources:\n{% for d in documents %}- {{ d.title }}: \
         {{ d.text }}\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>\
         {{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}\
         <|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let server = Server::start(&["--chat-template", template.to_str().unwrap()]);
    let question = "Where do the ferries leave from?";
    let by_hand = |docs: &[(&str, &str)]| {
        let mut text = String::new();
        if !docs.is_empty() {
            text.push_str("<|im_start|>system\nSources:\n");
            for (title, body) in docs {
                text.push_str(&format!("- {title}: {body}\n"));
            }
            text.push_str("<|im_end|>\n");
        }
        text + &format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    };
    let tokens = |body: Value| {
        let r = server.post("/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        ids(&r.json()["tokens"])
    };
    let messages = json!([{"role": "user", "content": question}]);
    // The server renders with the operator's template.
    assert_eq!(
        tokens(json!({"messages": messages})),
        tokens(json!({"prompt": by_hand(&[]), "add_special_tokens": false}))
    );
    let harbour = [("Harbour guide", "Ferries leave from pier 3 every hour.")];
    let station = [("Station guide", "Trains leave from platform 9.")];
    let as_json = |docs: &[(&str, &str)]| -> Value {
        docs.iter()
            .map(|(title, text)| json!({"title": title, "text": text}))
            .collect()
    };
    for (body_extra, docs) in [
        (json!({"documents": as_json(&harbour)}), &harbour),
        (
            json!({"documents": as_json(&harbour),
                "chat_template_kwargs": {"documents": as_json(&station)}}),
            &station,
        ),
    ] {
        let mut chat = json!({"messages": messages, "max_tokens": 12, "temperature": 0});
        for (k, v) in body_extra.as_object().unwrap() {
            chat[k] = v.clone();
        }
        let r = server.post("/v1/chat/completions", &chat);
        assert_eq!(r.status, 200, "{}", r.text());
        let answer = r.json();
        let prompt = tokens(json!({"prompt": by_hand(docs), "add_special_tokens": false}));
        assert_eq!(
            answer["usage"]["prompt_tokens"],
            prompt.len(),
            "{body_extra}"
        );
        let want = server.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            want.json()["choices"][0]["text"],
            "{body_extra}"
        );
    }
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "documents": as_json(&harbour)}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "documents");
}

/// vLLM's `spaces_between_special_tokens`: with special tokens kept, a run
/// of them is their texts side by side under `false`, and under `true` too
/// (vLLM's fast detokenizer on a byte-level tokenizer puts nothing between
/// them); a value of the wrong type is a 400 naming the field.
#[test]
fn adjacent_special_tokens_touch_whatever_the_spacing() {
    let server = Server::start(&[]);
    let special = "<|im_start|>";
    let r = server.post(
        "/tokenize",
        &json!({"prompt": special, "add_special_tokens": false}),
    );
    let id = ids(&r.json()["tokens"]);
    assert_eq!(id.len(), 1, "{special} is one token: {id:?}");
    let body = |spacing: Value| {
        json!({"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": true,
            "skip_special_tokens": false, "logit_bias": {id[0].to_string(): 100},
            "return_token_ids": true, "spaces_between_special_tokens": spacing})
    };
    for spacing in [json!(false), json!(true), json!(null)] {
        let r = server.post("/v1/completions", &body(spacing.clone()));
        assert_eq!(r.status, 200, "{spacing}: {}", r.text());
        let choice = &r.json()["choices"][0];
        assert_eq!(ids(&choice["token_ids"]), [id[0]; 4], "{spacing}");
        assert_eq!(choice["text"], special.repeat(4), "{spacing}");
    }
    let r = server.post("/v1/completions", &body(json!("no")));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "spaces_between_special_tokens");
}
