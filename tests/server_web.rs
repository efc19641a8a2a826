//! The web page at `/` in a real headless browser (Debian's chromium and
//! chromedriver, driven by selenium: tests/browser/playground_test.py):
//! the streamed answer the page shows is the API's greedy answer to the
//! same prompt, the loaded plugins are those `host plugin list` prints, and
//! with `--api-key` the page asks for the key while every API route
//! refuses requests without it. Screenshots go to
//! `target/test-output/server_web/`.

use crate::harness;

use std::path::PathBuf;
use std::process::Command;

use harness::Server;
use serde_json::{json, Value};

const INSTALL: &str = "the browser test needs Debian's chromium and its driver: run \
     `apt-get install -y --no-install-recommends chromium chromium-driver` and \
     `pip install -r tests/browser/requirements.txt`";

/// Fails (never skips) when the browser or its driver is missing.
fn require_browser() {
    for bin in ["chromium", "chromedriver"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {bin}")])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(found, "`{bin}` is not installed; {INSTALL}");
    }
}

/// `target/test-output/server_web/`, created.
fn output_dir() -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp
        .parent()
        .expect("the target folder")
        .join("test-output/server_web");
    std::fs::create_dir_all(&dir).expect("create the test output folder");
    dir
}

/// Runs the browser script against `server`; its JSON result.
fn drive(server: &Server, screenshot: &str, args: &[&str]) -> Value {
    let script = e2e::repo_root().join("tests/browser/playground_test.py");
    let shot = output_dir().join(screenshot);
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", server.addr))
        .arg(&shot)
        .args(args)
        .output()
        .expect("start python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} failed ({}); {INSTALL}\n{stdout}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(shot.is_file(), "no screenshot at {}", shot.display());
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// The plugins `host plugin list` prints for `--plugin FILE`, as
/// `name@version` (built-ins by name).
fn plugin_list(plugin: &std::path::Path) -> Vec<String> {
    let out = Command::new(e2e::host_bin())
        .arg("--model")
        .arg(e2e::default_model())
        .arg("--plugin")
        .arg(plugin)
        .args(["plugin", "list"])
        .output()
        .expect("run host plugin list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split('\t').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_page_streams_the_apis_greedy_answer() {
    require_browser();
    let plugin = e2e::plugin("shortest_prompt_first");
    let plugin_arg = plugin.to_str().unwrap();
    let server = Server::start(&["--plugin", plugin_arg]);
    let prompt = "Name three colours.";
    let max_tokens = 24;
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let want = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    let max = max_tokens.to_string();
    let v = drive(
        &server,
        "playground.png",
        &["--prompt", prompt, "--max-tokens", &max],
    );
    assert_eq!(v["answer"], want, "{v}");
    assert!(!v["asked_for_key"].as_bool().unwrap());
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert!(v["ttft_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["stats"].as_str().unwrap().contains("tok/s"), "{v}");
    assert!(v["gauges"]["kv"].as_str().unwrap().ends_with('%'), "{v}");
    // Every plugin `host plugin list` knows is listed, with its kind, and
    // the policy `--plugin` gave is marked as the one in use.
    let shown: Vec<String> = v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let known = plugin_list(&plugin);
    assert_eq!(shown.len(), known.len(), "{shown:?} vs {known:?}");
    for (s, k) in shown.iter().zip(&known) {
        // The built-in policies and the one `--plugin` gave are policies;
        // the structured-output backend, when installed beside the binary
        // (scripts/test.sh), is a logits processor.
        let kind = if k.starts_with("engine:structured-output@") {
            "logits processor"
        } else {
            "scheduling policy"
        };
        assert!(s.starts_with(k.as_str()) && s.contains(kind), "{s} vs {k}");
    }
    let used: Vec<&String> = shown
        .iter()
        .filter(|s| s.contains("scheduler.policy"))
        .collect();
    assert_eq!(used.len(), 1, "{shown:?}");
    assert!(
        used[0].starts_with("engine:shortest-prompt-first@"),
        "{shown:?}"
    );
}

#[test]
fn with_an_api_key_the_page_asks_for_it() {
    require_browser();
    let server = Server::start(&["--api-key", "sesame"]);
    // The page itself is public; every API route it calls is not.
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    assert!(page.header("content-security-policy").is_some());
    for asset in ["/app.js", "/style.css"] {
        assert_eq!(server.get(asset).status, 200, "{asset}");
    }
    for (method, path) in [
        ("GET", "/v1/models"),
        ("GET", "/v1/plugins"),
        ("GET", "/version"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_x"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ] {
        let r = server.request(method, path, &[], b"{}");
        assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
    }

    let v = drive(
        &server,
        "playground_api_key.png",
        &["--api-key", "sesame", "--prompt", "Hi", "--max-tokens", "4"],
    );
    assert!(v["asked_for_key"].as_bool().unwrap(), "{v}");
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    let want = server
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Authorization", "Bearer sesame")],
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
                .to_string()
                .as_bytes(),
        )
        .json();
    assert_eq!(v["answer"], want["choices"][0]["message"]["content"], "{v}");
}
