//! `--api-key`: the `/v1/*` routes answer 401 unless the request carries
//! `Authorization: Bearer <key>` (as vLLM's `--api-key` does; `/health`
//! and `/metrics` stay open for probes and scrapers).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::AppState;

/// The middleware; a no-op when no key is configured.
pub async fn require_api_key(
    State(app): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(key) = app.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if constant_time_eq(given.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => unauthorized("the API key is wrong"),
        None => unauthorized(
            "missing `Authorization: Bearer <api key>` header; this server requires an API key",
        ),
    }
}

fn unauthorized(message: &str) -> Response {
    ApiError::with_status(StatusCode::UNAUTHORIZED, message).into_response()
}

/// Compares without an early exit, so the time taken does not tell how many
/// leading bytes of a guess were right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
