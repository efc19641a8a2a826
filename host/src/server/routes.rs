//! The router and the small endpoints: `/health`, `/metrics`, `/v1/models`;
//! the opt-in development endpoints are in `admin.rs`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};

use super::error::ApiError;
use super::protocol::{ModelCard, ModelList};
use super::{admin, auth, chat, completions, AppState};

/// Every route, the API key check on the `/v1` ones and the body limit.
pub fn router(app: Arc<AppState>) -> Router {
    let mut guarded = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models));
    if app.config.enable_rpc_endpoint {
        guarded = guarded
            .route("/collective_rpc", post(admin::collective_rpc))
            .route("/sleep", post(admin::sleep))
            .route("/wake_up", post(admin::wake_up))
            .route("/is_sleeping", get(admin::is_sleeping))
            .route("/reset_prefix_cache", post(admin::reset_prefix_cache));
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
