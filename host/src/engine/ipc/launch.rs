//! Starting one `host engine-core` process, here or on a headless machine:
//! spawn it, write its bootstrap on stdin, read READY from stdout, attach
//! both queues. Done once at start-up and again for every restart, each
//! time with a new pair of queues.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

use super::process::{CoreProcess, DeathPipe};
use super::remote::RemoteEngines;
use super::{affinity, Bootstrap, Ready};
use crate::config::EngineConfig;
use crate::engine::core::EngineStats;
use crate::engine::executor::worker_executable;
use crate::message_queue::{MessageQueue, QueueConfig};

/// How long the process has to attach to our queue once it said READY.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a rank's engine-core process starts.
#[derive(Clone)]
pub(crate) enum Launcher {
    /// As a child of this process.
    Local,
    /// On the headless machine that offers the rank.
    Remote(Arc<RemoteEngines>),
}

/// A process started and bootstrapped, loading the model.
pub(super) struct Spawned {
    pub process: CoreProcess,
    pub death_pipe: DeathPipe,
    pub input: MessageQueue,
}

/// A process that is ready: both queues attached.
pub(super) struct Launched {
    /// The process, for the supervisor to wait for.
    pub process: CoreProcess,
    /// Dropping it tells the process its client is gone.
    pub death_pipe: DeathPipe,
    /// The queue we write client messages to.
    pub input: MessageQueue,
    /// The queue we read the engine core's messages from.
    pub output: MessageQueue,
    /// The longest context a request may have.
    pub max_model_len: usize,
    /// The counters before any request.
    pub stats: EngineStats,
}

/// Starts the engine-core process for `config`'s data-parallel rank where
/// `launcher` says and sends its bootstrap; the model loads while the
/// caller goes on (see [`Spawned::handshake`]).
pub(super) fn spawn(config: &EngineConfig, launcher: &Launcher) -> anyhow::Result<Spawned> {
    match launcher {
        Launcher::Local => spawn_local(config),
        Launcher::Remote(remote) => remote.spawn(config),
    }
}

fn spawn_local(config: &EngineConfig) -> anyhow::Result<Spawned> {
    let exe = worker_executable(config.parallel.worker_executable.as_deref())?;
    let input = MessageQueue::new_writer(1, QueueConfig::default())?;
    let boot = Bootstrap {
        config_toml: config.to_toml(),
        input_handle: input.export_handle(),
        output_bind: None,
    };
    let (child, stdin, stdout) = start_engine_core(&exe, &boot, &config.parallel)?;
    Ok(Spawned {
        process: CoreProcess::Local {
            child,
            stdout: Some(stdout),
        },
        death_pipe: DeathPipe::Local { _stdin: stdin },
        input,
    })
}

/// Runs `exe engine-core` with `boot` on its stdin, pinned to this
/// machine's share of the cores for `boot`'s rank when the machine runs
/// more than one; returns it with its stdin (the death pipe) and stdout
/// (the READY line). Also what a headless machine does for its ranks.
pub(super) fn start_engine_core(
    exe: &Path,
    boot: &Bootstrap,
    parallel: &crate::config::ParallelConfig,
) -> anyhow::Result<(Child, ChildStdin, ChildStdout)> {
    let mut command = Command::new(exe);
    command
        .arg("engine-core")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let here = parallel.local_data_parallel_ranks();
    if here.len() > 1 {
        let allowed = affinity::allowed_cores().context("reading this process's CPU affinity")?;
        let index = parallel.data_parallel_rank.saturating_sub(here.start);
        affinity::pin(
            &mut command,
            &affinity::cores_for_rank(&allowed, index, here.len()),
        );
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {} engine-core", exe.display()))?;
    let (mut stdin, stdout) = (
        child.stdin.take().expect("piped"),
        child.stdout.take().expect("piped"),
    );
    let written = writeln!(stdin, "{}", serde_json::to_string(boot)?).and_then(|()| stdin.flush());
    if let Err(e) = written {
        drop(stdin);
        let _ = child.wait();
        return Err(e).context("writing the engine-core process's bootstrap");
    }
    Ok((child, stdin, stdout))
}

impl Spawned {
    /// The process's id (on its own machine).
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Waits for READY (the process loads the model first) and attaches
    /// the queues. On failure the process is gone and reaped.
    pub fn handshake(self) -> anyhow::Result<Launched> {
        let Spawned {
            mut process,
            death_pipe,
            input,
        } = self;
        let read = process.read_ready_line();
        let line = read.as_deref().unwrap_or_default();
        let (output_handle, max_model_len, stats) = match serde_json::from_str::<Ready>(line) {
            Ok(Ready::Ready {
                output_handle,
                max_model_len,
                stats,
            }) => (output_handle, max_model_len, stats),
            Ok(Ready::Failed(reason)) => {
                drop(death_pipe);
                let _ = process.wait();
                bail!("the engine-core process failed to start: {reason}");
            }
            Err(_) => {
                drop(death_pipe);
                let exit = process.wait();
                read.context("reading the engine-core process's READY line")?;
                bail!(
                    "{} before it was ready; its stderr says why",
                    exit.description
                );
            }
        };
        let attached = MessageQueue::create_from_handle(&output_handle, 0)
            .context("attaching to the engine core's output queue")
            .and_then(|output| {
                input
                    .wait_until_ready(ATTACH_TIMEOUT)
                    .context("waiting for the engine core to attach")?;
                Ok(output)
            });
        match attached {
            Ok(output) => Ok(Launched {
                process,
                death_pipe,
                input,
                output,
                max_model_len,
                stats,
            }),
            Err(e) => {
                // The death pipe makes it exit; reap it.
                drop(death_pipe);
                let _ = process.wait();
                Err(e)
            }
        }
    }

    /// Ends the process unstarted (a shutdown came first) and reaps it.
    pub fn abandon(self) {
        let Spawned {
            mut process,
            death_pipe,
            ..
        } = self;
        drop(death_pipe);
        let _ = process.wait();
    }
}
