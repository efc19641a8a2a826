//! `host serve --headless`: a machine of a multi-node group that runs only
//! workers (vLLM's `--headless`). It connects to node 0, receives the
//! bootstraps of its ranks, starts them as local worker processes (each
//! replies over TCP, the broadcast queue and the all-reduce reach it over
//! TCP), relays their READY lines, and then watches both sides: the end of
//! node 0's connection stops its workers; the death of a worker is reported
//! to node 0 naming the rank, and stops the others (node 0 restarts the
//! group under `[engine]`).
//!
//! After either, the node connects again and waits for node 0 to start the
//! next group, for up to `parallel.worker_start_timeout_s`; a node 0 that
//! stays away ends the node.

use std::io::BufReader;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::monitor::WorkerSet;
use super::multiproc::{spawn, worker_executable};
use super::nodes::{NodeMessage, NODE_PROTOCOL_VERSION};
use crate::config::EngineConfig;
use crate::message_queue::net::{connect_retrying, hostname};

/// How often the node looks at its workers and node 0's connection.
const POLL: Duration = Duration::from_millis(100);

/// Runs this machine as headless node `parallel.node_rank` until node 0
/// goes away for longer than `parallel.worker_start_timeout_s`.
pub fn run(config: &EngineConfig) -> anyhow::Result<()> {
    let p = &config.parallel;
    if p.nnodes < 2 || p.node_rank == 0 {
        bail!(
            "--headless runs a worker node of a multi-node group: set parallel.nnodes > 1 \
             and parallel.node_rank > 0 (--nnodes, --node-rank), or start under torchrun, \
             Slurm or a LeaderWorkerSet"
        );
    }
    let exe = worker_executable(p.worker_executable.as_deref())?;
    let window = Duration::try_from_secs_f64(p.worker_start_timeout_s)
        .context("parallel.worker_start_timeout_s")?;
    let master = format!("{}:{}", p.master_addr, p.master_port);
    let shutdown_grace = Duration::try_from_secs_f64(p.worker_shutdown_timeout_s)
        .context("parallel.worker_shutdown_timeout_s")?;
    let mut groups = 0usize;
    loop {
        let Ok(stream) = connect_retrying(master.as_str(), window) else {
            if groups == 0 {
                bail!(
                    "node 0 at {master} did not answer within {window:?} \
                     (parallel.worker_start_timeout_s); is it started, with this master \
                     address and port?"
                );
            }
            tracing::info!(%master, "node 0 did not come back; exiting");
            return Ok(());
        };
        groups += 1;
        serve_group(config, &exe, stream, window, shutdown_grace)
            .with_context(|| format!("node {} serving node 0 at {master}", p.node_rank))?;
    }
}

/// One group's life on this node: hello, bootstraps, start, relay READY,
/// watch. Returns when node 0 closes the connection or a worker dies (the
/// node then reconnects); an error is a refusal or a broken protocol.
fn serve_group(
    config: &EngineConfig,
    exe: &std::path::Path,
    mut stream: TcpStream,
    window: Duration,
    shutdown_grace: Duration,
) -> anyhow::Result<()> {
    let p = &config.parallel;
    stream.set_nodelay(true)?;
    let host = hostname();
    NodeMessage::Hello {
        version: NODE_PROTOCOL_VERSION,
        node_rank: p.node_rank,
        nnodes: p.nnodes,
        host: host.clone(),
    }
    .send(&mut stream)
    .context("saying hello")?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut boots = match NodeMessage::recv(&mut reader).context("waiting for the bootstraps")? {
        Some(NodeMessage::Bootstraps(boots)) if !boots.is_empty() => boots,
        Some(NodeMessage::Refused { reason }) => bail!("node 0 refused this node: {reason}"),
        // Node 0 closed: it is shutting down or restarting; try again.
        None => return Ok(()),
        Some(other) => bail!("node 0 sent {other:?} instead of the bootstraps"),
    };
    // The workers' response queues listen on the address node 0 reached us at.
    let local_ip = stream.local_addr()?.ip().to_string();
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut children = Vec::with_capacity(boots.len());
    let ranks: Vec<usize> = boots.iter().map(|b| b.rank).collect();
    for boot in &mut boots {
        boot.response_bind = Some(local_ip.clone());
        match spawn(exe, boot, ready_tx.clone()) {
            Ok(child) => children.push(child),
            Err(status) => {
                let workers = WorkerSet::new(children);
                workers.terminate(Duration::ZERO);
                let _ = NodeMessage::Died {
                    rank: boot.rank,
                    status: format!("could not start on {host}: {status}"),
                }
                .send(&mut stream);
                return Ok(());
            }
        }
    }
    drop(ready_tx);
    let workers = WorkerSet::new(children);
    tracing::info!(?ranks, "started this node's workers");
    let deadline = Instant::now() + window;
    for _ in &ranks {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((rank, line)) = ready_rx.recv_timeout(left) else {
            break;
        };
        let index = ranks.iter().position(|&r| r == rank).unwrap_or(0);
        let sent = NodeMessage::Ready {
            rank,
            pid: workers.pid(index),
            line: line.unwrap_or_default(),
        }
        .send(&mut stream);
        if sent.is_err() {
            workers.terminate(shutdown_grace);
            return Ok(());
        }
    }
    let closed = Arc::new(AtomicBool::new(false));
    let watcher = {
        let closed = closed.clone();
        std::thread::Builder::new()
            .name("node-0".into())
            .spawn(move || {
                // Node 0 sends nothing more: any end of the stream is its close.
                while let Ok(Some(_)) = NodeMessage::recv(&mut reader) {}
                closed.store(true, Ordering::Release);
            })?
    };
    loop {
        if closed.load(Ordering::Acquire) {
            tracing::info!("node 0 closed the connection; stopping this node's workers");
            break;
        }
        if let Some((index, status)) = workers.first_exit() {
            let rank = ranks[index];
            tracing::error!(rank, %status, "a worker of this node died");
            let _ = NodeMessage::Died {
                rank,
                status: format!("{status} (on {host})"),
            }
            .send(&mut stream);
            break;
        }
        std::thread::sleep(POLL);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    workers.terminate(shutdown_grace);
    let _ = watcher.join();
    Ok(())
}
