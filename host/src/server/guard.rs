//! What a browser could abuse, refused before a handler runs:
//!
//! - `Host` (DNS rebinding): a page on an attacker's domain whose name is
//!   re-pointed at 127.0.0.1 reaches a loopback server with its own name in
//!   `Host`; while the server listens on a loopback address it answers only
//!   loopback names, the listening address and `server.allowed_hosts`
//!   (421 otherwise). On other addresses the check is off unless
//!   `server.allowed_hosts` is set.
//! - `Content-Type`: the JSON endpoints take `application/json` only (415
//!   otherwise). A cross-site form can post `text/plain` or
//!   `application/x-www-form-urlencoded` without a CORS preflight, and a
//!   `fetch` with a binary body can post with no `Content-Type` at all, so
//!   a missing one is refused too; every real client (the `openai` SDKs,
//!   the README's curl lines) sends `application/json`. Their whole body
//!   must then arrive within `server.body_read_timeout_s` (408 otherwise),
//!   so a body that trickles in cannot hold a connection.
//! - CORS: off unless `server.cors_allowed_origins` is set, so pages on
//!   other sites cannot read answers; when set, preflights from the listed
//!   origins are answered and their responses carry
//!   `Access-Control-Allow-Origin`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::config::ServerConfig;

/// Which `Host` names the server answers.
pub struct HostPolicy {
    /// Off when listening on a non-loopback address with no
    /// `allowed_hosts`, or with `allowed_hosts = ["*"]`.
    enforce: bool,
    /// `server.allowed_hosts`, lower-cased.
    allowed: Vec<String>,
    /// The address the server listens on.
    listen: IpAddr,
}

impl HostPolicy {
    /// The policy for a server configured by `config` listening on `local`.
    pub fn new(config: &ServerConfig, local: SocketAddr) -> HostPolicy {
        let allowed: Vec<String> = config
            .allowed_hosts
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .collect();
        let any = allowed.iter().any(|h| h == "*");
        HostPolicy {
            enforce: !any && (local.ip().is_loopback() || !allowed.is_empty()),
            allowed,
            listen: local.ip(),
        }
    }

    /// Whether a request with this `Host` value is answered.
    pub fn allows(&self, host: &str) -> bool {
        if !self.enforce {
            return true;
        }
        let host = host.trim().to_ascii_lowercase();
        let name = host_name(&host);
        let name = name.strip_suffix('.').unwrap_or(name);
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if let Ok(ip) = name.parse::<IpAddr>() {
            if ip.is_loopback() || ip == self.listen {
                return true;
            }
        }
        self.allowed.iter().any(|a| a == name || *a == host)
    }
}

/// The name part of a `Host` value: without the port, and without the
/// brackets of an IPv6 literal.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        // One colon: a name and a port; more: a bare IPv6 literal.
        Some((name, _port)) if !name.contains(':') => name,
        _ => host,
    }
}

/// The middleware: 421 for a `Host` the policy refuses. A request without
/// one (HTTP/1.0) passes: browsers always send it, so no page can use its
/// absence.
pub async fn check_host(
    State(policy): State<Arc<HostPolicy>>,
    req: Request,
    next: Next,
) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|v| v.to_str().map(str::to_string))
        .or_else(|| req.uri().authority().map(|a| Ok(a.to_string())));
    match host {
        None => next.run(req).await,
        Some(Ok(host)) if policy.allows(&host) => next.run(req).await,
        Some(host) => {
            let shown = host.unwrap_or_else(|_| "<not text>".into());
            ApiError::with_status(
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "this server does not answer for the host `{shown}` (protection against DNS \
                     rebinding): it answers localhost, 127.0.0.1, [::1], its listening address \
                     and the names in server.allowed_hosts; add `{name}` there \
                     (`--set 'server.allowed_hosts=[\"{name}\"]'`), or [\"*\"] to accept any",
                    name = host_name(&shown)
                ),
            )
            .into_response()
        }
    }
}

/// The middleware on the JSON endpoints: 415 unless the body is declared
/// `application/json` (parameters such as `charset=utf-8` allowed; JSON is
/// UTF-8, so another charset is refused too); then the whole body is read
/// within `server.body_read_timeout_s` (408 past it, 413 past
/// `server.max_body_bytes`), so a body that trickles in cannot hold its
/// connection, and the handler gets it already read.
pub async fn require_json(
    State(config): State<Arc<ServerConfig>>,
    req: Request,
    next: Next,
) -> Response {
    if let Err(message) = json_content_type(req.headers()) {
        return ApiError::with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE, message).into_response();
    }
    let (parts, body) = req.into_parts();
    let deadline = Duration::try_from_secs_f64(config.body_read_timeout_s).unwrap_or(Duration::MAX);
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, config.max_body_bytes)).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Ok(Err(_)) => ApiError::with_status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than this server's limit of {} bytes (its `server.max_body_bytes`), or was cut off",
                config.max_body_bytes
            ),
        )
        .into_response(),
        Err(_) => ApiError::with_status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {:?} (this server's `server.body_read_timeout_s`); send it whole",
                deadline
            ),
        )
        .into_response(),
    }
}

