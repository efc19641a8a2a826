//! The `X-Request-Id` header: a client's name for its request, which names
//! the answer ([`super::AppState::answer_id`]), and, with
//! `server.enable_request_id_headers` (vLLM's `--enable-request-id-headers`),
//! comes back on every response so a client or a proxy can match the two.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;

/// The header a client names its request in (vLLM reads the same).
pub const HEADER: &str = "x-request-id";

/// The middleware (installed only with `server.enable_request_id_headers`):
/// every response carries the request's `X-Request-Id`, or a fresh id of the
/// server's own when it sent none, as vLLM's middleware does.
pub async fn echo(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let id = req.headers().get(HEADER).cloned().or_else(|| {
        // Ids of the server's own are ASCII letters, digits and dashes.
        HeaderValue::try_from(app.next_request_id("req")).ok()
    });
    let mut response = next.run(req).await;
    if let Some(id) = id {
        response.headers_mut().insert(HEADER, id);
    }
    response
}
