//! The reply side of `collective_rpc` over message queues: calls in flight
//! and their in-order futures (vLLM's `futures_queue` + `FutureWrapper`).
//!
//! Each worker replies on its own single-reader response queue, in call
//! order, so replies must be read in call order too: resolving a future
//! first reads (and keeps) the replies of every earlier call still in
//! flight. A call that timed out stays in flight with whatever replies it
//! got; its late replies are read and dropped by the next call, so one slow
//! answer never shifts every later one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::monitor::{WorkerSet, POLL_INTERVAL};
use super::ExecutorError;
use crate::message_queue::{MessageQueue, QueueError};
use crate::step::{RpcReply, RpcValue};

/// The result of a `collective_rpc`: resolved already, or to be read from
/// the workers' response queues in call order.
pub struct RpcFuture {
    state: FutureState,
}

enum FutureState {
    Ready(Result<Vec<RpcValue>, ExecutorError>),
    Pending {
        id: u64,
        timeout: Option<Duration>,
        book: Arc<Mutex<ReplyBook>>,
    },
    Taken,
}

impl RpcFuture {
    /// A future that is already resolved.
    pub fn ready(result: Result<Vec<RpcValue>, ExecutorError>) -> RpcFuture {
        RpcFuture {
            state: FutureState::Ready(result),
        }
    }

    fn pending(id: u64, timeout: Option<Duration>, book: Arc<Mutex<ReplyBook>>) -> RpcFuture {
        RpcFuture {
            state: FutureState::Pending { id, timeout, book },
        }
    }

    /// Waits for the replies (rank order). Resolving this future first
    /// drains every earlier call still in flight.
    pub fn result(mut self) -> Result<Vec<RpcValue>, ExecutorError> {
        match std::mem::replace(&mut self.state, FutureState::Taken) {
            FutureState::Ready(result) => result,
            FutureState::Pending { id, timeout, book } => lock(&book).wait(id, timeout),
            FutureState::Taken => Err(ExecutorError::Call(
                "the future was already resolved".into(),
            )),
        }
    }
}

impl Drop for RpcFuture {
    /// A future dropped unresolved: its replies are read and discarded.
    fn drop(&mut self) {
        if let FutureState::Pending { id, book, .. } = &self.state {
            lock(book).abandon(*id);
        }
    }
}

fn lock(book: &Mutex<ReplyBook>) -> std::sync::MutexGuard<'_, ReplyBook> {
    book.lock().unwrap_or_else(|e| e.into_inner())
}

/// A call whose replies are not all read yet.
struct InFlight {
    id: u64,
    method: String,
    /// The ranks that reply, in order.
    ranks: Vec<usize>,
    /// The replies read so far (a prefix of `ranks`).
    got: Vec<RpcReply>,
    /// Nobody waits for it any more (timed out or dropped).
    abandoned: bool,
}

/// The response queues and the calls in flight on them.
pub struct ReplyBook {
    queues: Vec<MessageQueue>,
    workers: Arc<WorkerSet>,
    in_flight: VecDeque<InFlight>,
    done: HashMap<u64, Result<Vec<RpcValue>, ExecutorError>>,
    next_id: u64,
}

impl ReplyBook {
    /// Reads replies from `queues` (rank order); `workers` tells a dead
    /// worker from a slow one.
    pub fn new(queues: Vec<MessageQueue>, workers: Arc<WorkerSet>) -> ReplyBook {
        ReplyBook {
            queues,
            workers,
            in_flight: VecDeque::new(),
            done: HashMap::new(),
            next_id: 0,
        }
    }

    /// Records a call just broadcast; `ranks` will reply, in order.
    pub fn push(
        book: &Arc<Mutex<ReplyBook>>,
        method: &str,
        ranks: Vec<usize>,
        timeout: Option<Duration>,
    ) -> RpcFuture {
        let mut b = lock(book);
        let id = b.next_id;
        b.next_id += 1;
        b.in_flight.push_back(InFlight {
            id,
            method: method.to_string(),
            ranks,
            got: Vec::new(),
            abandoned: false,
        });
        drop(b);
        RpcFuture::pending(id, timeout, book.clone())
    }

    fn abandon(&mut self, id: u64) {
        self.done.remove(&id);
        if let Some(call) = self.in_flight.iter_mut().find(|c| c.id == id) {
            call.abandoned = true;
        }
    }

    /// Reads replies in call order until call `id` is complete.
    fn wait(&mut self, id: u64, timeout: Option<Duration>) -> Result<Vec<RpcValue>, ExecutorError> {
        let started = Instant::now();
        let deadline = timeout.map(|t| started + t);
        loop {
            if let Some(result) = self.done.remove(&id) {
                return result;
            }
            let Some(mut call) = self.in_flight.pop_front() else {
                return Err(ExecutorError::Call(format!("call {id} is not in flight")));
            };
            let rank = call.ranks[call.got.len()];
            match self.read(rank, deadline) {
                Ok(reply) => call.got.push(reply),
                Err(Stall::TimedOut) => {
                    self.in_flight.push_front(call);
                    let method = self
                        .in_flight
                        .iter()
                        .find(|c| c.id == id)
                        .map_or("?", |c| &c.method)
                        .to_string();
                    self.abandon(id);
                    return Err(ExecutorError::Timeout {
                        method,
                        rank,
                        waited: started.elapsed(),
                    });
                }
                Err(Stall::Failed(e)) => {
                    // Fatal for the executor: nothing more will be read.
                    self.in_flight.clear();
                    self.done.clear();
                    return Err(e);
                }
            }
            if call.got.len() < call.ranks.len() {
                self.in_flight.push_front(call);
            } else if !call.abandoned {
                self.done.insert(call.id, collect(call));
            }
        }
    }

    /// The next reply from `rank`, waiting in slices so that a worker's
    /// death is noticed even while another rank is awaited.
    fn read(&self, rank: usize, deadline: Option<Instant>) -> Result<RpcReply, Stall> {
        loop {
            if let Some(e) = self.workers.death() {
                return Err(Stall::Failed(e));
            }
            let slice = match deadline {
                None => POLL_INTERVAL,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(POLL_INTERVAL),
                    _ => return Err(Stall::TimedOut),
                },
            };
            match self.queues[rank].dequeue::<RpcReply>(Some(slice)) {
                Ok(reply) => return Ok(reply),
                Err(QueueError::Timeout { .. }) => {}
                Err(QueueError::WriterDead { .. }) => {
                    return Err(Stall::Failed(self.workers.reap(rank)))
                }
                Err(source) => {
                    return Err(Stall::Failed(ExecutorError::Queue {
                        what: format!("reading worker rank {rank}'s reply"),
                        source,
                    }))
                }
            }
        }
    }
}

/// Why a reply did not arrive.
enum Stall {
    TimedOut,
    Failed(ExecutorError),
}

/// A complete call's result: its values in rank order, or the first failure.
fn collect(call: InFlight) -> Result<Vec<RpcValue>, ExecutorError> {
    call.ranks
        .iter()
        .zip(call.got)
        .map(|(&rank, reply)| match reply {
            RpcReply::Success(v) => Ok(v),
            RpcReply::Failure(message) => Err(ExecutorError::Worker {
                rank,
                method: call.method.clone(),
                message,
            }),
        })
        .collect()
}
