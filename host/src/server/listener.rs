//! The accept loop: HTTP/1.1 connections served by hyper, with the limits
//! a public server needs and `axum::serve` does not enforce:
//!
//! - at most `server.max_connections` open at once; a connection past it is
//!   answered 503 with `Retry-After` and closed, without reading its request;
//! - `server.header_read_timeout_s` for a request's head (from the
//!   connection's start, or from the first byte after an idle spell), and
//!   `server.idle_connection_timeout_s` for a kept-alive connection with no
//!   request in flight. A connection past either is closed. While a request
//!   is in flight (its response still streaming) neither applies.
//!
//! Shutdown is graceful: once told to stop, the loop stops accepting, each
//! connection finishes the response in flight and closes, and the returned
//! future resolves when every connection is gone.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

use super::error::ApiError;
use crate::config::ServerConfig;

/// Connections past the cap being answered 503 at once, at most; past this
/// they are closed without an answer, so a flood of them costs no more
/// than a bounded number of small tasks.
const MAX_REFUSALS: usize = 64;

/// How long answering a refused connection may take, its close included.
const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// Pause after a failed `accept` (e.g. out of file descriptors), so the
/// loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The connection limits of `[server]`.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `server.max_connections`.
    pub max_connections: usize,
    /// `server.header_read_timeout_s`.
    pub header_read_timeout: Duration,
    /// `server.idle_connection_timeout_s`.
    pub idle_timeout: Duration,
}

impl Limits {
    /// The limits `config` sets (the config's validation keeps the
    /// timeouts positive and finite; anything else is clamped, never a
    /// panic).
    pub fn new(config: &ServerConfig) -> Limits {
        let seconds = |s: f64| Duration::try_from_secs_f64(s.max(0.001)).unwrap_or(Duration::MAX);
        Limits {
            max_connections: config.max_connections.max(1),
            header_read_timeout: seconds(config.header_read_timeout_s),
            idle_timeout: seconds(config.idle_connection_timeout_s),
        }
    }
}

/// Serves `router` on `listener` until `stop` turns true, then drains.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS));
    let mut connections = JoinSet::new();
    while !*stop.borrow_and_update() {
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _peer)) => stream,
                    Err(e) => {
                        tracing::warn!("accepting a connection failed: {e}");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        connections.spawn(serve_connection(stream, router.clone(), limits, stop.clone(), slot));
                    }
                    Err(_) => {
                        if let Ok(refusal) = refusals.clone().try_acquire_owned() {
                            tokio::spawn(refuse(stream, limits.max_connections, refusal));
                        }
                    }
                }
            }
            // Reaps finished connections so the set stays as small as the
            // number open.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    // New connections are refused by the system from here on.
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// One connection: hyper's HTTP/1.1 with keep-alive, closed early when a
/// timeout of [`Clock`] passes and gracefully when the server stops.
async fn serve_connection(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    // Streamed tokens go out as they come, not when a segment fills.
    let _ = stream.set_nodelay(true);
    let clock = Arc::new(Clock::new(limits));
    let io = TokioIo::new(Watched {
        inner: stream,
        clock: Arc::clone(&clock),
    });
    let service = {
        let clock = Arc::clone(&clock);
        hyper::service::service_fn(move |req: Request<Incoming>| {
            // Taken now, when hyper has the request's head, so the head's
            // deadline stops here.
            let busy = Busy::new(Arc::clone(&clock));
            let response = router.clone().call(req.map(Body::new));
            async move {
                let response: Response<Body> = match response.await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|inner| Tracked { inner, _busy: busy }))
            }
        })
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        // Both timeouts are the clock's: hyper's own would also run while
        // a kept-alive connection idles, cutting it at the head timeout.
        .header_read_timeout(None)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut draining = false;
    if *stop.borrow_and_update() {
        conn.as_mut().graceful_shutdown();
        draining = true;
    }
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            () = clock.expired() => {
                // Dropping the connection closes the socket.
                tracing::debug!("closing a connection that sent no complete request in time");
                return;
            }
            _ = stop.changed(), if !draining => {
                // Finish the response in flight, then close.
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    }
}

