//! KV-cache events for routers, in vLLM's wire format (`--kv-events-config`):
//! after each step the engine core hands the prefix cache's
//! [`KvCacheEvent`]s to a publisher thread, which sends them as one batch on
//! a ZeroMQ PUB socket and keeps the latest batches for replay.
//!
//! A message is three frames: the topic, the batch's sequence number (8
//! bytes, big-endian, from 0) and the batch as msgpack, laid out as vLLM's
//! msgspec structs (`array_like`, tagged): `[ts, [event, ...],
//! data_parallel_rank]` with `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium]`,
//! `["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`.
//! Block hashes are unsigned 64-bit integers (vLLM's `ExternalBlockHash`
//! may be an int); `lora_id` and `medium` are nil.
//!
//! Replay (`replay_endpoint`, a ROUTER socket): a client sends the first
//! sequence number it wants (8 bytes, big-endian) in an empty-delimited
//! envelope (a DEALER's `["", seq]`, as a REQ sends), and gets back
//! `["", seq, payload]` for every kept batch from there on, then
//! `["", -1, ""]`.
//!
//! The engine never waits on the network: batches go through a bounded
//! queue (`max_queue_size`), and a full queue drops the batch with a
//! warning rather than stall a step.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::KvEventsConfig;
use crate::kv_cache::KvCacheEvent;

/// The sequence number that ends a replay.
const END_OF_REPLAY: i64 = -1;

/// The engine core's end of the publisher thread.
pub struct KvEventPublisher {
    batches: mpsc::Sender<Vec<KvCacheEvent>>,
    dropped: u64,
}

impl KvEventPublisher {
    /// Binds the sockets `config` names (an error names the endpoint that
    /// could not be bound) and starts the publisher thread.
    pub fn start(config: &KvEventsConfig, data_parallel_rank: u32) -> anyhow::Result<Self> {
        let (batches, rx) = mpsc::channel(config.max_queue_size);
        let (bound_tx, bound) = std::sync::mpsc::channel();
        let config = config.clone();
        std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = bound_tx.send(Err(anyhow::Error::from(e)));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match Sockets::bind(&config).await {
                        Ok(sockets) => {
                            let _ = bound_tx.send(Ok(()));
                            sockets.serve(rx, &config, data_parallel_rank).await;
                        }
                        Err(e) => {
                            let _ = bound_tx.send(Err(e));
                        }
                    }
                });
            })?;
        bound
            .recv()
            .context("the KV-event publisher thread ended before binding")??;
        Ok(KvEventPublisher {
            batches,
            dropped: 0,
        })
    }

    /// Queues one step's events (nothing when there are none).
    pub fn publish(&mut self, events: Vec<KvCacheEvent>) {
        if events.is_empty() {
            return;
        }
        if self.batches.try_send(events).is_err() {
            self.dropped += 1;
            // Powers of two: a router that cannot keep up is told of, not
            // logged once per step.
            if self.dropped.is_power_of_two() {
                tracing::warn!(
                    dropped = self.dropped,
                    "KV-event batches dropped: the publisher's queue is full \
                     (kv_events.max_queue_size)"
                );
            }
        }
    }
}

/// The bound sockets, served on the publisher thread.
struct Sockets {
    publisher: PubSocket,
    replay: Option<RouterSocket>,
}

impl Sockets {
    async fn bind(config: &KvEventsConfig) -> anyhow::Result<Sockets> {
        let mut publisher = PubSocket::new();
        publisher
            .bind(&zmq_endpoint(&config.endpoint))
            .await
            .with_context(|| format!("kv_events.endpoint: cannot bind {}", config.endpoint))?;
        let replay = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut router = RouterSocket::new();
                router
                    .bind(&zmq_endpoint(endpoint))
                    .await
                    .with_context(|| {
                        format!("kv_events.replay_endpoint: cannot bind {endpoint}")
                    })?;
                Some(router)
            }
            None => None,
        };
        Ok(Sockets { publisher, replay })
    }

    /// Sends each batch as it comes and answers replay requests, until the
    /// engine core drops its end.
    async fn serve(
        mut self,
        mut batches: mpsc::Receiver<Vec<KvCacheEvent>>,
        config: &KvEventsConfig,
        data_parallel_rank: u32,
    ) {
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let mut kept: VecDeque<(i64, Bytes)> = VecDeque::new();
        let mut seq: i64 = 0;
        loop {
            let request = async {
                match self.replay.as_mut() {
                    Some(router) => router.recv().await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = batches.recv() => {
                    let Some(events) = batch else { return };
                    let payload = Bytes::from(encode_batch(&events, data_parallel_rank));
                    let mut message = ZmqMessage::from(topic.clone());
                    message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                    message.push_back(payload.clone());
                    if let Err(e) = self.publisher.send(message).await {
                        tracing::warn!("a KV-event batch could not be sent: {e}");
                    }
                    kept.push_back((seq, payload));
                    if kept.len() > config.buffer_steps {
                        kept.pop_front();
                    }
                    seq += 1;
                }
                Some(request) = request => self.replay(request, &kept).await,
            }
        }
    }

    /// Answers one replay request: every kept batch from the asked sequence
    /// number on, then the end marker. A malformed request is ignored.
    async fn replay(&mut self, request: ZmqMessage, kept: &VecDeque<(i64, Bytes)>) {
        let Some(router) = self.replay.as_mut() else {
            return;
        };
        let frames = request.into_vec();
        let [identity, delimiter, start] = &frames[..] else {
            tracing::warn!(
                "a KV-event replay request had {} frames, not 3",
                frames.len()
            );
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(i64::from_be_bytes) else {
            tracing::warn!("a KV-event replay request's sequence number is not 8 bytes");
            return;
        };
        let reply = |seq: i64, payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(delimiter.clone());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            m
        };
        for (seq, payload) in kept.iter().filter(|(seq, _)| *seq >= start) {
            if router.send(reply(*seq, payload.clone())).await.is_err() {
                return;
            }
        }
        let _ = router.send(reply(END_OF_REPLAY, Bytes::new())).await;
    }
}

