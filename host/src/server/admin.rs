//! The development endpoints, served only with
//! `server.enable_rpc_endpoint = true` (vLLM serves them in its dev mode):
//! `POST /collective_rpc`, `POST /sleep?level=1`, `POST /wake_up` (with
//! `?tags=weights&tags=kv_cache`, default all), `GET /is_sleeping` and
//! `POST /reset_prefix_cache`. Each is one utility call on the engine core.
//! While the engine sleeps, completions wait and run after `wake_up`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{params, AppState};

/// Runs the utility call `method` off the async runtime (it waits for the
/// engine core's reply).
async fn utility(app: &AppState, method: &'static str, args: Value) -> Result<Value, ApiError> {
    app.check_serving()?;
    let client = app.client.clone();
    tokio::task::spawn_blocking(move || client.call_utility(method, args))
        .await
        .map_err(|e| ApiError::internal(format!("the {method} call panicked: {e}")))?
        .map_err(ApiError::from)
}

/// `POST /collective_rpc`'s body.
#[derive(Deserialize)]
struct RpcRequest {
    /// A worker method or a worker extension's namespaced method.
    method: String,
    /// Its arguments, passed through as JSON.
    #[serde(default)]
    args: Value,
}

/// Calls a method on every worker (vLLM's `collective_rpc` endpoint) and
/// answers `{"results": ...}`.
pub async fn collective_rpc(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let body = super::request_object(body)?;
        let req: RpcRequest = params::typed(&body)?;
        let args = json!({"method": req.method, "args": req.args});
        let results = utility(&app, "collective_rpc", args).await?;
        Ok::<_, ApiError>(Json(json!({ "results": results })).into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// The values of `key` in a query string (`tags=a&tags=b`).
fn query_values(query: Option<&str>, key: &str) -> Vec<String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
        .collect()
}

/// Puts the workers to sleep at `?level=` (1 by default).
pub async fn sleep(State(app): State<Arc<AppState>>, RawQuery(query): RawQuery) -> Response {
    let run = async {
        let level = match query_values(query.as_deref(), "level").as_slice() {
            [] => 1,
            [one] => one.parse::<u64>().map_err(|_| {
                ApiError::bad_request(
                    Some("level".to_string()),
                    format!("level must be 1 or 2, got `{one}`"),
                )
            })?,
            _ => {
                return Err(ApiError::bad_request(
                    Some("level".to_string()),
                    "give level once, e.g. /sleep?level=1",
                ))
            }
        };
        utility(&app, "sleep", json!(level)).await?;
        Ok::<_, ApiError>(Json(json!({ "is_sleeping": true })).into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// Wakes the `?tags=` given (all when none).
pub async fn wake_up(State(app): State<Arc<AppState>>, RawQuery(query): RawQuery) -> Response {
    let run = async {
        let tags = query_values(query.as_deref(), "tags");
        let args = if tags.is_empty() {
            Value::Null
        } else {
            json!(tags)
        };
        utility(&app, "wake_up", args).await?;
        let sleeping = utility(&app, "is_sleeping", Value::Null).await?;
        Ok::<_, ApiError>(Json(json!({ "is_sleeping": sleeping })).into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `{"is_sleeping": bool}`.
pub async fn is_sleeping(State(app): State<Arc<AppState>>) -> Response {
    match utility(&app, "is_sleeping", Value::Null).await {
        Ok(sleeping) => Json(json!({ "is_sleeping": sleeping })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Forgets every cached prefix.
pub async fn reset_prefix_cache(State(app): State<Arc<AppState>>) -> Response {
    match utility(&app, "reset_prefix_cache", Value::Null).await {
        Ok(_) => Json(json!({ "reset": true })).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_collect_every_repeat() {
        let q = Some("tags=weights&level=2&tags=kv_cache");
        assert_eq!(query_values(q, "tags"), ["weights", "kv_cache"]);
        assert_eq!(query_values(q, "level"), ["2"]);
        assert!(query_values(None, "tags").is_empty());
    }
}
