//! `GET /v1/plugins`: the plugins this server knows, by qualified name and
//! kind, and which of them the configuration puts to use (read-only). The
//! list is built once at start-up by the command that starts the server
//! (`cli/plugins_in_use.rs`): the server does not load plugins itself.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::Value;

use super::AppState;

/// `GET /v1/plugins`: `{"object": "list", "data": [{name, version, kind,
/// builtin, used_as}]}`, where `used_as` names the config key that puts
/// the plugin to use (`null` for one only known).
pub async fn list(State(app): State<Arc<AppState>>) -> Json<Value> {
    Json(app.plugins.clone())
}
