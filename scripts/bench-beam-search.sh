#!/usr/bin/env bash
# Beam search against sampling of as many choices: one /v1/completions
# request at a time, the same prompt, W choices of M tokens with ignore_eos,
# sampled (temperature 1, seeded) and by beam search (use_beam_search, n = W),
# alternating REPS times so drift on a shared machine cancels. Beam search
# runs as vLLM's frontend runs it, one engine round trip per token, so its
# cost per token is a round trip's: prints each run's end-to-end seconds, the
# medians, their ratio and the beam search's milliseconds per round.
#
#   bash scripts/bench-beam-search.sh          # W=2 M=32 REPS=5
#
# Not part of CI: the machines are noisy. HOST_BIN picks the binary
# (default: a release build).
set -euo pipefail
cd "$(dirname "$0")/.."

width="${W:-2}"; tokens="${M:-32}"; reps="${REPS:-5}"
bash scripts/fetch-model.sh >/dev/null
host="${HOST_BIN:-}"
if [[ -z "$host" ]]; then
    cargo build --release -p host >&2
    host=target/release/host
fi
port=18481
"$host" serve --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null' EXIT

python3 - "$port" "$width" "$tokens" "$reps" <<'PY'
import json, statistics, sys, time, urllib.request
port, width, tokens, reps = sys.argv[1], *map(int, sys.argv[2:])
url = f"http://127.0.0.1:{port}/v1/completions"
for _ in range(120):  # the server loads the model: up to a minute
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
prompt = "Once upon a time, in a small village at the edge of a great forest, there lived"
base = {"prompt": prompt, "n": width, "max_tokens": tokens, "ignore_eos": True}
kinds = {
    "sampled": {**base, "temperature": 1, "seed": 7},
    "beam search": {**base, "use_beam_search": True},
}
def run(body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    answer = json.load(urllib.request.urlopen(req, timeout=600))
    assert answer["usage"]["completion_tokens"] == width * tokens, answer
    return time.perf_counter() - start
for body in kinds.values():
    run(body)  # warm up (and fill the prefix cache with the prompt)
times = {k: [] for k in kinds}
for _ in range(reps):
    for kind, body in kinds.items():
        times[kind].append(run(body))
for kind, ts in times.items():
    print(f"{kind:12} " + " ".join(f"{t:.3f}" for t in ts)
          + f"  median {statistics.median(ts):.3f} s")
beam, sampled = (statistics.median(times[k]) for k in ("beam search", "sampled"))
print(f"beam search / sampled: {beam / sampled:.2f}x; "
      f"{1000 * beam / tokens:.1f} ms per beam round of {width} beams")
PY
