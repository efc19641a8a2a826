//! The worker processes of a `MultiprocExecutor` and the monitor that
//! notices when one dies (vLLM's `MultiprocWorkerMonitor`), plus their
//! termination: close the death pipes, wait, SIGTERM, wait, SIGKILL.
//!
//! The first death is recorded once and is sticky: every pending and later
//! call fails with an error naming the rank, its pid and how it ended.

use std::process::{Child, ChildStdin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::nodes::RemoteNodes;
use super::ExecutorError;

/// How often the monitor looks at the worker processes. A death is
/// reported within this (plus the caller's own wait slice), well inside
/// the 1 s the engine promises; a `waitpid` ten times a second costs
/// nothing measurable.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How long a worker gets after SIGTERM before SIGKILL (as vLLM).
const SIGTERM_GRACE: Duration = Duration::from_secs(4);

/// One worker process.
struct Proc {
    child: Child,
    /// The write end of its death pipe (its stdin); dropping it is the
    /// signal to exit.
    death_pipe: Option<ChildStdin>,
}

/// The worker processes, by rank: this machine's first, then those of
/// the other nodes of a multi-node group, which are watched through their
/// node's connection.
pub struct WorkerSet {
    procs: Mutex<Vec<Proc>>,
    pids: Vec<u32>,
    remote: RemoteNodes,
    failed: AtomicBool,
    death: Mutex<Option<(usize, String)>>,
}

impl WorkerSet {
    /// Takes ownership of started processes (their stdin is the death pipe).
    pub fn new(children: Vec<(Child, ChildStdin)>) -> WorkerSet {
        WorkerSet::with_remote(children, RemoteNodes::none())
    }

    /// Local processes (ranks `0..children.len()`) and the ranks of the
    /// other nodes.
    pub fn with_remote(children: Vec<(Child, ChildStdin)>, remote: RemoteNodes) -> WorkerSet {
        let pids = children.iter().map(|(c, _)| c.id()).collect();
        let procs = children
            .into_iter()
            .map(|(child, pipe)| Proc {
                child,
                death_pipe: Some(pipe),
            })
            .collect();
        WorkerSet {
            procs: Mutex::new(procs),
            pids,
            remote,
            failed: AtomicBool::new(false),
            death: Mutex::new(None),
        }
    }

    /// The process ids, by rank (a remote rank's is a process on its node,
    /// 0 until it is ready).
    pub fn pids(&self) -> Vec<u32> {
        (0..self.pids.len().max(self.remote.world_size()))
            .map(|r| self.pid(r))
            .collect()
    }

    /// Rank `rank`'s process id.
    pub fn pid(&self, rank: usize) -> u32 {
        match self.pids.get(rank) {
            Some(&pid) => pid,
            None => self.remote.pid(rank),
        }
    }

    /// The first worker found ended, by rank, and how (a headless node's
    /// watch, which reports it to node 0).
    pub fn first_exit(&self) -> Option<(usize, String)> {
        match self.poll()? {
            ExecutorError::WorkerDied { rank, status, .. } => Some((rank, status)),
            other => Some((0, other.to_string())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Proc>> {
        // A panic while holding the lock leaves plain data behind; go on.
        self.procs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The recorded death, if any worker has died.
    pub fn death(&self) -> Option<ExecutorError> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let death = self.death.lock().unwrap_or_else(|e| e.into_inner());
        death
            .as_ref()
            .map(|(rank, status)| ExecutorError::WorkerDied {
                rank: *rank,
                pid: self.pid(*rank),
                status: status.clone(),
            })
    }

    /// Looks at every process once; records and returns the first death.
    pub fn poll(&self) -> Option<ExecutorError> {
        let mut procs = self.lock();
        for (rank, p) in procs.iter_mut().enumerate() {
            if let Ok(Some(status)) = p.child.try_wait() {
                self.record(rank, status.to_string());
                break;
            }
        }
        drop(procs);
        if let Some((rank, status)) = self.remote.lost() {
            self.record(rank, status);
        }
        self.death()
    }

    /// The death of `rank`, which a queue reported as gone: waits up to a
    /// second for its exit status to be collectable.
    pub fn reap(&self, rank: usize) -> ExecutorError {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            if let Some(e) = self.poll() {
                return e;
            }
            if Instant::now() >= deadline {
                let status = "its queue reports it gone, but it has not exited".to_string();
                self.record(rank, status.clone());
                return self.death().unwrap_or(ExecutorError::WorkerDied {
                    rank,
                    pid: self.pid(rank),
                    status,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn record(&self, rank: usize, status: String) {
        let mut death = self.death.lock().unwrap_or_else(|e| e.into_inner());
        if death.is_none() {
            tracing::error!(rank, pid = self.pid(rank), %status, "worker process died");
            *death = Some((rank, status));
            self.failed.store(true, Ordering::Release);
        }
    }

    /// Ends every process: closes the death pipes, waits up to `grace` for
    /// them to exit, sends SIGTERM, waits 4 s, sends SIGKILL, and reaps.
    pub fn terminate(&self, grace: Duration) {
        self.remote.close();
        let mut procs = self.lock();
        procs.iter_mut().for_each(|p| drop(p.death_pipe.take()));
        if wait_all(&mut procs, grace) {
            return;
        }
        signal_all(&mut procs, libc::SIGTERM);
        if wait_all(&mut procs, SIGTERM_GRACE) {
            return;
        }
        for p in procs.iter_mut() {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

/// Waits until every process has exited or `limit` passes; true if all did.
fn wait_all(procs: &mut [Proc], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let running = procs
            .iter_mut()
            .map(|p| matches!(p.child.try_wait(), Ok(None)))
            .filter(|&r| r)
            .count();
        if running == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal_all(procs: &mut [Proc], signal: libc::c_int) {
    for p in procs.iter_mut() {
        if matches!(p.child.try_wait(), Ok(None)) {
            // SAFETY: kill has no memory-safety preconditions; the pid is our
            // own unreaped child, so it cannot have been reused.
            unsafe { libc::kill(p.child.id() as libc::pid_t, signal) };
        }
    }
}

/// The monitor thread: polls the processes until stopped or one dies.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Starts watching `workers`.
    pub fn start(workers: Arc<WorkerSet>) -> std::io::Result<Monitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("worker-monitor".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) && workers.poll().is_none() {
                    std::thread::park_timeout(POLL_INTERVAL);
                }
            })?;
        Ok(Monitor {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop();
    }
}
