//! Starting one `host engine-core` process: spawn it, write its bootstrap
//! on stdin, read READY from stdout, attach both queues. Done once at
//! start-up and again for every restart, each time with a new pair of
//! queues.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

use super::{affinity, Bootstrap, Ready};
use crate::config::EngineConfig;
use crate::engine::core::EngineStats;
use crate::engine::executor::worker_executable;
use crate::message_queue::{MessageQueue, QueueConfig};

/// How long the process has to attach to our queue once it said READY.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);

/// A process spawned and bootstrapped, loading the model.
pub(super) struct Spawned {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    input: MessageQueue,
}

/// A process that is ready: both queues attached.
pub(super) struct Launched {
    /// The process, for the supervisor to reap.
    pub child: Child,
    /// Closing it tells the process its client is gone.
    pub death_pipe: ChildStdin,
    /// The queue we write client messages to.
    pub input: MessageQueue,
    /// The queue we read the engine core's messages from.
    pub output: MessageQueue,
    /// The longest context a request may have.
    pub max_model_len: usize,
    /// The counters before any request.
    pub stats: EngineStats,
}

/// Spawns `host engine-core` for `config` and writes its bootstrap; the
/// model loads while the caller goes on (see [`Spawned::handshake`]).
pub(super) fn spawn(config: &EngineConfig) -> anyhow::Result<Spawned> {
    let exe = worker_executable(config.parallel.worker_executable.as_deref())?;
    let input = MessageQueue::new_writer(1, QueueConfig::default())?;
    let boot = Bootstrap {
        config_toml: config.to_toml(),
        input_handle: input.export_handle(),
    };
    let mut command = Command::new(&exe);
    command
        .arg("engine-core")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let parallel = &config.parallel;
    if parallel.data_parallel_size > 1 {
        let allowed = affinity::allowed_cores().context("reading this process's CPU affinity")?;
        let cores = affinity::cores_for_rank(
            &allowed,
            parallel.data_parallel_rank,
            parallel.data_parallel_size,
        );
        affinity::pin(&mut command, &cores);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {} engine-core", exe.display()))?;
    let (mut stdin, stdout) = (
        child.stdin.take().expect("piped"),
        child.stdout.take().expect("piped"),
    );
    let written = writeln!(stdin, "{}", serde_json::to_string(&boot)?).and_then(|()| stdin.flush());
    if let Err(e) = written {
        drop(stdin);
        let _ = child.wait();
        return Err(e).context("writing the engine-core process's bootstrap");
    }
    Ok(Spawned {
        child,
        stdin,
        stdout,
        input,
    })
}

impl Spawned {
    /// The process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for READY (the process loads the model first) and attaches
    /// the queues. On failure the process is gone and reaped.
    pub fn handshake(self) -> anyhow::Result<Launched> {
        let Spawned {
            mut child,
            stdin,
            stdout,
            input,
        } = self;
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let (output_handle, max_model_len, stats) = match serde_json::from_str::<Ready>(&line) {
            Ok(Ready::Ready {
                output_handle,
                max_model_len,
                stats,
            }) => (output_handle, max_model_len, stats),
            Ok(Ready::Failed(reason)) => {
                let _ = child.wait();
                bail!("the engine-core process failed to start: {reason}");
            }
            Err(_) => {
                drop(stdin);
                let status = child.wait()?;
                read.context("reading the engine-core process's READY line")?;
                bail!("the engine-core process exited before it was ready ({status}); its stderr says why");
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
                child,
                death_pipe: stdin,
                input,
                output,
                max_model_len,
                stats,
            }),
            Err(e) => {
                // The death pipe makes it exit; reap it.
                drop(stdin);
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Ends the process unstarted (a shutdown came first) and reaps it.
    pub fn abandon(self) {
        let Spawned {
            mut child, stdin, ..
        } = self;
        drop(stdin);
        let _ = child.wait();
    }
}
