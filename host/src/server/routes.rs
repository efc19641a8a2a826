//! The router and the small endpoints: `/health`, `/metrics`, `/v1/models`,
//! `/version`; the opt-in development endpoints are in `admin.rs`, the
//! web page at `/` in `web.rs`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};

use super::error::ApiError;
use super::protocol::{ModelCard, ModelList, ModelPermission};
use super::{
    admin, auth, chat, completions, guard, plugins, request_id, responses, tokenize, web, AppState,
};

/// Every route, the API key check on the `/v1` ones, `Content-Type` on
/// those that take JSON, the body limit, CORS when configured, the `Host`
/// check for a server listening on `local`, and `X-Request-Id` on every
/// response when configured.
pub fn router(app: Arc<AppState>, local: SocketAddr) -> Router {
    let mut json = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/responses", post(responses::create))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize));
    let mut guarded = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/plugins", get(plugins::list))
        .route("/version", get(version))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel));
    if app.config.enable_rpc_endpoint {
        json = json.route("/collective_rpc", post(admin::collective_rpc));
        guarded = guarded
            .route("/sleep", post(admin::sleep))
            .route("/wake_up", post(admin::wake_up))
            .route("/is_sleeping", get(admin::is_sleeping))
            .route("/reset_prefix_cache", post(admin::reset_prefix_cache));
    }
    // Set on each router before its layers: a layered route no longer takes
    // a method fallback.
    let json = json
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(middleware::from_fn_with_state(
            Arc::new(app.config.clone()),
            guard::require_json,
        ));
    let guarded = guarded
        .method_not_allowed_fallback(method_not_allowed)
        .merge(json)
        .layer(middleware::from_fn_with_state(
            app.clone(),
            auth::require_api_key,
        ));
    let mut router = web::routes()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(app.config.max_body_bytes));
    // Outside the API key check: a browser's preflight carries no key.
    if let Some(cors) = guard::CorsPolicy::new(&app.config) {
        router = router.layer(middleware::from_fn_with_state(Arc::new(cors), guard::cors));
    }
    let hosts = Arc::new(guard::HostPolicy::new(&app.config, local));
    router = router.layer(middleware::from_fn_with_state(hosts, guard::check_host));
    // Outermost: every response carries the header, refusals included.
    if app.config.enable_request_id_headers {
        router = router.layer(middleware::from_fn_with_state(
            app.clone(),
            request_id::echo,
        ));
    }
    router.with_state(app)
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
    let text = app.metrics.render(&app.client.stats_by_rank());
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
            root: app.model_root.clone(),
            parent: None,
            max_model_len: app.client.max_model_len(),
            permission: vec![ModelPermission::for_model(&app.model_name, app.created)],
        }],
    })
}

/// `GET /version`: the server's version, as vLLM answers it.
async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn not_found() -> ApiError {
    ApiError::with_status(
        StatusCode::NOT_FOUND,
        "no such route; this server answers /v1/completions, /v1/chat/completions, /v1/responses, \
         /v1/models, /v1/plugins, /tokenize, /detokenize, /version, /health, /metrics and the web \
         page at /",
    )
}

/// A known route called with a method it does not answer: the OpenAI error
/// body, not axum's empty one, so clients read why.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::with_status(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not answer {method}; see the API reference for its method",
            uri.path()
        ),
    )
}
