//! Data-parallel engine cores on other machines, as the API server sees
//! them (vLLM's `--data-parallel-size-local` with `--headless` engines on
//! the other nodes). The API server runs ranks `0..data_parallel_size_local`
//! itself; each other machine runs `host serve --headless` with its
//! `data_parallel_start_rank`, and for every rank it holds connects to
//! `parallel.master_addr:master_port` and speaks JSON lines:
//!
//! ```text
//! machine -> server   Hello { version, dp_rank, data_parallel_size, host }
//! server -> machine   Bootstrap (the engine-core bootstrap)    (or Refused { reason })
//! machine -> server   Ready { pid, line }     (the engine core's READY line)
//! machine -> server   Exited { status, success }   (the engine core ended)
//! ```
//!
//! The engine core's queues then run over TCP (the server's input queue
//! listens on `master_addr`, the engine core's output queue on the address
//! the machine reached the server from). The connection stays open as the
//! death pipe both ways: the server closing it stops the engine core, and
//! its end, or an `Exited`, is the engine core's death, named by rank and
//! host. The supervisor then waits for the machine to connect again (it
//! does once its engine core ended) and replays the rank's requests there.

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use super::launch::Spawned;
use super::process::{CoreProcess, DeathPipe, Exit};
use super::Bootstrap;
use crate::config::EngineConfig;
use crate::message_queue::net::{recv_json_line, send_json_line};
use crate::message_queue::{MessageQueue, QueueConfig};

/// The protocol's version; a machine of another version is refused.
pub(super) const DP_PROTOCOL_VERSION: u32 = 1;

/// The longest line either side accepts (a bootstrap carries the
/// configuration as TOML, a few KiB).
const MAX_LINE_BYTES: u64 = 4 << 20;

/// How long a connected machine gets to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the accepting thread looks for a new connection or its end.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// A message between the API server and a headless machine, one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum DpMessage {
    /// A machine offers to run one rank.
    Hello {
        /// [`DP_PROTOCOL_VERSION`] of the sender.
        version: u32,
        /// The rank.
        dp_rank: usize,
        /// Its `parallel.data_parallel_size`, which must match the server's.
        data_parallel_size: usize,
        /// Its host name, for messages.
        host: String,
    },
    /// The server's bootstrap for the rank's engine core.
    Bootstrap(Bootstrap),
    /// The server will not use this offer, and says why.
    Refused {
        /// Why.
        reason: String,
    },
    /// The engine core answered its start.
    Ready {
        /// Its process id on its machine.
        pid: u32,
        /// Its READY line (empty if it exited first).
        line: String,
    },
    /// The engine core ended.
    Exited {
        /// How, as its machine says it.
        status: String,
        /// Exit status 0.
        success: bool,
    },
}

impl DpMessage {
    /// Writes the message as one line.
    pub fn send(&self, stream: &mut TcpStream) -> std::io::Result<()> {
        send_json_line(stream, self)
    }

    /// Reads one message; `Ok(None)` at the end of the stream.
    pub fn recv(reader: &mut BufReader<TcpStream>) -> std::io::Result<Option<DpMessage>> {
        recv_json_line(reader, MAX_LINE_BYTES, "data-parallel protocol")
    }
}

/// A machine that offered a rank: its connection, name and address.
struct Offer {
    stream: TcpStream,
    host: String,
    peer: SocketAddr,
}

/// The API server's listener for headless machines, and the offers it
/// received, by rank. The accepting thread ends when this is dropped.
pub(crate) struct RemoteEngines {
    /// The first remote rank; `offers[i]` is rank `first + i`'s.
    first: usize,
    offers: Vec<Mutex<Receiver<Offer>>>,
    listen: String,
    stop: Arc<AtomicBool>,
}

