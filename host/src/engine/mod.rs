//! The engine: the engine core (scheduler + executor, stepped together), the
//! executors that reach the workers, start-up, and the offline API.

mod core;
mod executor;
mod llm;
pub mod startup;

pub use self::core::{EngineCore, EngineCoreOutput, EngineCoreRequest, EngineError, EngineStats, StepTimings};
pub use executor::{executor_for, Executor, ExecutorError, MultiprocExecutor, RpcFuture, UniProcExecutor};
pub use llm::{Completion, Finish, GenerateRequest, Llm, Prompt};
