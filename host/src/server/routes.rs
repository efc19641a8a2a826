//! The router and the small endpoints: `/health`, `/metrics`, `/v1/models`
//! and the opt-in `/collective_rpc`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::protocol::{ModelCard, ModelList};
use super::{auth, chat, completions, params, AppState};

/// Every route, the API key check on the `/v1` ones and the body limit.
pub fn router(app: Arc<AppState>) -> Router {
    let mut guarded = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models));
    if app.config.enable_rpc_endpoint {
        guarded = guarded.route("/collective_rpc", post(collective_rpc));
    }
    let guarded = guarded.layer(middleware::from_fn_with_state(
        app.clone(),
        auth::require_api_key,
    ));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(app.config.max_body_bytes))
        .with_state(app)
}

/// 200 only while the engine core's loop is alive and the server is not
/// shutting down; 503 otherwise (so a load balancer stops sending).
async fn health(State(app): State<Arc<AppState>>) -> Response {
    match app.check_serving() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    let text = app.metrics.render(&app.client.stats());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn models(State(app): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: app.model_name.clone(),
            object: "model",
            created: app.created,
            owned_by: "host",
        }],
    })
}

async fn not_found() -> ApiError {
    ApiError::with_status(
        StatusCode::NOT_FOUND,
        "no such route; this server answers /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics",
    )
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
async fn collective_rpc(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let body = super::request_object(body)?;
        let req: RpcRequest = params::typed(&body)?;
        app.check_serving()?;
        let client = app.client.clone();
        let args = json!({"method": req.method, "args": req.args});
        let results =
            tokio::task::spawn_blocking(move || client.call_utility("collective_rpc", args))
                .await
                .map_err(|e| ApiError::internal(format!("the rpc call panicked: {e}")))??;
        Ok::<_, ApiError>(Json(json!({ "results": results })).into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}