impl Drop for RemoteEngines {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl RemoteEngines {
    /// Listens on `parallel.master_addr:master_port` for the machines of
    /// the ranks from `data_parallel_size_local` on.
    pub fn listen(config: &EngineConfig) -> anyhow::Result<Arc<RemoteEngines>> {
        let p = &config.parallel;
        let first = p.local_data_parallel_ranks().end;
        let size = p.data_parallel_size;
        let listen = format!("{}:{}", p.master_addr, p.master_port);
        let listener = TcpListener::bind(&listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .with_context(|| {
                format!(
                    "cannot listen for the other machines' engine cores on {listen} \
                     (parallel.master_addr / master_port)"
                )
            })?;
        let (senders, receivers): (Vec<_>, Vec<_>) = (first..size).map(|_| mpsc::channel()).unzip();
        let stop = Arc::new(AtomicBool::new(false));
        let accept = Acceptor {
            listener,
            first,
            size,
            senders,
            stop: Arc::clone(&stop),
        };
        std::thread::Builder::new()
            .name("dp-accept".into())
            .spawn(move || accept.run())?;
        tracing::info!(%listen, ranks = ?(first..size), "waiting for the other machines' engine cores");
        Ok(Arc::new(RemoteEngines {
            first,
            offers: receivers.into_iter().map(Mutex::new).collect(),
            listen,
            stop,
        }))
    }

    /// Hands rank `config.parallel.data_parallel_rank` to the first machine
    /// that offers it (waiting up to `parallel.worker_start_timeout_s`) and
    /// sends it the bootstrap; the engine core then loads the model there.
    pub(super) fn spawn(&self, config: &EngineConfig) -> anyhow::Result<Spawned> {
        let p = &config.parallel;
        let rank = p.data_parallel_rank;
        let window = Duration::try_from_secs_f64(p.worker_start_timeout_s)
            .context("parallel.worker_start_timeout_s")?;
        let input =
            MessageQueue::new_writer_with_remote(1, &[0], &p.master_addr, QueueConfig::default())
                .with_context(|| {
                format!(
                    "listening for rank {rank}'s engine core on {}",
                    p.master_addr
                )
            })?;
        let boot = DpMessage::Bootstrap(Bootstrap {
            config_toml: config.to_toml(),
            input_handle: input.export_handle(),
            output_bind: None,
        });
        let offers = self.offers[rank - self.first]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + window;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut offer = match offers.recv_timeout(left) {
                Ok(offer) => offer,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => bail!(
                    "no machine offered data-parallel rank {rank} on {} within {window:?} \
                     (parallel.worker_start_timeout_s); start `host serve --headless` there \
                     with a data_parallel_start_rank and data_parallel_size_local that cover it",
                    self.listen
                ),
            };
            // An offer whose machine left meanwhile fails here; take the next.
            if let Err(e) = boot.send(&mut offer.stream) {
                tracing::warn!(rank, host = %offer.host, "the machine left before its bootstrap: {e}");
                continue;
            }
            let reader = BufReader::new(offer.stream.try_clone()?);
            tracing::info!(rank, host = %offer.host, peer = %offer.peer, "a machine took the rank");
            return Ok(Spawned {
                process: CoreProcess::Remote(RemoteCore {
                    reader,
                    host: offer.host,
                    peer: offer.peer,
                    rank,
                    pid: 0,
                    exit: None,
                }),
                death_pipe: DeathPipe::Remote(offer.stream),
                input,
            });
        }
    }
}

/// The accepting thread's state.
struct Acceptor {
    listener: TcpListener,
    first: usize,
    size: usize,
    senders: Vec<Sender<Offer>>,
    stop: Arc<AtomicBool>,
}

impl Acceptor {
    fn run(self) {
        while !self.stop.load(Ordering::Acquire) {
            let (stream, peer) = match self.listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
                Err(e) => {
                    tracing::warn!("accepting a machine's connection: {e}");
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
            };
            match self.hello(stream, peer) {
                Ok((rank, offer)) => {
                    tracing::info!(rank, host = %offer.host, %peer, "a machine offers a rank");
                    let _ = self.senders[rank - self.first].send(offer);
                }
                Err(reason) => tracing::warn!(%peer, "refused a machine: {reason}"),
            }
        }
    }

    /// Reads a machine's hello and checks it; on a refusal, tells the
    /// machine why before closing.
    fn hello(&self, mut stream: TcpStream, peer: SocketAddr) -> Result<(usize, Offer), String> {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
        let _ = stream.set_nodelay(true);
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        let verdict = match DpMessage::recv(&mut reader) {
            Ok(Some(DpMessage::Hello {
                version,
                dp_rank,
                data_parallel_size,
                host,
            })) => {
                if version != DP_PROTOCOL_VERSION {
                    Err(format!(
                        "{host} speaks data-parallel protocol {version}, this server \
                         {DP_PROTOCOL_VERSION}: run the same host version on every machine"
                    ))
                } else if data_parallel_size != self.size {
                    Err(format!(
                        "{host} was started with data_parallel_size = {data_parallel_size}, \
                         the API server with {}",
                        self.size
                    ))
                } else if !(self.first..self.size).contains(&dp_rank) {
                    Err(format!(
                        "{host} offers rank {dp_rank}, but the other machines run ranks {}..{}",
                        self.first, self.size
                    ))
                } else {
                    Ok((dp_rank, host))
                }
            }
            Ok(Some(other)) => Err(format!("sent {other:?} instead of a hello")),
            Ok(None) => Err("closed before saying hello".into()),
            Err(e) => Err(format!("no valid hello: {e}")),
        };
        match verdict {
            Ok((rank, host)) => {
                let _ = stream.set_read_timeout(None);
                Ok((rank, Offer { stream, host, peer }))
            }
            Err(reason) => {
                let _ = DpMessage::Refused {
                    reason: reason.clone(),
                }
                .send(&mut stream);
                Err(reason)
            }
        }
    }
}

/// An engine core another machine runs for this server.
pub(super) struct RemoteCore {
    reader: BufReader<TcpStream>,
    host: String,
    peer: SocketAddr,
    rank: usize,
    pid: u32,
    /// How it ended, when that came before its READY line.
    exit: Option<Exit>,
}

impl RemoteCore {
    /// Its pid on its machine (0 until READY).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its READY line, as its machine relays it; empty when it ended first.
    pub fn read_ready_line(&mut self) -> std::io::Result<String> {
        match DpMessage::recv(&mut self.reader) {
            Ok(Some(DpMessage::Ready { pid, line })) => {
                self.pid = pid;
                Ok(line)
            }
            Ok(Some(DpMessage::Exited { status, success })) => {
                self.exit = Some(self.exited(&status, success));
                Ok(String::new())
            }
            Ok(None) => Ok(String::new()),
            Ok(Some(other)) => Err(std::io::Error::other(format!(
                "{} sent {other:?} instead of the engine core's READY line",
                self.host
            ))),
            Err(e) => Err(e),
        }
    }

