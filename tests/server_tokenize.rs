//! `/tokenize`, `/detokenize`, `/version` and `/v1/models` of `host serve`
//! against independent references: token ids from the Python `tokenizers`
//! package and chat prompts from Python's jinja2 (tests/reference), the
//! version from host/Cargo.toml, the context length from the command line.

use crate::harness;

use e2e::{default_model, repo_root, run_python};
use harness::Server;
use serde_json::{json, Value};

/// The context length the server is started with.
const MAX_MODEL_LEN: u64 = 2048;

/// Runs the Python references on `texts` (token ids) and `conversations`
/// (rendered prompts): `(ids_with_special, ids, rendered)`.
fn reference(
    texts: &[String],
    conversations: &Value,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let model = default_model();
    let model = model.to_str().unwrap();
    let corpus = dir.path().join("conversations.json");
    std::fs::write(
        &corpus,
        json!({ "conversations": conversations }).to_string(),
    )
    .unwrap();
    let rendered: Vec<String> = serde_json::from_str(&run_python(
        "chat_template_ref.py",
        &[model, corpus.to_str().unwrap()],
    ))
    .unwrap();
    let mut all: Vec<String> = texts.to_vec();
    all.extend(rendered.iter().cloned());
    let corpus = dir.path().join("texts.json");
    std::fs::write(&corpus, json!({ "texts": all }).to_string()).unwrap();
    let out_dir = dir.path().join("tok");
    let out: Value = serde_json::from_str(&run_python(
        "tokenize_ref.py",
        &[model, corpus.to_str().unwrap(), out_dir.to_str().unwrap()],
    ))
    .unwrap();
    let ids = |k: &str| -> Vec<Vec<u32>> { serde_json::from_value(out[k].clone()).unwrap() };
    (ids("ids_with_special"), ids("ids"), rendered)
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["tokens"].clone()).unwrap_or_else(|_| panic!("no tokens in {v}"))
}

