//! TCP plumbing shared by everything that crosses machines: the queue's
//! remote readers, the all-reduce hub and its ranks, and the node protocol.

use std::io::{self, BufRead, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::{Duration, Instant};

/// The longest single connect attempt of [`connect_retrying`].
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
/// The pause between its attempts.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

/// The addresses `bind` names: `host`, `host:port`, `ip`, `[v6]` or
/// `[v6]:port`; no port (or port 0) lets the OS pick one. An address that
/// resolves to nothing is an error.
pub fn bind_addrs(bind: &str) -> io::Result<Vec<SocketAddr>> {
    if let Ok(addr) = bind.parse::<SocketAddr>() {
        return Ok(vec![addr]);
    }
    let bare = bind
        .strip_prefix('[')
        .and_then(|b| b.strip_suffix(']'))
        .unwrap_or(bind);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, 0)]);
    }
    let (host, port) = match bind.rsplit_once(':') {
        Some((host, port)) => match port.parse::<u16>() {
            Ok(port) => (host, port),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("port {port:?} is not in 0..=65535"),
                ))
            }
        },
        None => (bind, 0),
    };
    let addrs: Vec<_> = (host, port).to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "it resolves to no address",
        ));
    }
    Ok(addrs)
}

/// Connects to `addr`, resolving it again on every attempt (a peer's name
/// may appear late, as a pod's DNS record does) and retrying refused or
/// failed attempts until `deadline` has passed: a peer that is still
/// starting is normal. Each attempt waits at most a second. The error is
/// the last attempt's.
pub fn connect_retrying(addr: impl ToSocketAddrs, deadline: Duration) -> io::Result<TcpStream> {
    let started = Instant::now();
    loop {
        let left = deadline.saturating_sub(started.elapsed());
        let attempt = left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
        let last = match addr.to_socket_addrs() {
            Ok(addrs) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "it resolves to no address");
                for a in addrs {
                    match TcpStream::connect_timeout(&a, attempt) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last = e,
                    }
                }
                last
            }
            Err(e) => e,
        };
        if started.elapsed() + CONNECT_RETRY >= deadline {
            return Err(last);
        }
        std::thread::sleep(CONNECT_RETRY);
    }
}

/// This machine's name, for the other side's messages.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

/// Writes `msg` as one JSON line (the node protocols' framing).
pub fn send_json_line<T: Serialize>(stream: &mut TcpStream, msg: &T) -> io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// Reads one JSON line; `Ok(None)` at the end of the stream. A line past
/// `max_bytes`, or one that is not a `T`, is an error naming `what`.
pub fn recv_json_line<T: DeserializeOwned>(
    reader: &mut impl BufRead,
    max_bytes: u64,
    what: &str,
) -> io::Result<Option<T>> {
    let mut line = Vec::new();
    reader.take(max_bytes).read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        return Err(io::Error::other(format!(
            "a {what} line ended early or exceeds {max_bytes} bytes"
        )));
    }
    serde_json::from_slice(&line)
        .map(Some)
        .map_err(|e| io::Error::other(format!("not a {what} message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_in_every_spelling() {
        let one = |s: &str| bind_addrs(s).unwrap()[0];
        assert_eq!(one("127.0.0.1:5"), "127.0.0.1:5".parse().unwrap());
        assert_eq!(one("127.0.0.1"), "127.0.0.1:0".parse().unwrap());
        assert_eq!(one("[::1]"), "[::1]:0".parse().unwrap());
        assert_eq!(one("localhost:7").port(), 7);
        let err = bind_addrs("localhost:99999").unwrap_err().to_string();
        assert!(err.contains("99999"), "{err}");
    }

    #[test]
    fn a_peer_that_never_listens_is_the_last_attempts_error_after_the_deadline() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let started = Instant::now();
        let err = connect_retrying(addr, Duration::from_millis(300)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        let took = started.elapsed();
        assert!(
            (Duration::from_millis(250)..Duration::from_secs(2)).contains(&took),
            "{took:?}"
        );
    }
}
