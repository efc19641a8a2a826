//! State the engine-core threads share with its clients: each live
//! request's output channel, the latest counters, and whether the engine is
//! alive.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{mpsc, watch};

use super::client::EngineCoreError;
use super::core::{EngineCoreOutput, EngineStats};

/// One item of a request's output stream.
pub(crate) type StreamItem = Result<EngineCoreOutput, EngineCoreError>;

/// Whether the busy loop runs, and why it stopped.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Liveness {
    /// Stepping or waiting for work.
    Alive,
    /// Shut down on request.
    Stopped,
    /// Died of a fatal error (the message).
    Dead(String),
}

/// The live requests' streams. The engine core knows each request by an
/// internal id unique for the engine's lifetime (the client's id plus a
/// sequence number), so a client may reuse an id once its request ended
/// without a late output of the old request reaching the new stream.
#[derive(Default)]
struct Streams {
    /// Internal id → (client's id, the stream's sender).
    by_internal: HashMap<String, (String, mpsc::UnboundedSender<StreamItem>)>,
    /// Client's id → internal id.
    by_client: HashMap<String, String>,
    next_seq: u64,
}

impl Streams {
    fn remove(&mut self, internal_id: &str) -> Option<mpsc::UnboundedSender<StreamItem>> {
        let (client_id, tx) = self.by_internal.remove(internal_id)?;
        self.by_client.remove(&client_id);
        Some(tx)
    }
}

/// Shared by the client handles, the busy loop and the output thread.
pub(crate) struct Shared {
    streams: Mutex<Streams>,
    stats: Mutex<EngineStats>,
    liveness: watch::Sender<Liveness>,
}

/// Locks a mutex; a poisoned one (a panicked holder) still holds valid data
/// here, since every critical section is a single map or value update.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn new(initial: EngineStats) -> Shared {
        Shared {
            streams: Mutex::new(Streams::default()),
            stats: Mutex::new(initial),
            liveness: watch::channel(Liveness::Alive).0,
        }
    }

    /// Registers a request's stream and returns the internal id the engine
    /// core will know it by; `None` when the client's id is already live.
    pub(crate) fn register(
        &self,
        request_id: &str,
        tx: mpsc::UnboundedSender<StreamItem>,
    ) -> Option<String> {
        let mut streams = lock(&self.streams);
        if streams.by_client.contains_key(request_id) {
            return None;
        }
        streams.next_seq += 1;
        let internal = format!("{request_id}#{}", streams.next_seq);
        streams
            .by_client
            .insert(request_id.to_string(), internal.clone());
        streams
            .by_internal
            .insert(internal.clone(), (request_id.to_string(), tx));
        Some(internal)
    }

    /// Forgets the streams of the requests with these client ids and
    /// returns their internal ids, to abort in the core.
    pub(crate) fn unregister_client_ids(&self, request_ids: &[String]) -> Vec<String> {
        let mut streams = lock(&self.streams);
        let internal: Vec<String> = request_ids
            .iter()
            .filter_map(|id| streams.by_client.get(id).cloned())
            .collect();
        for id in &internal {
            streams.remove(id);
        }
        internal
    }

    /// Forgets a stream by internal id; true if it was live.
    pub(crate) fn unregister(&self, internal_id: &str) -> bool {
        lock(&self.streams).remove(internal_id).is_some()
    }

    /// Sends each output to its request's stream, under the client's id; a
    /// finished request's stream is closed after its last output.
    pub(crate) fn dispatch(&self, outputs: Vec<EngineCoreOutput>) {
        let mut streams = lock(&self.streams);
        for mut out in outputs {
            let finished = out.finish_reason.is_some();
            let Some((client_id, tx)) = streams.by_internal.get(&out.request_id) else {
                continue;
            };
            let internal = std::mem::replace(&mut out.request_id, client_id.clone());
            // A receiver already gone has aborted (or will, on drop).
            let _ = tx.send(Ok(out));
            if finished {
                streams.remove(&internal);
            }
        }
    }

    /// Ends a refused request's stream with the reason.
    pub(crate) fn reject(&self, internal_id: &str, reason: String) {
        if let Some(tx) = lock(&self.streams).remove(internal_id) {
            let _ = tx.send(Err(EngineCoreError::Rejected(reason)));
        }
    }

    /// Marks the engine stopped (`None`) or dead (the reason) unless it
    /// already was, then ends every stream with the sentinel; in that order, so a client that sees
    /// the sentinel also sees the engine as not alive.
    pub(crate) fn stop(&self, died: Option<String>) {
        let reason = died
            .clone()
            .unwrap_or_else(|| "the engine was shut down".into());
        // The first word on why the engine stopped is the one that stands.
        self.liveness.send_if_modified(|state| {
            let first = *state == Liveness::Alive;
            if first {
                *state = died.map_or(Liveness::Stopped, Liveness::Dead);
            }
            first
        });
        let mut streams = lock(&self.streams);
        streams.by_client.clear();
        for (_, (_, tx)) in streams.by_internal.drain() {
            let _ = tx.send(Err(EngineCoreError::Dead(reason.clone())));
        }
    }

    pub(crate) fn publish_stats(&self, stats: EngineStats) {
        *lock(&self.stats) = stats;
    }

    pub(crate) fn stats(&self) -> EngineStats {
        lock(&self.stats).clone()
    }

    pub(crate) fn liveness(&self) -> Liveness {
        self.liveness.borrow().clone()
    }

    pub(crate) fn watch_liveness(&self) -> watch::Receiver<Liveness> {
        self.liveness.subscribe()
    }
}
