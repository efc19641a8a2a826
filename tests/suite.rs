//! The end-to-end suite: one module per test file (see Cargo.toml for the
//! few that keep a process of their own). Run one file's tests with its
//! module name as the filter: `cargo test --workspace --test suite server_fuzz::`.

#[path = "server/harness.rs"]
mod harness;
#[path = "server/kill.rs"]
mod kill;

mod cli;
mod data_parallel;
mod data_parallel_nodes;
mod engine;
mod gguf_corrupt;
mod kernel_families;
mod kv_events;
mod model_loaders;
mod multi_node;
mod plugin_faults_load;
mod plugin_new;
mod plugins;
mod plugins_extension;
mod plugins_grants;
mod plugins_python;
mod plugins_sampler;
mod plugins_sandbox;
mod predicted_outputs;
mod recovery;
mod reference_agreement;
mod server;
mod server_beam_search;
mod server_echo;
mod server_faults;
mod server_fuzz;
mod server_limits;
mod server_logit_bias;
mod server_openai;
mod server_overload;
mod server_responses;
mod server_structured;
mod server_tokenize;
mod server_tools;
mod server_usage;
mod server_vllm_fields;
mod server_web;
mod sleep_mode;
mod speculative;
mod tensor_parallel;
mod tokenizer_agreement;
