//! `host`: a vLLM V1-style LLM inference engine in Rust whose scheduling
//! policies, samplers and worker extensions are WebAssembly components.
//!
//! The modules follow vLLM's nouns; see `docs/ARCHITECTURE.md` for the map.
//! Dependency direction: cli → server → engine → {scheduler, kv_cache,
//! executor} → worker → model runner → kernels, with `config`, `step`,
//! `message_queue` and `sampling` as leaves; `host/tests/layering.rs`
//! enforces it (the table of what each module may import is there).

pub mod cli;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod distributed;
pub mod engine;
pub mod kernels;
pub mod kv_cache;
pub mod message_queue;
pub mod model;
pub mod model_runner;
pub mod plugins;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod step;
pub mod tokenizer;
pub mod worker;
