//! Worker ranks on other machines: node 0's side of the node protocol
//! (vLLM's multi-node `MultiprocExecutor`, where headless nodes start their
//! share of the workers).
//!
//! The ranks are split over `parallel.nnodes` machines in order, the first
//! nodes taking one more when they do not divide evenly (TP = 3 on two
//! nodes is 2 + 1). Each other node runs `host serve --headless`, connects
//! to node 0 at `parallel.master_addr:master_port` and speaks JSON lines:
//!
//! ```text
//! node K -> node 0   Hello { version, node_rank, nnodes, host }
//! node 0 -> node K   Bootstraps [one per rank of node K]   (or Refused { reason })
//! node K -> node 0   Ready { rank, pid, line }              (per rank: the worker's READY line)
//! node K -> node 0   Died { rank, status }                  (a worker of node K ended)
//! ```
//!
//! Afterwards the workers talk to the engine directly: the broadcast queue
//! and their response queues over TCP, the all-reduce through the hub. The
//! connection stays open as node K's death pipe both ways: its end is the
//! death of every rank on node K, reported naming the node's address, and
//! node 0 closing it tells node K to stop its workers.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::ExecutorError;
use crate::message_queue::net::{recv_json_line, send_json_line};
use crate::worker::proc::Bootstrap;

/// The node protocol's version; a node of another version is refused.
pub const NODE_PROTOCOL_VERSION: u32 = 1;

/// The longest line either side accepts (a bootstrap carries the
/// configuration as TOML, a few KiB).
const MAX_LINE_BYTES: u64 = 4 << 20;

/// How long a connected node gets to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A message of the node protocol, one JSON line each.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum NodeMessage {
    /// A headless node introduces itself.
    Hello {
        /// [`NODE_PROTOCOL_VERSION`] of the sender.
        version: u32,
        /// Its `parallel.node_rank`.
        node_rank: usize,
        /// Its `parallel.nnodes`, which must match node 0's.
        nnodes: usize,
        /// Its host name, for messages.
        host: String,
    },
    /// Node 0 hands a node the bootstraps of its ranks.
    Bootstraps(Vec<Bootstrap>),
    /// Node 0 will not use this node, and says why.
    Refused {
        /// Why.
        reason: String,
    },
    /// A rank of the node answered its start: `line` is the worker's ready
    /// line (empty if it exited first).
    Ready {
        /// The rank.
        rank: usize,
        /// Its process id on its node.
        pid: u32,
        /// Its ready line, a `ReadyMessage` in JSON.
        line: String,
    },
    /// A worker of the node ended; the node stops the others.
    Died {
        /// The rank.
        rank: usize,
        /// How it ended.
        status: String,
    },
}

impl NodeMessage {
    /// Writes the message as one line.
    pub fn send(&self, stream: &mut TcpStream) -> std::io::Result<()> {
        send_json_line(stream, self)
    }

    /// Reads one message; `Ok(None)` at the end of the stream. A line past
    /// [`MAX_LINE_BYTES`] or one that is not a message is an error.
    pub fn recv(reader: &mut impl BufRead) -> std::io::Result<Option<NodeMessage>> {
        recv_json_line(reader, MAX_LINE_BYTES, "node protocol")
    }
}

/// The ranks node `node` runs when `world_size` ranks are split over
/// `nnodes` machines, the first nodes taking one more when they do not
/// divide evenly.
pub fn node_ranks(world_size: usize, nnodes: usize, node: usize) -> Range<usize> {
    let (base, extra) = (world_size / nnodes, world_size % nnodes);
    let start = node * base + node.min(extra);
    start..start + base + usize::from(node < extra)
}

/// What ended a remote node, if anything has: the rank to blame and how.
type Lost = Arc<Mutex<Option<(usize, String)>>>;

/// One connected headless node.
struct RemoteNode {
    stream: TcpStream,
    lost: Lost,
}

/// The headless nodes of a multi-node group, as node 0 sees them.
pub struct RemoteNodes {
    nodes: Vec<RemoteNode>,
    /// Worker pids by global rank (0 until the rank is ready; a remote pid
    /// is a process on its own node).
    pids: Arc<Mutex<Vec<u32>>>,
}

