"""A KV-event subscriber written from vLLM's documented wire format (pyzmq +
msgpack, no engine code): subscribes to a server's PUB socket, drives the
server over HTTP, and checks what the prefix cache announced.

    kv_events_client.py SERVER_ADDR PUB_ENDPOINT REPLAY_ENDPOINT BLOCK_SIZE

Each message is (topic, seq as 8 bytes big-endian, msgpack KVEventBatch),
a batch being [ts, events, data_parallel_rank] and an event one of
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium], ["BlockRemoved", block_hashes, medium],
["AllBlocksCleared"]. Prints "kv events: ok" when every check passed.
"""

import json
import sys
import time
import urllib.request

import msgpack
import zmq

SERVER, PUB, REPLAY, BLOCK = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(PUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
received = []  # (seq, payload bytes, decoded batch)


def post(path, body):
    req = urllib.request.Request(
        f"http://{SERVER}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")


def drain(wait_s=1.0):
    """Every message that arrives within wait_s of the last one."""
    events = []
    while sub.poll(int(wait_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"", topic
        batch = msgpack.unpackb(payload)
        ts, batch_events, rank = batch
        assert abs(ts - time.time()) < 60 and rank == 0, batch
        received.append((int.from_bytes(seq, "big", signed=True), payload, batch))
        events.extend(batch_events)
    return events


def tokens(prompt):
    return post("/tokenize", {"prompt": prompt})["tokens"]


def complete(prompt):
    post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})


def stored(events):
    return [e for e in events if e[0] == "BlockStored"]


# A subscription reaches the publisher asynchronously: ping until the
# first batch arrives, so no later message is missed.
warmup = "Subscriptions take a moment to arrive. " * 3
deadline = time.time() + 30
first = []
while not first:
    assert time.time() < deadline, "no KV event within 30 s"
    complete(warmup)
    first = drain(0.5)
post("/reset_prefix_cache", {})
assert ["AllBlocksCleared"] in drain(), "a reset is announced"

# A prompt's full blocks are stored, in order, chained from no parent.
a_text = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
a = tokens(a_text)
complete(a_text)
ev = stored(drain())
assert len(ev) == 1, ev
_, a_hashes, parent, a_tokens, block_size, lora_id, medium = ev[0]
full = len(a) // BLOCK
assert block_size == BLOCK and parent is None and lora_id is None and medium is None, ev
assert a_tokens == a[: full * BLOCK], (a_tokens, a)
assert len(a_hashes) == full and len(set(a_hashes)) == full, a_hashes

# A prompt sharing A's first two blocks stores only its own blocks, whose
# parent is A's second block.
b = a[: 2 * BLOCK] + tokens(" A completely different ending follows here, about cats. " * 3)
post("/v1/completions", {"prompt": b, "max_tokens": 1, "temperature": 0})
ev = stored(drain())
assert len(ev) == 1, ev
_, b_hashes, parent, b_tokens, _, _, _ = ev[0]
assert parent == a_hashes[1], (parent, a_hashes)
assert b_tokens == b[2 * BLOCK : (len(b) // BLOCK) * BLOCK], (b_tokens, b)
assert not set(b_hashes) & set(a_hashes), "shared blocks are not stored twice"

# A long prompt of new tokens needs the memory of cached blocks: each one
# evicted is announced, and only hashes that were stored.
c_text = " ".join(f"item{i}" for i in range(400))
c = tokens(c_text)
post("/v1/completions", {"prompt": c[:150], "max_tokens": 1, "temperature": 0})
ev = drain()
removed = [h for e in ev if e[0] == "BlockRemoved" for h in e[1]]
assert removed, f"no eviction announced: {ev}"
assert set(removed) <= set(a_hashes) | set(b_hashes) | {
    h for e in stored(first) for h in e[1]
}, removed

# Sequence numbers count batches from 0 with no gap.
seqs = [s for s, _, _ in received]
assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs

# Replay: everything kept from a sequence number on, then the end marker.
dealer = ctx.socket(zmq.DEALER)
dealer.connect(REPLAY)
start = seqs[1]
dealer.send_multipart([b"", start.to_bytes(8, "big")])
replayed = []
while True:
    assert dealer.poll(10_000), "replay did not end within 10 s"
    empty, seq, payload = dealer.recv_multipart()
    assert empty == b""
    seq = int.from_bytes(seq, "big", signed=True)
    if seq == -1:
        assert payload == b""
        break
    replayed.append((seq, payload))
want = [(s, p) for s, p, _ in received if s >= start]
assert replayed[: len(want)] == want, (replayed[:3], want[:3])
print("kv events: ok")