#[test]
fn tokenize_and_detokenize_agree_with_the_references() {
    let max_len = format!("model.max_model_len={MAX_MODEL_LEN}");
    let server = Server::start(&[
        "--set",
        &max_len,
        "--set",
        "server.max_prompt_bytes=4096",
        "--set",
        "server.max_messages=4",
    ]);
    let prompt = "The capital of France is Paris; 2024 had 366 days.".to_string();
    let chat = json!([{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Name three colours."}]);
    let open = json!([{"role": "user", "content": "Tell me a story."},
                      {"role": "assistant", "content": "Once upon a time"}]);
    let conversations = json!([
        {"messages": chat, "add_generation_prompt": true},
        {"messages": open, "add_generation_prompt": false},
    ]);
    let (with_special, plain, rendered) = reference(std::slice::from_ref(&prompt), &conversations);
    // The open conversation is cut after the last message's text.
    let cut = &rendered[1][..rendered[1].rfind("Once upon a time").unwrap() + 16];
    let (_, cut_ids, _) = reference(&[cut.to_string()], &json!([]));

    // A prompt: the ids `tokenizers` gives with the special tokens, and the
    // tokens' strings spelling the text out.
    let r = server.post(
        "/tokenize",
        &json!({"prompt": prompt, "return_token_strs": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(ids(&v), with_special[0]);
    assert_eq!(v["count"], with_special[0].len());
    assert_eq!(v["max_model_len"], MAX_MODEL_LEN);
    let strs: Vec<String> = serde_json::from_value(v["token_strs"].clone()).unwrap();
    assert_eq!(strs.concat().replace('Ġ', " "), prompt);
    let v = server
        .post(
            "/tokenize",
            &json!({"prompt": prompt, "add_special_tokens": false}),
        )
        .json();
    assert_eq!(ids(&v), plain[0]);
    assert!(v["token_strs"].is_null(), "{v}");

    // Messages: the template jinja2 renders, tokenized without special tokens.
    let v = server.post("/tokenize", &json!({"messages": chat})).json();
    assert_eq!(ids(&v), plain[1], "{v}");
    let v = server
        .post(
            "/tokenize",
            &json!({"model": "SmolLM2-135M-Instruct.Q4_1", "messages": open,
                    "add_generation_prompt": false, "continue_final_message": true}),
        )
        .json();
    assert_eq!(ids(&v), cut_ids[0], "{v}");
    let r = server.post(
        "/tokenize",
        &json!({"messages": open, "continue_final_message": true}),
    );
    assert_eq!(r.json()["error"]["param"], "continue_final_message");

    // Detokenize: the references' ids back to the text.
    let v = server
        .post("/detokenize", &json!({"tokens": plain[0]}))
        .json();
    assert_eq!(v, json!({ "prompt": prompt }));
    let v = server
        .post("/detokenize", &json!({"tokens": plain[1]}))
        .json();
    assert_eq!(v["prompt"], rendered[0]);

    // Refusals name the field.
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [1, 2, 99999]}), "tokens[2]"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens[0]"),
        (
            "/detokenize",
            json!({"tokens": vec![1; MAX_MODEL_LEN as usize + 1]}),
            "tokens",
        ),
        ("/tokenize", json!({"prompt": "x".repeat(4097)}), "prompt"),
        (
            "/tokenize",
            json!({"messages": vec![json!({"role": "user", "content": "a"}); 5]}),
            "messages",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": chat}),
            "messages",
        ),
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "model": "gpt-4o"}),
            "model",
        ),
        (
            "/tokenize",
            json!({"messages": chat, "chat_template": "{{ x }}"}),
            "chat_template",
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "a", "name": "x"}]}),
            "messages[0].name",
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "function", "content": "a"}]}),
            "messages[0].role",
        ),
    ] {
        let r = server.post(path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{path}: {e}");
    }
    let e = server
        .post("/detokenize", &json!({"tokens": [1, 2, 99999]}))
        .json();
    assert!(
        e["error"]["message"].as_str().unwrap().contains("99999"),
        "{e}"
    );
    // Fields neither vLLM nor OpenAI define are ignored, as on the other endpoints.
    let r = server.post("/tokenize", &json!({"prompt": "a", "frobnicate": 1}));
    assert_eq!(r.status, 200, "{}", r.text());
    // JSON only, as on the other JSON endpoints.
    let body = "{\"prompt\":\"a\"}";
    let raw = format!(
        "POST /tokenize HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: text/plain\r\n\
         Content-Length: {}\r\n\r\n{body}",
        server.addr,
        body.len()
    );
    let r = server.raw(raw.as_bytes());
    assert_eq!(r.status, 415, "{}", r.text());
}

#[test]
fn version_and_models_report_what_vllm_reports() {
    let max_len = format!("model.max_model_len={MAX_MODEL_LEN}");
    let server = Server::start(&["--set", &max_len]);
    let manifest: toml::Value =
        toml::from_str(&std::fs::read_to_string(repo_root().join("host/Cargo.toml")).unwrap())
            .unwrap();
    let v = server.get("/version").json();
    assert_eq!(
        v,
        json!({"version": manifest["package"]["version"].as_str().unwrap()})
    );

    let v = server.get("/v1/models").json();
    let card = &v["data"][0];
    assert_eq!(card["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(card["object"], "model");
    assert_eq!(card["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(card["root"], default_model().display().to_string());
    assert!(card["parent"].is_null());
    assert_eq!(card["permission"][0]["object"], "model_permission");

    // The plugins a plain server knows: the two built-in policies, FCFS in
    // use, and the structured-output backend, in use as a logits processor,
    // when it is installed beside the binary (scripts/test.sh puts it there).
    let v = server.get("/v1/plugins").json();
    let mut expected = vec![
        json!({"name": "builtin:fcfs", "version": null, "kind": "scheduling policy", "builtin": true, "used_as": "scheduler.policy"}),
        json!({"name": "builtin:priority", "version": null, "kind": "scheduling policy", "builtin": true, "used_as": null}),
    ];
    let installed = e2e::host_bin().with_file_name("plugins/structured_output.wasm");
    if installed.is_file() {
        let version = v["data"][2]["version"].clone();
        assert!(version.is_string(), "{v}");
        expected.push(json!({"name": "engine:structured-output", "version": version, "kind": "logits processor", "builtin": false, "used_as": "plugins.logits_processors"}));
    }
    assert_eq!(v["data"], Value::Array(expected));
}
