//! An engine-core process as the client sees it: a child of this process,
//! or one a headless machine started for it (`remote.rs`). Either way the
//! client reads its READY line, holds its death pipe, and waits for its end.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, ChildStdout, ExitStatus};

use super::remote::RemoteCore;

/// A started engine-core process.
pub(super) enum CoreProcess {
    /// A child of this process; `stdout` until its READY line is read.
    Local {
        child: Child,
        stdout: Option<ChildStdout>,
    },
    /// One on another machine, reached through that machine's connection.
    Remote(RemoteCore),
}

/// What the client holds to keep the process alive: dropping it tells the
/// process its client is gone.
pub(super) enum DeathPipe {
    /// The child's stdin, held for its close.
    Local { _stdin: ChildStdin },
    /// The headless machine's connection, closed for writing on drop.
    Remote(std::net::TcpStream),
}

impl Drop for DeathPipe {
    fn drop(&mut self) {
        if let DeathPipe::Remote(stream) = self {
            // A clone reads the other side's reports: only a shutdown ends
            // the connection for the machine while that clone lives.
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
    }
}

/// How a process ended.
pub(super) struct Exit {
    /// Said for the log and the streams, naming the process.
    pub description: String,
    /// Exit status 0.
    pub clean: bool,
    /// Whether it surely ended: a process that could not be waited for may
    /// still run, and a second one beside it is no remedy.
    pub certain: bool,
}

impl CoreProcess {
    /// The process id (on its own machine, for a remote one).
    pub fn id(&self) -> u32 {
        match self {
            CoreProcess::Local { child, .. } => child.id(),
            CoreProcess::Remote(remote) => remote.pid(),
        }
    }

    /// Whether it runs on this machine (only then may it be signalled).
    pub fn is_local(&self) -> bool {
        matches!(self, CoreProcess::Local { .. })
    }

    /// Its READY line; empty when it ended before writing one.
    pub fn read_ready_line(&mut self) -> std::io::Result<String> {
        match self {
            CoreProcess::Local { stdout, .. } => {
                let mut line = String::new();
                if let Some(out) = stdout.take() {
                    BufReader::new(out).read_line(&mut line)?;
                }
                Ok(line)
            }
            CoreProcess::Remote(remote) => remote.read_ready_line(),
        }
    }

    /// Waits for its end.
    pub fn wait(&mut self) -> Exit {
        match self {
            CoreProcess::Local { child, .. } => {
                let pid = child.id();
                let status = child.wait();
                local_exit(pid, &status)
            }
            CoreProcess::Remote(remote) => remote.wait(),
        }
    }
}

/// How a child ended, naming it.
fn local_exit(pid: u32, status: &std::io::Result<ExitStatus>) -> Exit {
    match status {
        Ok(s) => Exit {
            description: format!("the engine-core process (pid {pid}) exited: {s}"),
            clean: s.success(),
            certain: true,
        },
        Err(e) => Exit {
            description: format!(
                "the engine-core process (pid {pid}) could not be waited for: {e}"
            ),
            clean: false,
            certain: false,
        },
    }
}
