//! What crosses the message queues between an executor and its workers
//! (vLLM's `(method, args, kwargs, output_rank)` request and
//! `(ResponseStatus, payload)` reply), as postcard-encodable serde types.
//!
//! Arguments and results are one [`RpcValue`]: a typed variant for every
//! built-in method, so the per-step messages (`execute_model`'s
//! `SchedulerOutput`, `sample_tokens`' `ModelRunnerOutput`) are encoded once,
//! compactly, straight into the ring; and a JSON variant for everything
//! else (worker extensions registered by plugins), whose shapes the host
//! cannot know at compile time. postcard cannot carry `serde_json::Value`
//! itself (it is self-describing only through `deserialize_any`), so JSON
//! travels as text. `host/benches/rpc.rs` measures both encodings of a
//! step's `SchedulerOutput`.

use serde::{Deserialize, Serialize};

use super::{ModelRunnerOutput, SchedulerOutput};

/// An argument or result of a worker method.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum RpcValue {
    /// Nothing (vLLM's `None`).
    #[default]
    Unit,
    /// A count: bytes, blocks, tokens.
    Count(u64),
    /// One step's schedule (`execute_model`'s argument).
    SchedulerOutput(Box<SchedulerOutput>),
    /// One step's sampled tokens (`sample_tokens`' result).
    ModelRunnerOutput(Box<ModelRunnerOutput>),
    /// Any JSON value, as text (worker-extension methods).
    Json(String),
}

impl RpcValue {
    /// The variant's name, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            RpcValue::Unit => "Unit",
            RpcValue::Count(_) => "Count",
            RpcValue::SchedulerOutput(_) => "SchedulerOutput",
            RpcValue::ModelRunnerOutput(_) => "ModelRunnerOutput",
            RpcValue::Json(_) => "Json",
        }
    }

    /// The count, or an error naming `what` expected one.
    pub fn into_count(self, what: &str) -> Result<u64, String> {
        match self {
            RpcValue::Count(n) => Ok(n),
            other => Err(format!("{what} expects a Count, got {}", other.kind())),
        }
    }

    /// The sampled tokens, or an error naming `what` expected them.
    pub fn into_model_runner_output(self, what: &str) -> Result<ModelRunnerOutput, String> {
        match self {
            RpcValue::ModelRunnerOutput(out) => Ok(*out),
            RpcValue::Unit => Ok(ModelRunnerOutput::default()),
            other => Err(format!(
                "{what} expects a ModelRunnerOutput, got {}",
                other.kind()
            )),
        }
    }
}

/// One call, broadcast to every worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RpcRequest {
    /// The method's registered name.
    pub method: String,
    /// Its argument.
    pub args: RpcValue,
    /// The only rank that replies, or `None` for every rank.
    pub output_rank: Option<u32>,
}

/// A worker's answer to one call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RpcReply {
    /// The method returned this.
    Success(RpcValue),
    /// The method failed; the message says why (the worker carries on).
    Failure(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message_queue::{decode, encode};

    #[test]
    fn every_variant_round_trips_through_the_queue_codec() {
        let so = SchedulerOutput {
            step_id: 7,
            total_num_scheduled_tokens: 3,
            ..Default::default()
        };
        let values = [
            RpcValue::Unit,
            RpcValue::Count(u64::MAX),
            RpcValue::SchedulerOutput(Box::new(so)),
            RpcValue::ModelRunnerOutput(Box::default()),
            RpcValue::Json(r#"{"a":[1,2]}"#.into()),
        ];
        for args in values {
            let req = RpcRequest {
                method: "m".into(),
                args,
                output_rank: Some(0),
            };
            assert_eq!(decode::<RpcRequest>(&encode(&req).unwrap()).unwrap(), req);
            let reply = RpcReply::Success(req.args);
            assert_eq!(decode::<RpcReply>(&encode(&reply).unwrap()).unwrap(), reply);
        }
    }

    #[test]
    fn a_wrong_variant_is_an_error_naming_both_kinds() {
        let err = RpcValue::Json("1".into())
            .into_count("initialize_from_config")
            .unwrap_err();
        assert!(
            err.contains("initialize_from_config") && err.contains("Count") && err.contains("Json"),
            "{err}"
        );
    }
}
