#!/usr/bin/env bash
# Data parallelism on this machine (issue 16): a release `host serve` with
# `parallel.data_parallel_size = 1` and with DP (default 2), each driven by
# the same load (scripts/bench_serve.py: N streaming requests, C at a time,
# P-token random prompts, M output tokens, temperature 0), the two servers
# alternating REPS times so drift on a shared machine cancels. Both use
# every core: DP = 1 as one engine with all threads, DP = N as N engines
# pinned to a share each (worker.num_threads = 0). Prints each run, the
# medians and the ratio DP / 1 of output tok/s, TTFT and ITL.
#
# SPLIT=1 adds a third server in the same alternation: rank 0 here and ranks
# 1.. as `host serve --headless` in a network namespace joined by a veth pair
# (as root), so their queues run over TCP; it prints that against DP on one
# machine too. HOST_BIN picks the binary (default: a release build).
#
#   bash scripts/bench-dp.sh              # DP=2 REPS=3 N=64 C=16 P=100 M=64
#   SPLIT=1 bash scripts/bench-dp.sh      # as root
#
# Not part of CI: it takes minutes and the machines are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."

dp="${DP:-2}"; reps="${REPS:-3}"
n="${N:-64}"; c="${C:-16}"; p="${P:-100}"; m="${M:-64}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
split="${SPLIT:-0}"
port=18641; dp_port=18642
bash scripts/fetch-model.sh >/dev/null
host="${HOST_BIN:-}"
if [[ -z "$host" ]]; then
  cargo build --release -p host --bin host 2>/dev/null
  host=target/release/host
fi
work=$(mktemp -d)
pid=""; node=""; ns="hostdpbench$$"
cleanup() {
  [[ -n "$pid" ]] && kill "$pid" 2>/dev/null
  [[ -n "$node" ]] && kill "$node" 2>/dev/null
  wait 2>/dev/null
  if [[ "$split" == 1 ]]; then ip netns del "$ns" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
if [[ "$split" == 1 ]]; then
  # 10.78.0.1 here, 10.78.0.2 in the namespace; deleting it deletes the pair.
  ip netns add "$ns"
  ip link add "dpb$$a" type veth peer name "dpb$$b"
  ip link set "dpb$$b" netns "$ns"
  ip addr add 10.78.0.1/24 dev "dpb$$a" && ip link set "dpb$$a" up
  ip netns exec "$ns" ip addr add 10.78.0.2/24 dev "dpb$$b"
  ip netns exec "$ns" ip link set "dpb$$b" up
  ip netns exec "$ns" ip link set lo up
fi

# run LABEL REP: one server under the load. LABEL 1 or N: that many engine
# cores here; split: rank 0 here, the others in the namespace.
run() {
  local flags=(--set "parallel.data_parallel_size=$1")
  if [[ "$1" == split ]]; then
    # Each machine's single rank is not pinned: give each its share of the
    # threads, as pinning does for DP on one machine.
    local share=$(( $(nproc) / dp )); (( share > 0 )) || share=1
    flags=(--data-parallel-size "$dp" --data-parallel-size-local 1 --num-threads "$share"
           --master-addr 10.78.0.1 --master-port "$dp_port")
    ip netns exec "$ns" "$host" --model "$model" serve --headless --data-parallel-size "$dp" \
      --data-parallel-start-rank 1 --master-addr 10.78.0.1 --master-port "$dp_port" \
      >"$work/node.log" 2>&1 &
    node=$!
  fi
  "$host" --model "$model" serve --port "$port" "${flags[@]}" >"$work/dp$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/dp$1.log" >&2; exit 1; }
    sleep 0.1
  done
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --label "dp$1" --num-requests "$n" \
    --concurrency "$c" --prompt-tokens "$p" --max-tokens "$m" --json "$work/dp$1.$2.json" >&2
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  if [[ -n "$node" ]]; then kill -TERM "$node"; wait "$node" 2>/dev/null || true; node=""; fi
}

lscpu | sed -n 's/^Model name: *//p'
labels=(1 "$dp")
[[ "$split" == 1 ]] && labels+=(split)
for rep in $(seq "$reps"); do
  for label in "${labels[@]}"; do run "$label" "$rep"; done
done

python3 - "$work" "$dp" "$reps" "${labels[@]}" <<'PY'
import json, statistics, sys
work, dp, reps, labels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
runs = {l: [json.load(open(f"{work}/dp{l}.{r}.json")) for r in range(1, reps + 1)] for l in labels}
med = lambda size, f: statistics.median(f(r) for r in runs[size])
tok = lambda r: r["output_tok_s"]
ttft = lambda r: r["ttft_s"]["p50"] * 1000
itl = lambda r: r["itl_s"]["p50"] * 1000
name = lambda l: f"DP = {dp}, ranks 1.. over TCP in a namespace" if l == "split" else f"DP = {l}"
r0 = runs["1"][0]
print(f"{r0['num_requests']} requests, {r0['concurrency']} concurrent, {r0['prompt_tokens']}-token prompts, "
      f"{r0['max_tokens']} output tokens, temperature 0; {reps} alternating runs each\n")
print("| engines | ok | output tok/s (each run) | median tok/s | TTFT p50 ms | ITL p50 ms |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for l in labels:
    ok = sum(r["completed"] for r in runs[l]); total = sum(r["num_requests"] for r in runs[l])
    each = ", ".join(f"{tok(r):.1f}" for r in runs[l])
    print(f"| {name(l)} | {ok}/{total} | {each} | {med(l, tok):.1f} | {med(l, ttft):.0f} | {med(l, itl):.1f} |")
print()
for a, b in [(str(dp), "1"), ("split", "1"), ("split", str(dp))]:
    if a in runs and b in runs:
        print(f"{name(a)} / {name(b)}: output tok/s {med(a, tok) / med(b, tok):.2f}x, "
              f"TTFT p50 {med(a, ttft) / med(b, ttft):.2f}x, ITL p50 {med(a, itl) / med(b, itl):.2f}x")
PY
