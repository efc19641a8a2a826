//! `ApiError`: every failure a request can meet, answered with the HTTP
//! status and the OpenAI-style body (`{"error": {message, type, param,
//! code}}`) clients know how to read.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::protocol::{ErrorInfo, ErrorResponse};
use crate::engine::EngineCoreError;

/// A failed request: the status, a message naming what was wrong and how to
/// fix it, and the request field to blame (if one is).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong.
    pub message: String,
    /// The request field to blame.
    pub param: Option<String>,
}

impl ApiError {
    /// 400: the request is wrong; `param` names the field.
    pub fn bad_request(param: impl Into<Option<String>>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.into(),
        }
    }

    /// 400 blaming `field`, with a message that starts with the field's name.
    pub fn field(field: &str, message: impl std::fmt::Display) -> ApiError {
        ApiError::bad_request(Some(field.to_string()), format!("`{field}`: {message}"))
    }

    /// 503: the engine cannot serve (dead or shutting down).
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
        }
    }

    /// 429: the server is at `server.max_waiting_requests`; the client
    /// should retry after the `Retry-After` the response carries.
    pub fn too_many_requests(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            param: None,
        }
    }

    /// 500: the server itself failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    /// Any other status.
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// vLLM's error type name for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::FORBIDDEN => "PermissionDeniedError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
            StatusCode::REQUEST_TIMEOUT => "RequestTimeoutError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestTooLargeError",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "UnsupportedMediaTypeError",
            StatusCode::MISDIRECTED_REQUEST => "MisdirectedRequestError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: ErrorInfo {
                message: self.message.clone(),
                kind: self.kind().to_string(),
                param: self.param.clone(),
                code: self.status.as_u16(),
            },
        }
    }
}

impl From<EngineCoreError> for ApiError {
    fn from(e: EngineCoreError) -> ApiError {
        match e {
            EngineCoreError::Rejected(msg) => ApiError::bad_request(None, msg),
            EngineCoreError::Dead(msg) => {
                ApiError::unavailable(format!("the engine is dead: {msg}"))
            }
            EngineCoreError::Utility(msg) => ApiError::bad_request(None, msg),
            EngineCoreError::Unavailable(msg) => ApiError::unavailable(msg),
        }
    }
}

/// Seconds a refused client is told to wait (`Retry-After`) on a 429 or a
/// 503: overload and a dying or draining engine both pass within seconds,
/// and a short hint keeps well-behaved clients from hammering meanwhile.
pub const RETRY_AFTER_S: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped() {
        let e = ApiError::field("max_tokens", "must be at least 1, got 0");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(v["error"]["param"], "max_tokens");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(
            v["error"]["message"],
            "`max_tokens`: must be at least 1, got 0"
        );
    }

    #[test]
    fn overload_is_a_429_with_retry_after() {
        let e = ApiError::too_many_requests("full");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(v["error"]["type"], "RateLimitError");
        assert_eq!(v["error"]["code"], 429);
        let response = e.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let ok = ApiError::field("n", "x").into_response();
        assert!(!ok.headers().contains_key(header::RETRY_AFTER));
    }

    #[test]
    fn engine_errors_map_to_statuses() {
        assert_eq!(
            ApiError::from(EngineCoreError::Dead("x".into())).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ApiError::from(EngineCoreError::Rejected("x".into())).status,
            StatusCode::BAD_REQUEST
        );
        // A call an engine-core restart interrupted is the server's
        // trouble, and passes: not the caller's mistake.
        assert_eq!(
            ApiError::from(EngineCoreError::Unavailable("x".into())).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
