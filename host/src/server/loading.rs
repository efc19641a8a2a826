//! While the model loads: every connection to the already-bound port is
//! answered 503 ("the model is loading", with `Retry-After`), so a
//! readiness probe (`/health`) or an early client gets an answer instead of
//! a connection that hangs until the engine is up. The listener is handed
//! back once the engine is ready, and the real server takes over.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use super::error::{ApiError, RETRY_AFTER_S};

/// How long a loading answer waits for the request's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of the request read before answering.
const HEAD_LIMIT: usize = 8 << 10;

/// Answers 503 on `listener` until `ready` fires (or its sender is gone);
/// returns the listener.
pub async fn answer_while_loading(
    listener: TcpListener,
    mut ready: oneshot::Receiver<()>,
) -> TcpListener {
    loop {
        tokio::select! {
            _ = &mut ready => return listener,
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    tokio::spawn(answer(stream));
                }
            }
        }
    }
}

/// Reads the request's head (bounded in size and time) and answers 503.
async fn answer(mut stream: TcpStream) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read_head = async {
        while head.len() < HEAD_LIMIT && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(HEAD_TIMEOUT, read_head).await;
    let body =
        serde_json::to_string(&ApiError::unavailable("the model is loading; retry shortly").body())
            .unwrap_or_default();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: {RETRY_AFTER_S}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}
