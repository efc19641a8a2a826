//! The engine: the engine core (scheduler + executor, stepped together), the
//! engine-core threads and their client, the executors that reach the
//! workers, start-up, the frontend's per-request text path, and the offline
//! API.

mod client;
mod core;
mod core_proc;
mod executor;
pub mod ipc;
mod llm;
mod output_processor;
mod shared;
pub mod startup;

pub use self::core::{
    EngineCore, EngineCoreOutput, EngineCoreRequest, EngineError, EngineStats, StepTimings,
    UTILITY_METHODS,
};
// The parts of `EngineStats` and `EngineCoreOutput`, so a frontend reads
// them from the engine without reaching into the scheduler, the KV cache or
// the worker (issue 17 part 1 moves `Logprobs` to a leaf of step types).
pub use crate::{kv_cache::PrefixCacheStats, scheduler::SchedulerStats, worker::Logprobs};
pub use client::{EngineCoreClient, EngineCoreError, OutputStream};
pub use executor::{
    executor_for, Executor, ExecutorError, MultiprocExecutor, RpcFuture, StepFuture,
    UniProcExecutor,
};
pub use llm::{Completion, GenerateRequest, Llm, Prompt};
pub use output_processor::{Delta, Finish, RequestMetrics, RequestState};
