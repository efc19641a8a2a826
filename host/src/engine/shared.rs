//! State the engine-core threads share with its clients: each live
//! request's output channel (and, when the engine core runs in its own
//! process, what a restarted process needs to resume it), the counters, and
//! whether the engine is alive.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{mpsc, watch};

use super::client::EngineCoreError;
use super::core::{EngineCoreOutput, EngineCoreRequest, EngineStats};
use super::ipc::Replay;
use crate::kv_cache::KvCacheEvent;

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

impl Liveness {
    /// What a call gets once the engine stopped; `None` while it is alive.
    pub(crate) fn stopped_error(&self) -> Option<EngineCoreError> {
        match self {
            Liveness::Alive => None,
            Liveness::Stopped => Some(EngineCoreError::Dead("the engine was shut down".into())),
            Liveness::Dead(reason) => Some(EngineCoreError::Dead(reason.clone())),
        }
    }
}

/// A live request's stream.
struct Entry {
    /// The client's id, which the outputs carry back.
    client_id: String,
    tx: mpsc::UnboundedSender<StreamItem>,
    /// Kept only when the engine core runs in its own process, since only
    /// then can it die and be replaced.
    replay: Option<Replay>,
}

/// The live requests' streams. The engine core knows each request by an
/// internal id unique for the engine's lifetime (the client's id plus a
/// sequence number), so a client may reuse an id once its request ended
/// without a late output of the old request reaching the new stream.
#[derive(Default)]
struct Streams {
    by_internal: HashMap<String, Entry>,
    /// Client's id → internal id.
    by_client: HashMap<String, String>,
    next_seq: u64,
}

impl Streams {
    fn remove(&mut self, internal_id: &str) -> Option<mpsc::UnboundedSender<StreamItem>> {
        let entry = self.by_internal.remove(internal_id)?;
        self.by_client.remove(&entry.client_id);
        Some(entry.tx)
    }
}

/// The counters: the latest the engine core published, on top of the
/// totals of the engine-core processes that died before it (`base`, whose
/// gauges mean nothing), so that a restart does not reset a Prometheus
/// counter.
struct Stats {
    latest: EngineStats,
    base: Option<EngineStats>,
}