    /// Waits for its machine to report its end, or for the connection to
    /// end (the machine died or the network failed): either is its death.
    pub fn wait(&mut self) -> Exit {
        if let Some(exit) = self.exit.take() {
            return exit;
        }
        loop {
            match DpMessage::recv(&mut self.reader) {
                Ok(Some(DpMessage::Exited { status, success })) => {
                    return self.exited(&status, success)
                }
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => {
                    return Exit {
                        description: format!(
                            "lost the connection to data-parallel rank {} on {} ({})",
                            self.rank, self.host, self.peer
                        ),
                        clean: false,
                        certain: true,
                    }
                }
            }
        }
    }

    fn exited(&self, status: &str, success: bool) -> Exit {
        Exit {
            description: format!(
                "the engine-core process of data-parallel rank {} on {} ({}, pid {}) exited: {status}",
                self.rank, self.host, self.peer, self.pid
            ),
            clean: success,
            certain: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn config(port: u16) -> EngineConfig {
        let mut c = EngineConfig::default();
        c.parallel.data_parallel_size = 3;
        c.parallel.data_parallel_size_local = Some(1);
        c.parallel.master_addr = "127.0.0.1".into();
        c.parallel.master_port = port;
        c.parallel.worker_start_timeout_s = 20.0;
        c
    }

    fn hello(dp_rank: usize, data_parallel_size: usize, version: u32) -> DpMessage {
        DpMessage::Hello {
            version,
            dp_rank,
            data_parallel_size,
            host: "test".into(),
        }
    }

    /// A machine that says the wrong thing is refused with the reason; the
    /// rank goes to the first proper offer, with the server's bootstrap.
    #[test]
    fn bad_offers_are_refused_with_the_reason_and_a_good_one_gets_the_bootstrap() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let mut config = config(port);
        let remote = RemoteEngines::listen(&config).unwrap();
        let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
        for (bad, says) in [
            (hello(0, 3, DP_PROTOCOL_VERSION), "offers rank 0"),
            (hello(3, 3, DP_PROTOCOL_VERSION), "offers rank 3"),
            (hello(2, 4, DP_PROTOCOL_VERSION), "data_parallel_size = 4"),
            (hello(2, 3, 99), "protocol 99"),
        ] {
            let mut s = connect();
            bad.send(&mut s).unwrap();
            match DpMessage::recv(&mut BufReader::new(s)).unwrap() {
                Some(DpMessage::Refused { reason }) => assert!(reason.contains(says), "{reason}"),
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
        let mut garbage = connect();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut good = connect();
        hello(2, 3, DP_PROTOCOL_VERSION).send(&mut good).unwrap();
        config.parallel.data_parallel_rank = 2;
        let spawned = remote.spawn(&config).unwrap();
        assert_eq!(spawned.pid(), 0, "not ready yet");
        match DpMessage::recv(&mut BufReader::new(good)).unwrap() {
            Some(DpMessage::Bootstrap(boot)) => {
                let theirs: EngineConfig = toml::from_str(&boot.config_toml).unwrap();
                assert_eq!(theirs.parallel.data_parallel_rank, 2);
                assert!(boot.input_handle.remote_addr.is_some(), "input over TCP");
                assert!(boot.input_handle.shm.is_none(), "and only over TCP");
            }
            other => panic!("expected the bootstrap, got {other:?}"),
        }
    }

    /// No offer within the window is an error that says what to start.
    #[test]
    fn a_rank_nobody_offers_is_an_error_naming_it() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let mut config = config(port);
        config.parallel.worker_start_timeout_s = 0.2;
        config.parallel.data_parallel_rank = 1;
        let remote = RemoteEngines::listen(&config).unwrap();
        let err = format!("{:#}", remote.spawn(&config).err().unwrap());
        assert!(
            err.contains("rank 1") && err.contains("host serve --headless"),
            "{err}"
        );
    }
}
