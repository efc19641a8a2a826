//! `logit_bias`, `allowed_token_ids` and `bad_words` (issue 15, part 5) end
//! to end: the official `openai` client against `host serve` on the real
//! model, with the worker in the engine core's process (`uni`) and in a
//! worker process of its own (`mp`, where the sampling parameters cross a
//! shared-memory queue serialized). The checks live in
//! tests/server/logit_bias_client.py; each measures a constrained answer
//! against the same server's unconstrained greedy one.

use crate::harness;

use harness::Server;
use serde_json::json;

/// SmolLM2-135M's vocabulary size (its model card): ids from it up are
/// refused.
const VOCAB_SIZE: usize = 49152;

#[test]
fn token_filters_through_the_openai_client_uni_and_mp() {
    let expected = json!({ "vocab_size": VOCAB_SIZE });
    for backend in ["uni", "mp"] {
        let executor = format!("parallel.distributed_executor_backend={backend}");
        let server = Server::start(&["--api-key", "sesame", "--set", &executor]);
        server.run_openai_script("logit_bias_client.py", &expected);
    }
}