/// Shared by the client handles, the busy loop and the output thread.
pub(crate) struct Shared {
    streams: Mutex<Streams>,
    stats: Mutex<Stats>,
    /// The prefix cache's events since the data-parallel router last took
    /// them: only an engine core with a router sends any, and a restart
    /// adds one `AllBlocksCleared` (a few bytes per restart without DP).
    kv_events: Mutex<Vec<KvCacheEvent>>,
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
            stats: Mutex::new(Stats {
                latest: initial,
                base: None,
            }),
            kv_events: Mutex::new(Vec::new()),
            liveness: watch::channel(Liveness::Alive).0,
        }
    }

    /// Registers a request's stream and renames the request to the internal
    /// id the engine core will know it by; returns the client's id. Refused
    /// when that id is already live, or once the engine stopped (checked
    /// under the lock [`Shared::stop`] ends the streams under, so no stream
    /// registers after that and waits forever). `replay`: keep the request
    /// for a restarted engine-core process, with whether it is being sent
    /// to the current one.
    pub(crate) fn register(
        &self,
        req: &mut EngineCoreRequest,
        tx: mpsc::UnboundedSender<StreamItem>,
        replay: Option<bool>,
    ) -> Result<String, EngineCoreError> {
        let mut streams = lock(&self.streams);
        if let Some(stopped) = self.liveness().stopped_error() {
            return Err(stopped);
        }
        if streams.by_client.contains_key(&req.request_id) {
            return Err(EngineCoreError::Rejected(format!(
                "request id `{}` is already in use",
                req.request_id
            )));
        }
        streams.next_seq += 1;
        let internal = format!("{}#{}", req.request_id, streams.next_seq);
        let client_id = std::mem::replace(&mut req.request_id, internal.clone());
        streams
            .by_client
            .insert(client_id.clone(), internal.clone());
        let replay = replay.map(|sent| Replay::new(req.clone(), sent));
        let entry = Entry {
            client_id: client_id.clone(),
            tx,
            replay,
        };
        streams.by_internal.insert(internal, entry);
        Ok(client_id)
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

    /// Whether a request with this client id is live.
    pub(crate) fn has_client_id(&self, request_id: &str) -> bool {
        lock(&self.streams).by_client.contains_key(request_id)
    }

    /// Forgets a stream by internal id; true if it was live.
    pub(crate) fn unregister(&self, internal_id: &str) -> bool {
        lock(&self.streams).remove(internal_id).is_some()
    }

    /// Sends each output to its request's stream, under the client's id; a
    /// finished request's stream is closed after its last output. What a
    /// replayed request recomputed and the client already has (prompt
    /// logprobs) is cut, and an output left with nothing is not sent.
    pub(crate) fn dispatch(&self, outputs: Vec<EngineCoreOutput>) {
        let mut streams = lock(&self.streams);
        for mut out in outputs {
            let finished = out.finish_reason.is_some();
            let Some(entry) = streams.by_internal.get_mut(&out.request_id) else {
                continue;
            };
            if let Some(replay) = entry.replay.as_mut() {
                if !replay.record(&mut out) {
                    continue;
                }
            }
            let internal = std::mem::replace(&mut out.request_id, entry.client_id.clone());
            // A receiver already gone has aborted (or will, on drop).
            let _ = entry.tx.send(Ok(out));
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
        for (_, entry) in streams.by_internal.drain() {
            let _ = entry.tx.send(Err(EngineCoreError::Dead(reason.clone())));
        }
    }

    /// Live requests (those a restarted engine core would resume).
    pub(crate) fn num_live(&self) -> usize {
        lock(&self.streams).by_internal.len()
    }

    /// Every live request as a new engine-core process must receive it to
    /// resume: its prompt, the output its stream already has, the prompt
    /// logprobs it still lacks. Also returns how many of them an earlier
    /// process had (those are replayed; the rest were added meanwhile).
    /// Each is then counted as sent.
    pub(crate) fn take_replay(&self) -> (Vec<EngineCoreRequest>, usize) {
        let mut streams = lock(&self.streams);
        let mut replayed = 0;
        let requests = streams
            .by_internal
            .values_mut()
            .filter_map(|entry| entry.replay.as_mut())
            .map(|replay| {
                replayed += usize::from(replay.take_sent());
                replay.resubmission()
            })
            .collect();
        (requests, replayed)
    }

    pub(crate) fn publish_stats(&self, stats: EngineStats) {
        lock(&self.stats).latest = stats;
    }

    /// Keeps a step's prefix-cache events for the router.
    pub(crate) fn record_kv_events(&self, events: Vec<KvCacheEvent>) {
        if !events.is_empty() {
            lock(&self.kv_events).extend(events);
        }
    }

    /// The prefix-cache events recorded since the last call.
    pub(crate) fn take_kv_events(&self) -> Vec<KvCacheEvent> {
        std::mem::take(&mut *lock(&self.kv_events))
    }

    /// A new engine-core process replaced a dead one: the dead one's
    /// counters become the base the new one's count on from, and `initial`
    /// (the new process's) is the latest.
    pub(crate) fn carry_over(&self, initial: EngineStats) {
        // The new process starts with an empty prefix cache.
        lock(&self.kv_events).push(KvCacheEvent::AllBlocksCleared);
        let mut stats = lock(&self.stats);
        let dead = std::mem::replace(&mut stats.latest, initial);
        match stats.base.as_mut() {
            Some(base) => add_counters(base, &dead),
            None => stats.base = Some(dead),
        }
    }

    /// Requests in the running batch as of the latest step (the router
    /// reads it per request: no copy of the counters).
    pub(crate) fn num_running(&self) -> usize {
        lock(&self.stats).latest.scheduler.num_running
    }

    /// The latest counters, totals over every engine-core process.
    pub(crate) fn stats(&self) -> EngineStats {
        let stats = lock(&self.stats);
        let mut total = stats.latest.clone();
        if let Some(base) = &stats.base {
            add_counters(&mut total, base);
        }
        total
    }

    pub(crate) fn liveness(&self) -> Liveness {
        self.liveness.borrow().clone()
    }

    pub(crate) fn watch_liveness(&self) -> watch::Receiver<Liveness> {
        self.liveness.subscribe()
    }
}

/// Adds the counters (not the gauges) of `from` to `into`.
fn add_counters(into: &mut EngineStats, from: &EngineStats) {
    let (s, f) = (&mut into.scheduler, &from.scheduler);
    s.prefix_cache.requests += f.prefix_cache.requests;
    s.prefix_cache.queries += f.prefix_cache.queries;
    s.prefix_cache.hits += f.prefix_cache.hits;
    s.num_preemptions += f.num_preemptions;
    s.num_policy_fallbacks += f.num_policy_fallbacks;
    s.spec_decoding.add(&f.spec_decoding);
    into.num_prompt_tokens += from.num_prompt_tokens;
    into.num_generation_tokens += from.num_generation_tokens;
    into.num_worker_restarts += from.num_worker_restarts;
    into.num_worker_replayed_requests += from.num_worker_replayed_requests;
    for (name, n) in &from.plugin_faults {
        *into.plugin_faults.entry(name.clone()).or_default() += n;
    }
}

/// Several engines' counters as one: counters and request gauges summed,
/// the KV cache's usage averaged over the ranks' (equal) caches, the cache
/// configuration and the latest step's timings rank 0's, with every
/// rank's blocks.
pub(crate) fn sum_engines(ranks: &[EngineStats]) -> EngineStats {
    let Some((first, rest)) = ranks.split_first() else {
        return EngineStats::default();
    };
    let mut total = first.clone();
    for r in rest {
        add_counters(&mut total, r);
        let (s, f) = (&mut total.scheduler, &r.scheduler);
        s.num_running += f.num_running;
        s.num_waiting += f.num_waiting;
        s.kv_cache_usage += f.kv_cache_usage;
        s.cache_config.num_blocks += f.cache_config.num_blocks;
    }
    total.scheduler.kv_cache_usage /= ranks.len() as f64;
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(running: usize, usage: f64, blocks: u32, prompt_tokens: u64) -> EngineStats {
        let mut s = EngineStats::default();
        s.scheduler.num_running = running;
        s.scheduler.num_waiting = 1;
        s.scheduler.kv_cache_usage = usage;
        s.scheduler.prefix_cache.hits = 10;
        s.scheduler.spec_decoding.num_draft_tokens = 6;
        s.scheduler.spec_decoding.num_accepted_tokens_per_pos = vec![3, 1];
        s.scheduler.cache_config.block_size = 16;
        s.scheduler.cache_config.num_blocks = blocks;
        s.num_prompt_tokens = prompt_tokens;
        s
    }

    #[test]
    fn ranks_add_up_to_one_engine() {
        let total = sum_engines(&[rank(3, 0.5, 100, 7), rank(2, 0.25, 100, 5)]);
        let s = &total.scheduler;
        assert_eq!((s.num_running, s.num_waiting), (5, 2));
        assert_eq!(s.kv_cache_usage, 0.375, "the mean of equal caches");
        assert_eq!(s.prefix_cache.hits, 20);
        assert_eq!(s.spec_decoding.num_draft_tokens, 12);
        assert_eq!(s.spec_decoding.num_accepted_tokens_per_pos, [6, 2]);
        assert_eq!(
            (s.cache_config.block_size, s.cache_config.num_blocks),
            (16, 200)
        );
        assert_eq!(total.num_prompt_tokens, 12);
        assert_eq!(
            sum_engines(&[rank(3, 0.5, 100, 7)]).scheduler.num_running,
            3
        );
    }
}
