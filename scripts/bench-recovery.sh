#!/usr/bin/env bash
# How long a stream stalls when an `mp` worker is killed mid-decode (issue
# 14): a release `host serve`, STREAMS concurrent greedy streams through the
# official `openai` client (tests/server/kill_client.py), the worker
# sent SIGKILL once every stream has a chunk; REPS times, a fresh server
# each (a full restart budget). Each server first serves the same streams
# undisturbed: their texts are what the disturbed run must give, and their
# time to first token is the recompute's yardstick (the same prefills, from
# an empty cache).
#
# Per run: kill → first token after it (client side: the longest any stream
# waited past the kill) and the largest gap between two consecutive chunks
# of any stream around the kill; split into detection (the monitor's `worker
# process died` log timestamp − the kill), stopping the old group, respawn,
# model load, KV cache / warm-up / plugins (the `worker group restarted`
# line) and recompute (the `first tokens after the worker restart` line);
# `other` is what is left (waiting for the death to be confirmed, the
# stream's way out through the API server). Prints a markdown table and the
# medians. Not part of CI: the machines are noisy.
#
# Override with REPS, STREAMS, MAX_TOKENS, TP (tensor-parallel ranks; the
# first rank above 0 is killed when TP > 1), THREADS (worker.num_threads).
set -euo pipefail
cd "$(dirname "$0")/.."

reps="${REPS:-3}"
streams="${STREAMS:-16}"
max_tokens="${MAX_TOKENS:-128}"
tp="${TP:-1}"
threads="${THREADS:-0}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/fetch-model.sh >/dev/null
cargo build --release -p host --bin host >&2
python3 -c "import openai" 2>/dev/null || {
  echo "needs the openai client: pip install -r tests/reference/requirements.txt" >&2
  exit 1
}

out=$(mktemp -d)
server=""
# Whatever happens, no server of ours outlives the script.
cleanup() {
  if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
    kill -KILL "$server" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# The children of $1 whose argv[1] is $2 (`engine-core`, `worker`), by pid.
children() {
  ps -eo pid=,ppid=,args= | awk -v p="$1" -v r="$2" '$2 == p && $4 == r { print $1 }' | sort -n
}

for rep in $(seq "$reps"); do
  log="$out/server-$rep.log"
  NO_COLOR=1 target/release/host --model "$model" serve --host 127.0.0.1 --port 0 \
    --set parallel.distributed_executor_backend=mp \
    --set "parallel.tensor_parallel_size=$tp" --set "worker.num_threads=$threads" \
    >"$out/stdout-$rep" 2>"$log" &
  server=$!
  addr=""
  for _ in $(seq 600); do # 60 s
    addr=$(grep -so 'http://[0-9.:]*' "$out/stdout-$rep" || true)
    [ -n "$addr" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$addr" ]; then
    echo "run $rep: the server did not start within 60 s:" >&2
    cat "$log" >&2
    exit 1
  fi
  core=$(children "$server" engine-core)
  victim=$(children "$core" worker | sed -n "$((tp > 1 ? 2 : 1))p")
  echo "run $rep: $addr, killing worker $victim of $(children "$core" worker | tr '\n' ' ')" >&2
  for kill in 0 "$victim"; do
    spec=$(python3 -c 'import json, sys; n, m, v = map(int, sys.argv[1:]); print(json.dumps({
        "prompts": [f"Write a short story about the number {i}." for i in range(n)],
        "max_tokens": m, "kill_pid": v or None, "timeout_s": 120}))' "$streams" "$max_tokens" "$kill")
    name=$([ "$kill" = 0 ] && echo reference || echo client)
    timeout 300 python3 tests/server/kill_client.py "$addr/v1" SmolLM2-135M-Instruct.Q4_1 "$spec" \
      >"$out/$name-$rep.json"
  done
  kill -TERM "$server"
  for _ in $(seq 300); do # 30 s
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  wait "$server" || true
  server=""
done

python3 - "$out" "$reps" "$max_tokens" <<'PY'
import json, re, statistics, subprocess, sys
from datetime import datetime

out, reps, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def stamp(line):
    """The wall-clock seconds of a tracing line (RFC 3339, UTC)."""
    t = line.split()[0].replace("Z", "+00:00")
    return datetime.fromisoformat(t).timestamp()

def line_with(log, needle):
    found = [l for l in log if needle in l]
    if not found:
        sys.exit(f"no log line with {needle!r}:\n" + "\n".join(log))
    return found[0]

cols = ["undisturbed TTFT", "kill → first token", "largest gap", "detection", "stop old", "respawn",
        "model load", "KV/warm-up/plugins", "recompute", "other"]
rows = []
for rep in range(1, reps + 1):
    report = json.load(open(f"{out}/client-{rep}.json"))
    reference = json.load(open(f"{out}/reference-{rep}.json"))
    # The slowest stream's first token when nothing is killed: 16 prefills
    # from an empty cache, as the recompute's are.
    ttft = max(s["chunk_times"][0] for s in reference["streams"]) - reference["started_at"]
    log = open(f"{out}/server-{rep}.log").read().splitlines()
    killed = report["killed_at"]
    if killed is None:
        sys.exit(f"run {rep}: the kill did not happen: {report['kill_error']}")
    first_after, gap = 0.0, 0.0
    for s, want in zip(report["streams"], reference["streams"]):
        if s.get("error") or s.get("finish_reason") != "length" or s.get("usage_completion_tokens") != max_tokens:
            sys.exit(f"run {rep}: a stream did not finish whole: {s}")
        if s["text"] != want["text"]:
            sys.exit(f"run {rep}: a stream differs from the undisturbed run: {s['text']!r} vs {want['text']!r}")
        times = s["chunk_times"]
        after = [t for t in times if t > killed]
        before = [t for t in times if t <= killed]
        if after:
            first_after = max(first_after, after[0] - killed)
        if after and before:
            gap = max(gap, after[0] - before[-1])
    died = stamp(line_with(log, "worker process died"))
    restarted = line_with(log, "worker group restarted in")
    parts = [float(x) for x in re.findall(r"([0-9.]+) s", restarted.split("restarted in", 1)[1])]
    total, stop, respawn, load, init = parts[:5]
    recompute = float(re.search(r"recompute took ([0-9.]+) s",
                                line_with(log, "first tokens after the worker restart")).group(1))
    detection = died - killed
    other = first_after - detection - total - recompute
    rows.append([ttft, first_after, gap, detection, stop, respawn, load, init, recompute, other])

cpu = next((l.split(":", 1)[1].strip() for l in subprocess.run(
    ["lscpu"], capture_output=True, text=True).stdout.splitlines() if l.startswith("Model name")), "?")
nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
print(f"CPU: {cpu} ({nproc} cores)\n")
print("| run | " + " | ".join(cols) + " |")
print("|" + "---|" * (len(cols) + 1))
for i, r in enumerate(rows, 1):
    print(f"| {i} | " + " | ".join(f"{v:.3f}" for v in r) + " |")
print("| **median** | " + " | ".join(f"**{statistics.median(c):.3f}**" for c in zip(*rows)) + " |")
print("\nSeconds. `other` = kill → first token − detection − restart − recompute.")
PY