/// `tcp://*:PORT` (ZeroMQ's "every address") in the form the socket takes.
fn zmq_endpoint(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// One batch as msgpack, in vLLM's `KVEventBatch` layout.
pub fn encode_batch(events: &[KvCacheEvent], data_parallel_rank: u32) -> Vec<u8> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut out = Vec::with_capacity(64 + 16 * events.len());
    // Writes into a Vec cannot fail.
    let w = &mut out;
    let _ = rmp::encode::write_array_len(w, 3);
    let _ = rmp::encode::write_f64(w, ts);
    let _ = rmp::encode::write_array_len(w, events.len() as u32);
    for event in events {
        encode_event(w, event);
    }
    let _ = rmp::encode::write_uint(w, u64::from(data_parallel_rank));
    out
}

fn encode_event(w: &mut Vec<u8>, event: &KvCacheEvent) {
    use rmp::encode::{write_array_len, write_nil, write_str, write_uint};
    let hashes = |w: &mut Vec<u8>, hashes: &[u64]| {
        let _ = write_array_len(w, hashes.len() as u32);
        for &h in hashes {
            let _ = write_uint(w, h);
        }
    };
    match event {
        KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            extra_key: _,
        } => {
            let _ = write_array_len(w, 7);
            let _ = write_str(w, "BlockStored");
            hashes(w, block_hashes);
            match parent_block_hash {
                Some(h) => drop(write_uint(w, *h)),
                None => drop(write_nil(w)),
            }
            let _ = write_array_len(w, token_ids.len() as u32);
            for &t in token_ids {
                let _ = write_uint(w, u64::from(t));
            }
            let _ = write_uint(w, u64::from(*block_size));
            let _ = write_nil(w); // lora_id
            let _ = write_nil(w); // medium
        }
        KvCacheEvent::BlockRemoved { block_hashes } => {
            let _ = write_array_len(w, 3);
            let _ = write_str(w, "BlockRemoved");
            hashes(w, block_hashes);
            let _ = write_nil(w); // medium
        }
        KvCacheEvent::AllBlocksCleared => {
            let _ = write_array_len(w, 1);
            let _ = write_str(w, "AllBlocksCleared");
        }
    }
}

/// `config` as data-parallel rank `rank` binds it: every engine core has its
/// own sockets, at the configured TCP port plus its rank, or the `ipc://`
/// path with `_dp<rank>` appended (what vLLM does), so subscribers find
/// rank `r` at a port they can compute.
pub fn for_rank(config: &KvEventsConfig, rank: usize) -> anyhow::Result<KvEventsConfig> {
    let mut config = config.clone();
    config.endpoint = offset_endpoint(&config.endpoint, rank)
        .with_context(|| format!("kv_events.endpoint `{}`", config.endpoint))?;
    if let Some(replay) = &config.replay_endpoint {
        config.replay_endpoint = Some(
            offset_endpoint(replay, rank)
                .with_context(|| format!("kv_events.replay_endpoint `{replay}`"))?,
        );
    }
    Ok(config)
}

fn offset_endpoint(endpoint: &str, rank: usize) -> anyhow::Result<String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if let Some((address, port)) = endpoint
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
    {
        let port: u16 = port
            .parse()
            .with_context(|| format!("`{port}` is not a port number"))?;
        let offset = u16::try_from(rank)
            .ok()
            .and_then(|rank| port.checked_add(rank))
            .with_context(|| {
                format!("port {port} + data-parallel rank {rank} is past 65535; pick a lower port")
            })?;
        return Ok(format!("tcp://{address}:{offset}"));
    }
    Ok(format!("{endpoint}_dp{rank}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_binds_its_own_port_or_path() {
        let config = KvEventsConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: Some("ipc:///tmp/replay".into()),
            ..KvEventsConfig::default()
        };
        assert_eq!(for_rank(&config, 0).unwrap(), config);
        let rank2 = for_rank(&config, 2).unwrap();
        assert_eq!(rank2.endpoint, "tcp://*:5559");
        assert_eq!(
            rank2.replay_endpoint.as_deref(),
            Some("ipc:///tmp/replay_dp2")
        );
        let high = KvEventsConfig {
            endpoint: "tcp://127.0.0.1:65535".into(),
            ..KvEventsConfig::default()
        };
        let err = format!("{:#}", for_rank(&high, 1).unwrap_err());
        assert!(err.contains("past 65535"), "{err}");
    }
}
