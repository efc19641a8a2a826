//! The engine: the engine core (scheduler + executor, stepped together), the
//! engine-core threads and their client, the executors that reach the
//! workers, start-up, the frontend's per-request text path, and the offline
//! API.

mod client;
mod core;
mod core_proc;
pub mod dp_router;
mod executor;
pub mod ipc;
pub mod kv_events;
mod llm;
mod output_processor;
pub mod restart;
mod shared;
pub mod startup;

pub use self::core::{
    EngineCore, EngineCoreOutput, EngineCoreRequest, EngineError, EngineStats, StepTimings,
    UTILITY_METHODS,
};
// The parts of `EngineStats`, so a frontend reads them from the engine
// without reaching into the scheduler or the KV cache.
pub use crate::{
    kv_cache::PrefixCacheStats,
    scheduler::{CacheConfigInfo, PredictionTokens, SchedulerStats, SpecDecodingStats},
};
pub use client::{EngineCoreClient, EngineCoreError, OutputStream};
pub use executor::{
    executor_for, run_headless_node, Executor, ExecutorError, MultiprocExecutor, RpcFuture,
    StepFuture, UniProcExecutor,
};
pub use llm::{Completion, GenerateRequest, Llm, Prompt};
pub use output_processor::{Delta, Finish, RequestMetrics, RequestState};
