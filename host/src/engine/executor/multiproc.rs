//! `MultiprocExecutor`: one worker process per rank (vLLM's
//! `MultiprocExecutor`), started by re-executing the `host` binary as the
//! hidden `host worker` command (see `worker::proc` for its side).
//!
//! Start: create the broadcast queue (one reader per rank), spawn the
//! processes, write each its bootstrap, collect READY (with the response
//! queue's handle) from every ready pipe, attach to the response queues,
//! wait for every rank to attach to the broadcast queue, start the monitor.
//! Calls: one broadcast enqueue, then the replies in call order
//! ([`super::rpc`]). Shutdown: [`super::monitor::WorkerSet::terminate`].

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::monitor::{Monitor, WorkerSet};
use super::nodes::{node_ranks, RemoteNodes};
use super::rpc::ReplyBook;
use super::{check_rank, Executor, ExecutorError, RpcFuture};
use crate::config::EngineConfig;
use crate::distributed::{AllReduceOwner, GroupHandle, TcpAllReduceHub, DEFAULT_SLOT_FLOATS};
use crate::message_queue::{Handle, MessageQueue, QueueConfig, QueueError};
use crate::sampling::rng::Xoshiro256StarStar;
use crate::step::{RpcRequest, RpcValue};
use crate::worker::proc::{Bootstrap, ReadyMessage};

/// Worker processes driven over shared-memory queues.
pub struct MultiprocExecutor {
    rpc: MessageQueue,
    book: Arc<Mutex<ReplyBook>>,
    workers: Arc<WorkerSet>,
    monitor: Monitor,
    world_size: usize,
    execute_model_timeout: Option<Duration>,
    shutdown_timeout: Duration,
    /// The tensor-parallel all-reduce segment (`world_size > 1`), kept so
    /// its name is unlinked even if a rank never attaches.
    all_reduce: Option<AllReduceOwner>,
    /// The all-reduce hub of a multi-node group, kept for the group's life.
    hub: Option<TcpAllReduceHub>,
    /// Seeds for requests that gave none, drawn here so that every
    /// tensor-parallel rank samples the same tokens.
    seeds: Xoshiro256StarStar,
    /// Seconds the slowest rank took to load the model.
    load_s: f64,
}

