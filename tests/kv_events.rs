//! KV-cache events for routers (`[kv_events]`) on the real server and
//! model, read by a subscriber written from vLLM's documented wire format
//! (`tests/server/kv_events_client.py`, pyzmq + msgpack): a prompt's full
//! blocks are stored chained from no parent, a shared prefix is stored
//! once and later blocks chain to it, evictions and resets are announced,
//! sequence numbers have no gap, and replay returns what was published.

use crate::harness;

use std::net::TcpListener;
use std::process::Command;

use harness::Server;

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_subscriber_sees_every_block_stored_evicted_and_cleared() {
    let (publish, replay) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    // Twelve blocks of 16 tokens (SmolLM2: 30 layers x K and V x 3 KV heads
    // x 64 dims x 4 bytes per token): a 150-token prompt must evict.
    let kv_bytes = (12 * 16 * 30 * 2 * 3 * 64 * 4).to_string();
    // vLLM's flag, as an operator moving from vLLM would write it.
    let kv_events_config = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": publish,
        "replay_endpoint": replay,
    });
    let server = Server::start(&[
        "--kv-events-config",
        &kv_events_config.to_string(),
        "--set",
        "server.enable_rpc_endpoint=true",
        "--kv-cache-memory-bytes",
        &kv_bytes,
    ]);
    let script = e2e::repo_root().join("tests/server/kv_events_client.py");
    let out = Command::new("timeout")
        .args(["300", "python3"])
        .arg(&script)
        .args([&server.addr, &publish, &replay, "16"])
        .output()
        .expect("start python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("kv events: ok"),
        "{} failed ({}); it needs `pip install -r tests/reference/requirements.txt` (pyzmq, msgpack)\n{stdout}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_endpoint_that_cannot_be_bound_stops_start_up_naming_it() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", taken.local_addr().unwrap());
    let out = Command::new(e2e::host_bin())
        .arg("--model")
        .arg(e2e::default_model())
        .args(["serve", "--host", "127.0.0.1", "--port", "0", "--set"])
        .arg("kv_events.enable_kv_cache_events=true")
        .arg("--set")
        .arg(format!("kv_events.endpoint={endpoint:?}"))
        .output()
        .expect("run host serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("kv_events.endpoint") && stderr.contains(&endpoint),
        "{stderr}"
    );
}