fn json_content_type(headers: &HeaderMap) -> Result<(), String> {
    let fix = "send the body as JSON with `Content-Type: application/json`";
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Err(format!("the request has no Content-Type; {fix}"));
    };
    let Ok(value) = value.to_str() else {
        return Err(format!("the Content-Type is not text; {fix}"));
    };
    let mut parts = value.split(';').map(str::trim);
    let media_type = parts.next().unwrap_or_default();
    if !media_type.eq_ignore_ascii_case("application/json") {
        return Err(format!("Content-Type `{value}` is not supported; {fix}"));
    }
    for param in parts {
        if let Some((name, charset)) = param.split_once('=') {
            let charset = charset.trim().trim_matches('"');
            if name.trim().eq_ignore_ascii_case("charset")
                && !charset.eq_ignore_ascii_case("utf-8")
                && !charset.eq_ignore_ascii_case("utf8")
            {
                return Err(format!(
                    "Content-Type `{value}`: JSON bodies must be UTF-8; {fix}"
                ));
            }
        }
    }
    Ok(())
}

/// The origins whose pages may call the API (`server.cors_allowed_origins`).
pub struct CorsPolicy {
    any: bool,
    origins: Vec<String>,
}

/// How long a browser may cache a preflight's answer, in seconds.
const PREFLIGHT_MAX_AGE_S: u32 = 600;

impl CorsPolicy {
    /// The policy for `server.cors_allowed_origins`; `None` when it is
    /// empty (CORS off: no headers, no preflight answers).
    pub fn new(config: &ServerConfig) -> Option<CorsPolicy> {
        if config.cors_allowed_origins.is_empty() {
            return None;
        }
        let origins: Vec<String> = config
            .cors_allowed_origins
            .iter()
            .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
            .collect();
        Some(CorsPolicy {
            any: origins.iter().any(|o| o == "*"),
            origins,
        })
    }

    /// The `Access-Control-Allow-Origin` value for a page from `origin`,
    /// if it is allowed.
    fn allow_origin(&self, origin: &str) -> Option<HeaderValue> {
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        let wanted = origin.trim_end_matches('/').to_ascii_lowercase();
        self.origins
            .contains(&wanted)
            .then(|| HeaderValue::from_str(origin).ok())
            .flatten()
    }
}

/// The middleware (installed only when CORS is on): answers preflights and
/// marks the responses to allowed origins.
pub async fn cors(State(policy): State<Arc<CorsPolicy>>, req: Request, next: Next) -> Response {
    let Some(origin) = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return next.run(req).await;
    };
    let allowed = policy.allow_origin(&origin);
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let Some(allowed) = allowed else {
            return ApiError::with_status(
                StatusCode::FORBIDDEN,
                format!(
                    "the origin `{origin}` may not call this server; add it to \
                     server.cors_allowed_origins"
                ),
            )
            .into_response();
        };
        let requested = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or(HeaderValue::from_static("authorization, content-type"));
        let mut response = StatusCode::NO_CONTENT.into_response();
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, requested);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from(PREFLIGHT_MAX_AGE_S),
        );
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        return response;
    }
    let mut response = next.run(req).await;
    if let Some(allowed) = allowed {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allowed);
        // A client told to back off can read for how long.
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("retry-after"),
        );
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(listen: &str, allowed: &[&str]) -> HostPolicy {
        let config = ServerConfig {
            allowed_hosts: allowed.iter().map(|s| s.to_string()).collect(),
            ..ServerConfig::default()
        };
        HostPolicy::new(&config, listen.parse().unwrap())
    }

    #[test]
    fn a_loopback_server_answers_loopback_names_only() {
        let p = policy("127.0.0.1:8000", &[]);
        for ok in [
            "localhost",
            "LOCALHOST:8000",
            "127.0.0.1",
            "127.0.0.1:8000",
            "[::1]",
            "[::1]:8000",
            "127.0.0.2:1",
            "localhost.",
        ] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8000",
            "10.0.0.1:8000",
            "localhost.evil.example",
            "[::2]:80",
        ] {
            assert!(!p.allows(bad), "{bad}");
        }
    }

    #[test]
    fn allowed_hosts_widen_and_star_disables() {
        let p = policy("127.0.0.1:8000", &["Box.Lan"]);
        assert!(p.allows("box.lan:8000") && p.allows("BOX.LAN"));
        assert!(!p.allows("other.lan"));
        assert!(policy("127.0.0.1:8000", &["*"]).allows("anything.example"));
    }

    #[test]
    fn a_public_server_checks_only_when_told() {
        assert!(policy("0.0.0.0:8000", &[]).allows("api.example.com"));
        let p = policy("192.168.1.5:8000", &["api.example.com"]);
        assert!(p.allows("api.example.com:8000"));
        assert!(p.allows("192.168.1.5:8000"), "its own address");
        assert!(!p.allows("evil.example"));
    }

    fn content_type(value: Option<&str>) -> Result<(), String> {
        let mut headers = HeaderMap::new();
        if let Some(v) = value {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_str(v).unwrap());
        }
        json_content_type(&headers)
    }

    #[test]
    fn only_json_bodies_pass() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/json;charset=\"UTF-8\"",
        ] {
            assert_eq!(content_type(Some(ok)), Ok(()), "{ok}");
        }
        for bad in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/json; charset=latin1"),
            Some("application/jsonx"),
        ] {
            let e = content_type(bad).expect_err(&format!("{bad:?}"));
            assert!(e.contains("Content-Type: application/json"), "{e}");
        }
    }

    #[test]
    fn cors_allows_listed_origins() {
        let config = ServerConfig {
            cors_allowed_origins: vec!["https://app.example/".into()],
            ..ServerConfig::default()
        };
        let p = CorsPolicy::new(&config).unwrap();
        assert_eq!(
            p.allow_origin("https://app.example").unwrap(),
            "https://app.example"
        );
        assert!(p.allow_origin("https://evil.example").is_none());
        assert!(CorsPolicy::new(&ServerConfig::default()).is_none());
    }
}