/// Answers a connection past `server.max_connections` with 503 without
/// reading its request, then reads what the client sent until it closes
/// (a close with unread data would reset the connection and could lose
/// the answer), all within [`REFUSAL_TIME`].
async fn refuse(mut stream: TcpStream, max_connections: usize, _refusal: OwnedSemaphorePermit) {
    let error = ApiError::unavailable(format!(
        "the server has server.max_connections = {max_connections} connections open; \
         retry later (see Retry-After), reuse a kept-alive connection, or raise the limit"
    ));
    let body = serde_json::to_string(&error.body()).unwrap_or_default();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: {}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        super::error::RETRY_AFTER_S,
        body.len()
    );
    let answer = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    };
    let _ = tokio::time::timeout(REFUSAL_TIME, answer).await;
}

/// Where a connection is, for its timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request's head: a new connection, or bytes arrived
    /// after an idle spell.
    Head,
    /// Between requests, nothing received.
    Idle,
    /// A request in flight.
    Busy,
}

#[derive(Debug)]
struct ClockState {
    phase: Phase,
    since: Instant,
    in_flight: usize,
}

/// A connection's timeouts: which phase it is in since when, and a wake-up
/// for the connection's task when that changes.
struct Clock {
    state: Mutex<ClockState>,
    changed: Notify,
    limits: Limits,
}

impl Clock {
    fn new(limits: Limits) -> Clock {
        Clock {
            state: Mutex::new(ClockState {
                phase: Phase::Head,
                since: Instant::now(),
                in_flight: 0,
            }),
            changed: Notify::new(),
            limits,
        }
    }

    fn lock(&self) -> MutexGuard<'_, ClockState> {
        // Plain data: a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn enter(&self, state: &mut ClockState, phase: Phase) {
        state.phase = phase;
        state.since = Instant::now();
        self.changed.notify_one();
    }

    /// Bytes arrived: an idle connection starts a request's head.
    fn on_read(&self) {
        let mut state = self.lock();
        if state.phase == Phase::Idle {
            self.enter(&mut state, Phase::Head);
        }
    }

    fn deadline(&self) -> Option<Instant> {
        let state = self.lock();
        match state.phase {
            Phase::Head => Some(state.since + self.limits.header_read_timeout),
            Phase::Idle => Some(state.since + self.limits.idle_timeout),
            Phase::Busy => None,
        }
    }

    /// Resolves when the current phase outlives its timeout.
    async fn expired(&self) {
        loop {
            let changed = self.changed.notified();
            match self.deadline() {
                None => changed.await,
                Some(deadline) if Instant::now() >= deadline => return,
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = changed => {}
                    }
                }
            }
        }
    }
}

/// A request in flight on a connection; when the last one ends (its
/// response body sent or dropped) the connection turns idle.
struct Busy(Arc<Clock>);

impl Busy {
    fn new(clock: Arc<Clock>) -> Busy {
        {
            let mut state = clock.lock();
            state.in_flight += 1;
            clock.enter(&mut state, Phase::Busy);
        }
        Busy(clock)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        if state.in_flight == 0 {
            self.0.enter(&mut state, Phase::Idle);
        }
    }
}

/// A response body that keeps its request in flight until hyper has sent
/// it (or dropped it): a stream's tokens keep the connection busy.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = <Body as hyper::body::Body>::Data;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, telling the clock when bytes arrive.
struct Watched {
    inner: TcpStream,
    clock: Arc<Clock>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.clock.on_read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn head_then_busy_then_idle_timeouts() {
        let clock = Arc::new(Clock::new(limits()));
        let start = Instant::now();
        clock.expired().await;
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(2),
            "a new connection has the head timeout"
        );

        let busy = Busy::new(Arc::clone(&clock));
        let waited = tokio::time::timeout(Duration::from_secs(600), clock.expired()).await;
        assert!(waited.is_err(), "no timeout while a request is in flight");
        clock.on_read();
        assert_eq!(clock.deadline(), None, "reading a body keeps it busy");

        drop(busy);
        let idle = Instant::now();
        clock.expired().await;
        assert_eq!(
            idle.elapsed(),
            Duration::from_secs(5),
            "then the idle timeout"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_after_idle_start_the_head_timeout() {
        let clock = Arc::new(Clock::new(limits()));
        drop(Busy::new(Arc::clone(&clock)));
        tokio::time::sleep(Duration::from_secs(4)).await;
        clock.on_read();
        let head = Instant::now();
        clock.expired().await;
        assert_eq!(head.elapsed(), Duration::from_secs(2));
    }
}
