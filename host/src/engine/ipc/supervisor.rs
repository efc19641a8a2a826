//! The supervisor thread of an engine-core process, and the reader thread
//! of each. The supervisor reaps the process; an exit nobody asked for is
//! a death, and while `[engine]`'s restart budget allows, it starts a new
//! process with the same configuration and replays every unfinished
//! request there as its prompt plus the tokens its stream already has, so
//! clients see one uninterrupted stream. Past the budget (or when the
//! engine core reported itself dead) every stream ends with the
//! engine-dead sentinel, as without restarts.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::client_side::{lock, Conn, Counts, Link, Pending};
use super::launch::{self, Launched, Launcher};
use super::process::CoreProcess;
use super::{ClientMessage, CoreMessage};
use crate::config::EngineConfig;
use crate::engine::client::EngineCoreError;
use crate::engine::restart::RestartBudget;
use crate::engine::shared::{Liveness, Shared};
use crate::message_queue::MessageQueue;

/// What the supervisor shares with the transport, and owns.
pub(super) struct Supervisor {
    /// What every new process is started with (the first one's).
    pub config: EngineConfig,
    /// Where it starts.
    pub launcher: Launcher,
    /// `[engine]`'s restarts within its window.
    pub budget: RestartBudget,
    /// The transport's way to the current process.
    pub link: Arc<std::sync::Mutex<Link>>,
    /// The streams (and their replay set), the counters, the liveness.
    pub shared: Arc<Shared>,
    /// Utility callers waiting for answers.
    pub pending: Pending,
    /// The restarts and replays, for the metrics.
    pub counts: Arc<Counts>,
    /// Told once the supervisor is done (the engine stopped for good).
    pub exited: Sender<()>,
}

/// A process and the thread reading its outputs.
struct Running {
    process: CoreProcess,
    reader: JoinHandle<()>,
}

/// How an attempt to replace the process ended, when it did not fail.
enum Relaunch {
    /// Connected, with the requests replayed (those an earlier process had).
    Connected(Running, usize),
    /// A shutdown came while it started; it was ended unused.
    ShutDown,
}