impl MultiprocExecutor {
    /// Starts `world_size` worker processes for `config` (each loads the
    /// model) and connects to them. Fails, leaving no process behind, if
    /// any rank does not report READY within `parallel.worker_start_timeout_s`.
    pub fn start(
        config: &EngineConfig,
        eos_token_id: Option<u32>,
        world_size: usize,
    ) -> Result<MultiprocExecutor, ExecutorError> {
        let p = &config.parallel;
        let secs = |key: &str, s: f64| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                ExecutorError::Call(format!("parallel.{key} = {s} is not a duration in seconds"))
            })
        };
        let start_timeout = secs("worker_start_timeout_s", p.worker_start_timeout_s)?;
        let shutdown_timeout = secs("worker_shutdown_timeout_s", p.worker_shutdown_timeout_s)?;
        let execute_model_timeout = secs("execute_model_timeout_s", p.execute_model_timeout_s)?;
        let exe = worker_executable(p.worker_executable.as_deref())?;
        let queue_err = |what: &str| {
            let what = what.to_string();
            move |source| ExecutorError::Queue { what, source }
        };
        // A multi-node group: this machine runs the first ranks, the other
        // nodes read the broadcast queue over TCP.
        let nnodes = p.nnodes.max(1);
        let local = node_ranks(world_size, nnodes, 0);
        let remote_ranks: Vec<usize> = (local.end..world_size).collect();
        let listen = format!("{}:{}", p.master_addr, p.master_port);
        let node_listener = (nnodes > 1)
            .then(|| RemoteNodes::bind(&listen))
            .transpose()?;
        let rpc = MessageQueue::new_writer_with_remote(
            world_size,
            &remote_ranks,
            &p.master_addr,
            QueueConfig::default(),
        )
        .map_err(queue_err("creating the broadcast queue"))?;
        // Tensor parallelism shards the model over the ranks; without it
        // (`tensor_parallel_size = 1`) several ranks are whole replicas.
        let tp = p.tensor_parallel_size;
        if tp > 1 && tp != world_size {
            return Err(ExecutorError::Start {
                rank: 0,
                message: format!(
                    "parallel.tensor_parallel_size = {tp} needs {tp} workers, not {world_size}"
                ),
            });
        }
        let all_reduce = (tp > 1 && nnodes == 1)
            .then(|| AllReduceOwner::create(world_size, DEFAULT_SLOT_FLOATS, execute_model_timeout))
            .transpose()
            .map_err(|e| ExecutorError::Start {
                rank: 0,
                message: format!("cannot create the tensor-parallel all-reduce segment: {e}"),
            })?;
        // Across machines the all-reduce runs through a hub in this process.
        let hub = (tp > 1 && nnodes > 1)
            .then(|| TcpAllReduceHub::start(world_size, &p.master_addr, execute_model_timeout))
            .transpose()
            .map_err(|e| ExecutorError::Start {
                rank: 0,
                message: format!("cannot start the tensor-parallel all-reduce hub: {e}"),
            })?;
        let boot = |rank| Bootstrap {
            rank,
            world_size,
            config_toml: config.to_toml(),
            eos_token_id,
            rpc_handle: rpc.export_handle(),
            attach_timeout: start_timeout,
            all_reduce: all_reduce
                .as_ref()
                .map(|a| GroupHandle::Shm(a.handle().clone()))
                .or_else(|| hub.as_ref().map(|h| GroupHandle::Tcp(h.handle()))),
            response_bind: None,
        };
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut children = Vec::with_capacity(world_size);
        let mut spawned = Ok(());
        for rank in local {
            match spawn(&exe, &boot(rank), ready_tx.clone()) {
                Ok(child) => children.push(child),
                Err(message) => {
                    spawned = Err(ExecutorError::Start { rank, message });
                    break;
                }
            }
        }
        let remote = match (spawned, node_listener) {
            (Ok(()), Some(listener)) => RemoteNodes::accept(
                (listener, &listen),
                nnodes,
                world_size,
                &boot,
                &ready_tx,
                start_timeout,
            ),
            (Ok(()), None) => Ok(RemoteNodes::none()),
            (Err(e), _) => Err(e),
        };
        drop(ready_tx);
        let (remote, spawned) = match remote {
            Ok(remote) => (remote, Ok(())),
            Err(e) => (RemoteNodes::none(), Err(e)),
        };
        let workers = Arc::new(WorkerSet::with_remote(children, remote));
        let connected = spawned.and_then(|()| {
            let (handles, load_s) = collect_ready(&workers, &ready_rx, world_size, start_timeout)?;
            let queues = handles
                .iter()
                .enumerate()
                .map(|(rank, h)| {
                    MessageQueue::create_from_handle(h, 0).map_err(queue_err(&format!(
                        "attaching to worker rank {rank}'s response queue"
                    )))
                })
                .collect::<Result<Vec<_>, _>>()?;
            rpc.wait_until_ready(start_timeout)
                .map_err(queue_err("waiting for the workers to attach"))?;
            Ok((queues, load_s))
        });
        let (queues, load_s) = match connected {
            Ok(queues) => queues,
            Err(e) => {
                workers.terminate(Duration::ZERO);
                return Err(e);
            }
        };
        let monitor = Monitor::start(workers.clone()).map_err(|e| ExecutorError::Start {
            rank: 0,
            message: format!("cannot start the worker monitor thread: {e}"),
        })?;
        let book = Arc::new(Mutex::new(ReplyBook::new(queues, workers.clone())));
        Ok(MultiprocExecutor {
            rpc,
            book,
            workers,
            monitor,
            world_size,
            execute_model_timeout: Some(execute_model_timeout),
            shutdown_timeout,
            all_reduce,
            hub,
            seeds: Xoshiro256StarStar::from_entropy(),
            load_s,
        })
    }

    /// Seconds the slowest rank took to load the model at start.
    pub fn model_load_seconds(&self) -> f64 {
        self.load_s
    }

    /// The worker processes' ids, by rank (a remote rank's on its node).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.pids()
    }
}

impl Executor for MultiprocExecutor {
    fn name(&self) -> &'static str {
        "mp"
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn execute_model_timeout(&self) -> Option<Duration> {
        self.execute_model_timeout
    }

    /// What the monitor thread recorded (it polls every
    /// [`super::monitor::POLL_INTERVAL`]).
    fn worker_death(&self) -> Option<ExecutorError> {
        self.workers.death()
    }

    fn shutdown(&mut self) {
        self.monitor.stop();
        self.workers.terminate(self.shutdown_timeout);
        self.rpc.shutdown();
    }