impl RemoteNodes {
    /// No remote nodes (a single-machine group).
    pub fn none() -> RemoteNodes {
        RemoteNodes {
            nodes: Vec::new(),
            pids: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Listens at `listen` (`parallel.master_addr:master_port`) for the
    /// other nodes. Node 0 binds it before anything else of the group
    /// listens on that address: the queues' and the all-reduce hub's ports
    /// are the OS's choice, and a choice made first could be this port.
    pub fn bind(listen: &str) -> Result<TcpListener, ExecutorError> {
        TcpListener::bind(listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| ExecutorError::Start {
                rank: 0,
                message: format!(
                    "cannot listen for the other nodes on {listen} \
                     (parallel.master_addr / master_port): {e}"
                ),
            })
    }

    /// Waits on `listener` (from [`bind`](Self::bind) at `listen`) until
    /// every other node of `nnodes` has connected and said hello (within
    /// `timeout`), hands each the bootstraps of its ranks from `boot`, and
    /// forwards their ready lines to `ready` as the local workers' are
    /// forwarded.
    pub fn accept(
        (listener, listen): (TcpListener, &str),
        nnodes: usize,
        world_size: usize,
        boot: &dyn Fn(usize) -> Bootstrap,
        ready: &mpsc::Sender<(usize, std::io::Result<String>)>,
        timeout: Duration,
    ) -> Result<RemoteNodes, ExecutorError> {
        let fail = |rank: usize, message: String| ExecutorError::Start { rank, message };
        tracing::info!(%listen, nnodes, "waiting for the other nodes");
        let pids = Arc::new(Mutex::new(vec![0; world_size]));
        let mut slots: Vec<Option<RemoteNode>> = (0..nnodes).map(|_| None).collect();
        let deadline = Instant::now() + timeout;
        while slots[1..].iter().any(Option::is_none) {
            let missing = || {
                (1..nnodes)
                    .filter(|&n| slots[n].is_none())
                    .collect::<Vec<_>>()
            };
            if Instant::now() >= deadline {
                let first = node_ranks(world_size, nnodes, missing()[0]).start;
                return Err(fail(
                    first,
                    format!(
                        "node(s) {:?} did not connect to {listen} within {timeout:?} \
                         (parallel.worker_start_timeout_s); start `host serve --headless` \
                         there with the same nnodes and master address",
                        missing()
                    ),
                ));
            }
            let (stream, peer) = match listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(fail(0, format!("accepting a node on {listen}: {e}"))),
            };
            match handshake(stream, peer, nnodes, &slots) {
                Ok((node_rank, mut stream)) => {
                    let ranks = node_ranks(world_size, nnodes, node_rank);
                    let boots = NodeMessage::Bootstraps(ranks.clone().map(boot).collect());
                    if let Err(e) = boot_send(&mut stream, &boots) {
                        tracing::warn!(%peer, node_rank, "node left during its bootstrap: {e}");
                        continue;
                    }
                    let lost = Lost::default();
                    let reader = stream.try_clone().map_err(|e| {
                        fail(ranks.start, format!("cannot watch node {node_rank}: {e}"))
                    })?;
                    let watch = NodeWatch {
                        node_rank,
                        peer,
                        ranks: ranks.clone(),
                        lost: lost.clone(),
                        pids: pids.clone(),
                        ready: ready.clone(),
                    };
                    std::thread::Builder::new()
                        .name(format!("node-{node_rank}"))
                        .spawn(move || watch.run(reader))
                        .map_err(|e| {
                            fail(ranks.start, format!("cannot start a node watcher: {e}"))
                        })?;
                    tracing::info!(%peer, node_rank, ?ranks, "node joined");
                    slots[node_rank] = Some(RemoteNode { stream, lost });
                }
                Err(reason) => tracing::warn!(%peer, "refused a node: {reason}"),
            }
        }
        Ok(RemoteNodes {
            nodes: slots.into_iter().flatten().collect(),
            pids,
        })
    }

    /// The pid (on its own node) of a remote `rank`, 0 if not ready.
    pub fn pid(&self, rank: usize) -> u32 {
        self.pids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(rank)
            .copied()
            .unwrap_or(0)
    }

    /// Ranks in the whole group (0 for a single machine).
    pub fn world_size(&self) -> usize {
        self.pids.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The first rank lost with a remote node, and how.
    pub fn lost(&self) -> Option<(usize, String)> {
        self.nodes
            .iter()
            .find_map(|n| n.lost.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Closes every node's connection: each stops its workers.
    pub fn close(&self) {
        for n in &self.nodes {
            let _ = n.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Reads a connecting node's hello and checks it against the group; on a
/// refusal, tells the node why before closing.
fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    nnodes: usize,
    slots: &[Option<RemoteNode>],
) -> Result<(usize, TcpStream), String> {
    let mut stream = stream;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let hello = NodeMessage::recv(&mut BufReader::new(&stream));
    let verdict = match hello {
        Ok(Some(NodeMessage::Hello {
            version,
            node_rank,
            nnodes: theirs,
            host,
        })) => {
            if version != NODE_PROTOCOL_VERSION {
                Err(format!(
                    "node {host} speaks node protocol {version}, this engine {NODE_PROTOCOL_VERSION}: run the same host version on every node"
                ))
            } else if theirs != nnodes {
                Err(format!(
                    "node {host} was started with nnodes = {theirs}, node 0 with {nnodes}"
                ))
            } else if !(1..nnodes).contains(&node_rank) {
                Err(format!(
                    "node {host} claims node rank {node_rank}; headless nodes are 1..={}",
                    nnodes - 1
                ))
            } else if slots[node_rank].is_some() {
                Err(format!(
                    "node {host} claims node rank {node_rank}, which another node already has"
                ))
            } else {
                Ok(node_rank)
            }
        }
        Ok(Some(other)) => Err(format!("{peer} sent {other:?} before saying hello")),
        Ok(None) => Err(format!("{peer} closed the connection before saying hello")),
        Err(e) => Err(format!("{peer} did not say hello: {e}")),
    };
    match verdict {
        Ok(node_rank) => {
            let _ = stream.set_read_timeout(None);
            Ok((node_rank, stream))
        }
        Err(reason) => {
            let _ = NodeMessage::Refused {
                reason: reason.clone(),
            }
            .send(&mut stream);
            Err(reason)
        }
    }
}

fn boot_send(stream: &mut TcpStream, boots: &NodeMessage) -> std::io::Result<()> {
    stream.set_write_timeout(Some(HELLO_TIMEOUT))?;
    boots.send(stream)?;
    stream.set_write_timeout(None)
}

/// The thread that reads a node's messages after its bootstrap.
struct NodeWatch {
    node_rank: usize,
    peer: SocketAddr,
    ranks: Range<usize>,
    lost: Lost,
    pids: Arc<Mutex<Vec<u32>>>,
    ready: mpsc::Sender<(usize, std::io::Result<String>)>,
}

impl NodeWatch {
    fn run(self, stream: TcpStream) {
        let mut reader = BufReader::new(stream);
        let mut not_ready = self.ranks.clone().collect::<Vec<_>>();
        let (blamed, status) = loop {
            match NodeMessage::recv(&mut reader) {
                Ok(Some(NodeMessage::Ready { rank, pid, line })) if self.ranks.contains(&rank) => {
                    if let Some(p) = self
                        .pids
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(rank)
                    {
                        *p = pid;
                    }
                    not_ready.retain(|&r| r != rank);
                    let _ = self.ready.send((rank, Ok(line)));
                }
                Ok(Some(NodeMessage::Died { rank, status })) if self.ranks.contains(&rank) => {
                    break (
                        rank,
                        format!("{status} on node {} at {}", self.node_rank, self.peer),
                    );
                }
                Ok(Some(other)) => {
                    break (
                        self.ranks.start,
                        format!(
                        "node {} at {} sent {other:?}, which is not its to send; dropping the node",
                        self.node_rank, self.peer
                    ),
                    )
                }
                Ok(None) => {
                    break (
                        self.ranks.start,
                        format!(
                            "the connection to node {} at {} (ranks {:?}) closed",
                            self.node_rank, self.peer, self.ranks
                        ),
                    )
                }
                Err(e) => {
                    break (
                        self.ranks.start,
                        format!(
                            "the connection to node {} at {} (ranks {:?}) was lost: {e}",
                            self.node_rank, self.peer, self.ranks
                        ),
                    )
                }
            }
        };
        *self.lost.lock().unwrap_or_else(|e| e.into_inner()) = Some((blamed, status.clone()));
        for rank in not_ready {
            let _ = self
                .ready
                .send((rank, Err(std::io::Error::other(status.clone()))));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn ranks_split_in_order_with_the_first_nodes_taking_the_remainder() {
        let split = |w, n| (0..n).map(|k| node_ranks(w, n, k)).collect::<Vec<_>>();
        assert_eq!(split(3, 2), vec![0..2, 2..3]);
        assert_eq!(split(4, 2), vec![0..2, 2..4]);
        assert_eq!(split(5, 3), vec![0..2, 2..4, 4..5]);
        assert_eq!(split(2, 2), vec![0..1, 1..2]);
        for w in 1..20 {
            for n in 1..=w {
                let all: Vec<usize> = split(w, n).into_iter().flatten().collect();
                assert_eq!(all, (0..w).collect::<Vec<_>>(), "w={w} n={n}");
            }
        }
    }

    #[test]
    fn a_line_past_the_bound_or_not_a_message_is_an_error() {
        let long = vec![b'x'; MAX_LINE_BYTES as usize + 10];
        let err = NodeMessage::recv(&mut &long[..]).unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
        let err = NodeMessage::recv(&mut &b"{\"Hello\":7}\n"[..]).unwrap_err();
        assert!(
            err.to_string().contains("not a node protocol message"),
            "{err}"
        );
        assert!(NodeMessage::recv(&mut &b""[..]).unwrap().is_none());
    }

    /// A node that says the wrong thing is refused with the reason, and
    /// node 0 goes on waiting for a proper one.
    #[test]
    fn bad_hellos_are_refused_with_the_reason() {
        let listener = RemoteNodes::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, _rx) = mpsc::channel();
        let node0 = std::thread::spawn(move || {
            let boot = |rank| Bootstrap::for_tests(rank, 3);
            let listen = addr.to_string();
            RemoteNodes::accept(
                (listener, &listen),
                2,
                3,
                &boot,
                &tx,
                Duration::from_secs(20),
            )
            .map(|nodes| nodes.nodes.len())
        });
        let hello = |nnodes, node_rank, version| NodeMessage::Hello {
            version,
            node_rank,
            nnodes,
            host: "test".into(),
        };
        let connect = || loop {
            if let Ok(s) = TcpStream::connect(addr) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for (bad, says) in [
            (hello(3, 1, NODE_PROTOCOL_VERSION), "nnodes = 3"),
            (hello(2, 0, NODE_PROTOCOL_VERSION), "node rank 0"),
            (hello(2, 1, 99), "protocol 99"),
        ] {
            let mut s = connect();
            bad.send(&mut s).unwrap();
            match NodeMessage::recv(&mut BufReader::new(&s)).unwrap() {
                Some(NodeMessage::Refused { reason }) => assert!(reason.contains(says), "{reason}"),
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
        let mut garbage = connect();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut good = connect();
        hello(2, 1, NODE_PROTOCOL_VERSION).send(&mut good).unwrap();
        match NodeMessage::recv(&mut BufReader::new(&good)).unwrap() {
            Some(NodeMessage::Bootstraps(boots)) => {
                assert_eq!(boots.iter().map(|b| b.rank).collect::<Vec<_>>(), vec![2])
            }
            other => panic!("expected bootstraps, got {other:?}"),
        }
        assert_eq!(node0.join().unwrap().unwrap(), 1);
    }
}
