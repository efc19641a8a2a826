//! The engine core in its own process (as in vLLM, where the API server and
//! the engine core are separate processes): the wire messages, the process
//! side (the hidden `host engine-core` command) and the client side.
//!
//! Two shared-memory [`MessageQueue`](crate::message_queue::MessageQueue)s
//! carry the traffic: the client writes [`ClientMessage`]s, the engine core
//! writes [`CoreMessage`]s. The start-up handshake uses the child's standard
//! streams, as the `mp` executor's workers do: stdin brings one JSON line
//! ([`Bootstrap`]) and then serves as the death pipe (end-of-file: the
//! client is gone, the engine core exits); stdout carries one JSON line
//! ([`Ready`]). A crash of the engine-core process is noticed by the client's
//! supervisor thread, which starts a new process and replays every
//! unfinished request there (within `[engine]`'s restart budget), or else
//! ends every stream with the engine-dead sentinel.
//!
//! `launch` starts one process; `client_side` is the client's transport;
//! `supervisor` its supervisor and reader threads; `replay` what a request
//! needs to resume in a new process; `core_side` the process. A
//! data-parallel rank may run on another machine instead: `remote` is the
//! API server's side of that (the queues then run over TCP), `headless`
//! the other machine's, and `process` what both kinds of process have in
//! common for the client.

mod affinity;
mod client_side;
mod core_side;
mod headless;
mod launch;
mod process;
mod remote;
mod replay;
mod supervisor;

use serde::{Deserialize, Serialize};

use super::core::{EngineCoreOutput, EngineCoreRequest, EngineStats};
use crate::kv_cache::KvCacheEvent;
use crate::message_queue::Handle;

pub use client_side::ProcessTransport;
pub use core_side::run;
pub use headless::run as run_headless_engines;
pub(crate) use launch::Launcher;
pub(crate) use remote::RemoteEngines;
pub(crate) use replay::Replay;

/// How often the API server replaced a dead engine-core process, for the
/// metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCoreRestarts {
    /// Engine-core processes started to replace a dead one.
    pub restarts: u64,
    /// Unfinished requests resubmitted to them with their output so far.
    pub replayed_requests: u64,
}

/// What the client sends the engine-core process on its stdin.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Bootstrap {
    /// The engine configuration, as TOML.
    pub config_toml: String,
    /// The queue the client writes its messages to.
    pub input_handle: Handle,
    /// Where the engine core's output queue listens for a client on another
    /// machine (the address that machine reached the client from); `None`
    /// for a client on this machine, which reads it from shared memory.
    #[serde(default)]
    pub output_bind: Option<String>,
}

/// What the engine-core process answers on its stdout once started.
// One value per start-up, serialized once and never stored in bulk: the size
// difference between the variants costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Ready {
    /// Started; the client reads outputs from this queue.
    Ready {
        /// The engine core's output queue.
        output_handle: Handle,
        /// The longest context a request may have.
        max_model_len: usize,
        /// The counters before any request.
        stats: EngineStats,
    },
    /// Start-up failed (the reason); the process exits.
    Failed(String),
}

/// A message from the client to the engine core.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ClientMessage {
    /// ADD (boxed: a request is far larger than the other messages).
    Add(Box<EngineCoreRequest>),
    /// ABORT.
    Abort(Vec<String>),
    /// UTILITY: the arguments as JSON text (the binary format cannot carry
    /// a free-form value).
    Utility {
        /// Matches the answer to the call.
        call_id: u64,
        /// The engine method.
        method: String,
        /// Its arguments, as JSON.
        args_json: String,
    },
    /// Stop, draining or aborting.
    Shutdown {
        /// Drain rather than abort.
        drain: bool,
    },
}

/// A message from the engine core to the client.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum CoreMessage {
    /// One step's outputs, the counters after it (boxed: they dwarf the
    /// other messages) and the prefix cache's events for a data-parallel
    /// router.
    Step(Vec<EngineCoreOutput>, Box<EngineStats>, Vec<KvCacheEvent>),
    /// A request the scheduler refused.
    Rejected {
        /// The request (the engine core's id for it).
        request_id: String,
        /// Why.
        reason: String,
    },
    /// A utility call's answer: the result as JSON text, or the error.
    Utility {
        /// The call.
        call_id: u64,
        /// The result.
        result: Result<String, String>,
    },
    /// The engine died (the reason); the process exits non-zero.
    Dead(String),
}