    fn collective_rpc(
        &mut self,
        method: &str,
        args: RpcValue,
        unique_reply_rank: Option<usize>,
        non_block: bool,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture, ExecutorError> {
        check_rank(unique_reply_rank, self.world_size)?;
        if let Some(death) = self.workers.death() {
            return Err(death);
        }
        let output_rank = unique_reply_rank.map(|r| r as u32);
        let args = if self.all_reduce.is_some() || self.hub.is_some() {
            seed_unseeded(args, &mut self.seeds)
        } else {
            args
        };
        let request = RpcRequest {
            method: method.to_string(),
            args,
            output_rank,
        };
        self.rpc
            .enqueue(&request, timeout)
            .map_err(|source| match source {
                QueueError::Full { .. } | QueueError::Shutdown => {
                    self.workers.poll().unwrap_or(ExecutorError::Queue {
                        what: format!("broadcasting `{method}`"),
                        source,
                    })
                }
                source => ExecutorError::Queue {
                    what: format!("broadcasting `{method}`"),
                    source,
                },
            })?;
        let ranks = unique_reply_rank.map_or_else(|| (0..self.world_size).collect(), |r| vec![r]);
        let future = ReplyBook::push(&self.book, method, ranks, timeout);
        if non_block {
            Ok(future)
        } else {
            Ok(RpcFuture::ready(Ok(future.result()?)))
        }
    }
}

impl Drop for MultiprocExecutor {
    /// Shuts the workers down: close the death pipes, wait
    /// `parallel.worker_shutdown_timeout_s`, SIGTERM, wait 4 s, SIGKILL.
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Gives every new request of a step that has no seed one drawn from
/// `seeds`: tensor-parallel ranks each sample from the same (bit-identical)
/// logits, and must draw the same random numbers too, or their sequences
/// (and so their next inputs) would diverge.
fn seed_unseeded(args: RpcValue, seeds: &mut Xoshiro256StarStar) -> RpcValue {
    match args {
        RpcValue::SchedulerOutput(mut so) => {
            for new in &mut so.scheduled_new_reqs {
                let seed = &mut new.sampling_params.seed;
                if seed.is_none() {
                    *seed = Some(seeds.next_u64());
                }
            }
            RpcValue::SchedulerOutput(so)
        }
        other => other,
    }
}

/// Starts one worker process and writes its bootstrap; a thread forwards
/// its ready line (or the end of its stdout) to `ready`.
pub(super) fn spawn(
    exe: &Path,
    boot: &Bootstrap,
    ready: mpsc::Sender<(usize, std::io::Result<String>)>,
) -> Result<(Child, ChildStdin), String> {
    // Its own process group: a Ctrl-C at the terminal reaches only the
    // engine, which then shuts the workers down through their death pipes
    // (a draining server keeps its workers until it is done).
    let mut child = Command::new(exe)
        .arg("worker")
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        return Err("the worker's stdin / stdout pipes are missing".into());
    };
    let line =
        serde_json::to_string(boot).map_err(|e| format!("cannot encode the bootstrap: {e}"))?;
    if let Err(e) = writeln!(stdin, "{line}").and_then(|()| stdin.flush()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("cannot write the bootstrap to its stdin: {e}"));
    }
    let rank = boot.rank;
    let reader = std::thread::Builder::new()
        .name(format!("worker-{rank}-ready"))
        .spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = ready.send((rank, read));
        });
    if let Err(e) = reader {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("cannot start its ready-pipe reader: {e}"));
    }
    Ok((child, stdin))
}

/// Collects every rank's READY message: the response-queue handles by
/// rank, and the slowest rank's model-load seconds.
fn collect_ready(
    workers: &WorkerSet,
    ready: &mpsc::Receiver<(usize, std::io::Result<String>)>,
    world_size: usize,
    timeout: Duration,
) -> Result<(Vec<Handle>, f64), ExecutorError> {
    let mut load_s = 0f64;
    let deadline = Instant::now() + timeout;
    let mut handles: Vec<Option<Handle>> = vec![None; world_size];
    while handles.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, line) = ready.recv_timeout(left).map_err(|_| {
            let rank = handles.iter().position(Option::is_none).unwrap_or(0);
            ExecutorError::Start {
                rank,
                message: format!("no READY within {timeout:?} (parallel.worker_start_timeout_s)"),
            }
        })?;
        let fail = |message: String| ExecutorError::Start { rank, message };
        match line.map(|l| serde_json::from_str::<ReadyMessage>(&l)) {
            Ok(Ok(ReadyMessage::Ready {
                response_handle,
                load_s: rank_load_s,
            })) => {
                handles[rank] = Some(response_handle);
                load_s = load_s.max(rank_load_s);
            }
            Ok(Ok(ReadyMessage::Failed { error })) => return Err(fail(error)),
            Ok(Err(_)) | Err(_) => {
                // The ready pipe closed or carried garbage: the process ended.
                let how = match workers.reap(rank) {
                    ExecutorError::WorkerDied { status, .. } => status,
                    other => other.to_string(),
                };
                return Err(fail(format!(
                    "it exited before READY ({how}); its stderr says why"
                )));
            }
        }
    }
    Ok((handles.into_iter().flatten().collect(), load_s))
}

/// The `host` binary to start workers from: `parallel.worker_executable`,
/// else this program if it is `host`, else a `host` beside it or one folder
/// up (test and bench binaries live in `target/<profile>/deps`).
pub(crate) fn worker_executable(configured: Option<&Path>) -> Result<PathBuf, ExecutorError> {
    let fail = |message: String| ExecutorError::Start { rank: 0, message };
    if let Some(path) = configured {
        return if path.is_file() {
            Ok(path.to_path_buf())
        } else {
            Err(fail(format!(
                "parallel.worker_executable = {} is not a file",
                path.display()
            )))
        };
    }
    let me = std::env::current_exe()
        .map_err(|e| fail(format!("cannot find this program's path: {e}")))?;
    let name = format!("host{}", std::env::consts::EXE_SUFFIX);
    if me.file_name().is_some_and(|n| n == name.as_str()) {
        return Ok(me);
    }
    let dir = me.parent();
    let found = [dir, dir.and_then(Path::parent)]
        .into_iter()
        .flatten()
        .map(|d| d.join(&name))
        .find(|p| p.is_file());
    found.ok_or_else(|| {
            fail(format!(
                "this program ({}) is not `host` and no `host` binary is beside it; set parallel.worker_executable",
                me.display()
            ))
        })
}