impl Supervisor {
    /// Starts the supervisor thread for a running process.
    pub fn spawn(
        self,
        process: CoreProcess,
        reader: JoinHandle<()>,
    ) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("engine-client-watcher".into())
            .spawn(move || self.run(Running { process, reader }))
    }

    fn run(mut self, mut running: Running) {
        loop {
            let exit = running.process.wait();
            let death = exit.description;
            // Cut the link first: from here on sends leave their requests
            // to the replay and utility calls fail at once, so the calls
            // pending now are all there will be.
            let expected = {
                let mut link = lock(&self.link);
                link.conn = None;
                link.shutting_down
            };
            // The reader drains what the process wrote before it died: the
            // replay set then holds every token a stream received, and a
            // call answered before the death gets its answer.
            let _ = running.reader.join();
            self.fail_pending(&death);
            if expected {
                self.shared.stop((!exit.clean).then_some(death));
                break;
            }
            if !exit.certain {
                // Whether it still runs is unknown: a second one beside it
                // is no remedy.
                self.shared.stop(Some(death));
                break;
            }
            if self.shared.liveness() != Liveness::Alive {
                // The engine core reported itself dead before exiting (its
                // reader passed the reason on): that is a verdict, e.g. a
                // worker restart budget spent, which a new process would
                // only reset.
                break;
            }
            match self.restart(&death) {
                Some(next) => running = next,
                None => break,
            }
        }
        let _ = self.exited.send(());
    }

    /// Calls still unanswered died with the process: their effect is unknown.
    fn fail_pending(&self, death: &str) {
        for (_, tx) in lock(&self.pending).drain() {
            let _ = tx.send(Err(EngineCoreError::Unavailable(format!(
                "{death} while this call ran; whether it took effect is unknown"
            ))));
        }
    }

    /// Replaces the dead process while the budget allows, a start that
    /// fails spending a restart too (a crash loop spends them all); `None`
    /// once the engine stopped instead.
    fn restart(&mut self, death: &str) -> Option<Running> {
        let mut failed: Vec<String> = Vec::new();
        loop {
            let n = match self.budget.take(Instant::now()) {
                Ok(n) => n,
                Err(refusal) => {
                    let reason = match failed.last() {
                        None => format!("{death}; {refusal}"),
                        Some(last) => format!(
                            "{death}; a crash loop: {} restart(s) in a row failed to start, \
                             the last with: {last}; {refusal}",
                            failed.len()
                        ),
                    };
                    self.shared.stop(Some(reason));
                    return None;
                }
            };
            tracing::error!(
                "{death}; restarting it (restart {n} of at most {} within {} s) and replaying \
                 {} unfinished request(s)",
                self.budget.max(),
                self.budget.window().as_secs_f64(),
                self.shared.num_live()
            );
            let started = Instant::now();
            match self.relaunch() {
                Ok(Relaunch::Connected(running, replayed)) => {
                    // A warning, as the death was an error: the default log
                    // level shows how long the engine was away.
                    tracing::warn!(
                        "the engine-core process restarted as pid {} in {:.2} s (restart {n}); \
                         {replayed} request(s) replayed",
                        running.process.id(),
                        started.elapsed().as_secs_f64()
                    );
                    return Some(running);
                }
                Ok(Relaunch::ShutDown) => {
                    self.shared.stop(None);
                    return None;
                }
                Err(e) if lock(&self.link).shutting_down => {
                    // Killed by an aborting shutdown while it started.
                    tracing::info!("the replacement engine-core process ended by shutdown: {e:#}");
                    self.shared.stop(None);
                    return None;
                }
                Err(e) => {
                    tracing::error!(
                        "restart {n}: the new engine-core process failed to start: {e:#}"
                    );
                    failed.push(format!("{e:#}"));
                }
            }
        }
    }

    /// Starts a new process and, under the link, connects it and sends it
    /// every live request; the link stays cut until then, so a request
    /// added meanwhile is in the replay set and sent once.
    fn relaunch(&mut self) -> anyhow::Result<Relaunch> {
        let spawned = launch::spawn(&self.config, &self.launcher)?;
        {
            let mut link = lock(&self.link);
            link.pid = spawned.pid();
            link.local = spawned.process.is_local();
            if link.shutting_down {
                drop(link);
                spawned.abandon();
                return Ok(Relaunch::ShutDown);
            }
        }
        let Launched {
            mut process,
            death_pipe,
            input,
            output,
            stats,
            ..
        } = spawned.handshake()?;
        let mut link = lock(&self.link);
        let conn = Conn {
            input,
            _death_pipe: death_pipe,
        };
        if link.shutting_down {
            drop(link);
            drop(conn);
            process.wait();
            return Ok(Relaunch::ShutDown);
        }
        let reader = match spawn_reader(output, &self.shared, &self.pending) {
            Ok(reader) => reader,
            Err(e) => {
                drop(link);
                drop(conn);
                process.wait();
                return Err(e.into());
            }
        };
        self.shared.carry_over(stats);
        let (requests, replayed) = self.shared.take_replay();
        // Counted before any replayed request can finish, so a client that
        // saw its stream end sees the restart in the metrics.
        self.counts.restarts.fetch_add(1, Ordering::Relaxed);
        self.counts
            .replayed
            .fetch_add(replayed as u64, Ordering::Relaxed);
        for req in requests {
            if let Err(e) = conn.input.enqueue(&ClientMessage::Add(Box::new(req)), None) {
                // It died already; its exit brings the next replay.
                tracing::warn!("replaying to the new engine-core process failed: {e}");
                break;
            }
        }
        link.conn = Some(conn);
        // Known only once READY came.
        link.pid = process.id();
        Ok(Relaunch::Connected(Running { process, reader }, replayed))
    }
}

/// Starts the reader thread of one process's output queue.
pub(super) fn spawn_reader(
    output: MessageQueue,
    shared: &Arc<Shared>,
    pending: &Pending,
) -> std::io::Result<JoinHandle<()>> {
    let (shared, pending) = (Arc::clone(shared), Arc::clone(pending));
    std::thread::Builder::new()
        .name("engine-client-reader".into())
        .spawn(move || read_outputs(&output, &shared, &pending))
}

/// The reader thread: outputs to streams, answers to utility callers, until
/// the engine core stops writing.
fn read_outputs(output: &MessageQueue, shared: &Shared, pending: &Pending) {
    loop {
        match output.dequeue::<CoreMessage>(None) {
            Ok(CoreMessage::Step(outs, stats, events)) => {
                shared.publish_stats(*stats);
                shared.record_kv_events(events);
                shared.dispatch(outs);
            }
            Ok(CoreMessage::Rejected { request_id, reason }) => shared.reject(&request_id, reason),
            Ok(CoreMessage::Utility { call_id, result }) => {
                let result = result
                    .and_then(|text| {
                        serde_json::from_str(&text)
                            .map_err(|e| format!("the engine core answered with invalid JSON: {e}"))
                    })
                    .map_err(EngineCoreError::Utility);
                if let Some(tx) = lock(pending).remove(&call_id) {
                    let _ = tx.send(result);
                }
            }
            Ok(CoreMessage::Dead(reason)) => {
                shared.stop(Some(reason));
                return;
            }
            // The process ended (on another machine: its connection did);
            // the supervisor reports how.
            Err(e) if e.other_end_gone() => return,
            Err(e) => {
                shared.stop(Some(format!(
                    "a message from the engine core could not be read: {e}"
                )));
                return;
            }
        }
    }
}
