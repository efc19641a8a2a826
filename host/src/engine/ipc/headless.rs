//! `host serve --headless` with data parallelism: a machine that runs
//! engine cores for an API server on another machine (vLLM's headless
//! data-parallel node). For each rank it holds (`data_parallel_size_local`
//! of them from `data_parallel_start_rank`) one thread offers the rank to
//! the server (`remote.rs` has the protocol), starts the engine-core
//! process the server's bootstrap describes, relays its READY line, and
//! watches both sides: the server closing the connection stops the engine
//! core; the engine core's end is reported. Then the thread offers the rank
//! again, so the server can restart it, until the server stays away longer
//! than `parallel.worker_start_timeout_s`.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::launch::start_engine_core;
use super::remote::{DpMessage, DP_PROTOCOL_VERSION};
use crate::config::EngineConfig;
use crate::engine::executor::worker_executable;
use crate::message_queue::net::{connect_retrying, hostname};

/// How often a rank's thread looks at its engine core and the connection.
const POLL: Duration = Duration::from_millis(50);

/// Pause before offering a rank again, so a server that closes at once
/// is not hammered.
const REOFFER_PAUSE: Duration = Duration::from_millis(200);

/// Runs this machine's data-parallel ranks for the API server at
/// `parallel.master_addr:master_port` until it goes away.
pub fn run(config: &EngineConfig) -> anyhow::Result<()> {
    let p = &config.parallel;
    let ranks = p.local_data_parallel_ranks();
    if p.data_parallel_size < 2 || ranks.start == 0 {
        bail!(
            "--headless with data parallelism runs the engine cores of another machine's API \
             server: set parallel.data_parallel_size > 1 and data_parallel_start_rank > 0 \
             (--data-parallel-size, --data-parallel-start-rank, --data-parallel-size-local)"
        );
    }
    let exe = worker_executable(p.worker_executable.as_deref())?;
    let window = Duration::try_from_secs_f64(p.worker_start_timeout_s)
        .context("parallel.worker_start_timeout_s")?;
    let grace = Duration::try_from_secs_f64(p.worker_shutdown_timeout_s)
        .context("parallel.worker_shutdown_timeout_s")?;
    let server = format!("{}:{}", p.master_addr, p.master_port);
    tracing::info!(?ranks, %server, "running data-parallel engine cores for the API server");
    std::thread::scope(|scope| {
        let threads: Vec<_> = ranks
            .clone()
            .map(|rank| {
                let rank_thread = RankThread {
                    config,
                    exe: &exe,
                    rank,
                    server: &server,
                    window,
                    grace,
                };
                scope.spawn(move || rank_thread.run())
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
            })
            .collect::<anyhow::Result<Vec<()>>>()
    })?;
    Ok(())
}

/// One rank's offers to the server, one engine core per accepted offer.
struct RankThread<'a> {
    config: &'a EngineConfig,
    exe: &'a Path,
    rank: usize,
    server: &'a str,
    window: Duration,
    grace: Duration,
}

impl RankThread<'_> {
    fn run(&self) -> anyhow::Result<()> {
        let mut served = 0usize;
        loop {
            let stream = match connect_retrying(self.server, self.window) {
                Ok(stream) => stream,
                Err(e) if served == 0 => bail!(
                    "rank {}: the API server at {} did not answer within {:?} \
                     (parallel.worker_start_timeout_s): {e}; is it started with this \
                     master address and port, and data_parallel_size_local below this rank?",
                    self.rank,
                    self.server,
                    self.window
                ),
                Err(_) => {
                    tracing::info!(rank = self.rank, "the API server did not come back; done");
                    return Ok(());
                }
            };
            served += 1;
            self.serve(stream)
                .with_context(|| format!("rank {} serving {}", self.rank, self.server))?;
            std::thread::sleep(REOFFER_PAUSE);
        }
    }

    /// One offer: hello, bootstrap, start, relay READY, watch. Returns when
    /// either side ended; an error is a refusal or a broken protocol.
    fn serve(&self, mut stream: TcpStream) -> anyhow::Result<()> {
        stream.set_nodelay(true)?;
        DpMessage::Hello {
            version: DP_PROTOCOL_VERSION,
            dp_rank: self.rank,
            data_parallel_size: self.config.parallel.data_parallel_size,
            host: hostname(),
        }
        .send(&mut stream)
        .context("saying hello")?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut boot = match DpMessage::recv(&mut reader).context("waiting for the bootstrap")? {
            Some(DpMessage::Bootstrap(boot)) => boot,
            Some(DpMessage::Refused { reason }) => bail!("the API server refused: {reason}"),
            // The server closed: it is shutting down or restarting; offer again.
            None => return Ok(()),
            Some(other) => bail!("the API server sent {other:?} instead of the bootstrap"),
        };
        // The output queue listens where the server reached us.
        boot.output_bind = Some(stream.local_addr()?.ip().to_string());
        // Pinned within this machine's ranks, by the rank the server gave.
        let mut parallel = self.config.parallel.clone();
        parallel.data_parallel_rank = self.rank;
        let (mut child, stdin, stdout) = match start_engine_core(self.exe, &boot, &parallel) {
            Ok(started) => started,
            Err(e) => {
                let _ = DpMessage::Exited {
                    status: format!("could not start: {e:#}"),
                    success: false,
                }
                .send(&mut stream);
                return Ok(());
            }
        };
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let ready = DpMessage::Ready {
            pid: child.id(),
            line,
        };
        if ready.send(&mut stream).is_err() {
            drop(stdin);
            end(&mut child, self.grace);
            return Ok(());
        }
        let closed = Arc::new(AtomicBool::new(false));
        let watcher = {
            let closed = Arc::clone(&closed);
            std::thread::Builder::new()
                .name(format!("dp-{}-server", self.rank))
                .spawn(move || {
                    // The server sends nothing more: any end is its close.
                    while let Ok(Some(_)) = DpMessage::recv(&mut reader) {}
                    closed.store(true, Ordering::Release);
                })?
        };
        loop {
            if closed.load(Ordering::Acquire) {
                tracing::info!(
                    rank = self.rank,
                    "the API server closed; stopping the engine core"
                );
                break;
            }
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    tracing::error!(rank = self.rank, %status, "the engine core died");
                }
                let _ = DpMessage::Exited {
                    status: status.to_string(),
                    success: status.success(),
                }
                .send(&mut stream);
                break;
            }
            std::thread::sleep(POLL);
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
        drop(stdin);
        end(&mut child, self.grace);
        let _ = watcher.join();
        Ok(())
    }
}

/// Waits up to `grace` for an engine core whose death pipe closed, then
/// kills it.
fn end(child: &mut Child, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(POLL);
    }
    let _ = child.kill();
    let _ = child.wait();
}
