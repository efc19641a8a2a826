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
#   bash scripts/bench-dp.sh              # DP=2 REPS=3 N=64 C=16 P=100 M=64
#
# Not part of CI: it takes minutes and the machines are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."

dp="${DP:-2}"; reps="${REPS:-3}"
n="${N:-64}"; c="${C:-16}"; p="${P:-100}"; m="${M:-64}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
port=18641
bash scripts/fetch-model.sh >/dev/null
cargo build --release -p host --bin host 2>/dev/null
work=$(mktemp -d)
pid=""
cleanup() { [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# run SIZE REP: one server with SIZE engine cores under the load.
run() {
  target/release/host --model "$model" serve --port "$port" \
    --set "parallel.data_parallel_size=$1" >"$work/dp$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/dp$1.log" >&2; exit 1; }
    sleep 0.1
  done
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --label "dp$1" --num-requests "$n" \
    --concurrency "$c" --prompt-tokens "$p" --max-tokens "$m" --json "$work/dp$1.$2.json" >&2
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}

lscpu | sed -n 's/^Model name: *//p'
for rep in $(seq "$reps"); do
  run 1 "$rep"
  run "$dp" "$rep"
done

python3 - "$work" "$dp" "$reps" <<'PY'
import json, statistics, sys
work, dp, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = {size: [json.load(open(f"{work}/dp{size}.{r}.json")) for r in range(1, reps + 1)] for size in (1, dp)}
med = lambda size, f: statistics.median(f(r) for r in runs[size])
tok = lambda r: r["output_tok_s"]
ttft = lambda r: r["ttft_s"]["p50"] * 1000
itl = lambda r: r["itl_s"]["p50"] * 1000
r0 = runs[1][0]
print(f"{r0['num_requests']} requests, {r0['concurrency']} concurrent, {r0['prompt_tokens']}-token prompts, "
      f"{r0['max_tokens']} output tokens, temperature 0; {reps} alternating runs each\n")
print("| engines | ok | output tok/s (each run) | median tok/s | TTFT p50 ms | ITL p50 ms |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for size in (1, dp):
    ok = sum(r["completed"] for r in runs[size]); total = sum(r["num_requests"] for r in runs[size])
    each = ", ".join(f"{tok(r):.1f}" for r in runs[size])
    print(f"| DP = {size} | {ok}/{total} | {each} | {med(size, tok):.1f} | {med(size, ttft):.0f} | {med(size, itl):.1f} |")
print(f"\nDP = {dp} / DP = 1: output tok/s {med(dp, tok) / med(1, tok):.2f}x, "
      f"TTFT p50 {med(dp, ttft) / med(1, ttft):.2f}x, ITL p50 {med(dp, itl) / med(1, itl):.2f}x")
PY
