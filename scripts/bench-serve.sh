#!/usr/bin/env bash
# Serving benchmark: `host serve` and llama.cpp's `llama-server --parallel 16`
# on the same GGUF, one after the other in the same run, driven by the same
# load generator (scripts/bench_serve.py): N streaming requests, C at a time,
# prompts of P random token ids, M output tokens (ignore_eos), temperature 0.
# Prints a table (output tok/s, TTFT and ITL p50/p99, peak RSS of the
# server's whole process tree) and writes
# JSON to $OUT (default target/bench-serve.json).
#
#   bash scripts/bench-serve.sh                  # N=64 C=16 P=100 M=128 THREADS=nproc
#   KV_DTYPE=float16 bash scripts/bench-serve.sh # host's KV cache in f16, as llama-server's
#   BATCHED_TOKENS=512 bash scripts/bench-serve.sh
#                                                # host's token budget a step (--max-num-batched-tokens;
#                                                #   unset: host's default, 2048 as llama-server's --batch-size)
#   SOAK=60 bash scripts/bench-serve.sh          # + host alone: 256 clients for 60 s,
#                                                #   then no running request, no KV block left
#
# Not part of CI: it takes minutes and the machines are noisy. HOST_BIN picks
# a host binary (default: a release build made here, with the shipped
# structured-output plugin installed beside it as the quickstart does).
set -euo pipefail
cd "$(dirname "$0")/.."

n="${N:-64}"; c="${C:-16}"; p="${P:-100}"; m="${M:-128}"
threads="${THREADS:-$(nproc)}"
kv_dtype="${KV_DTYPE:-auto}"
# Passed only when set, so host's own default is what runs otherwise.
budget=(); [[ -n "${BATCHED_TOKENS:-}" ]] && budget=(--max-num-batched-tokens "$BATCHED_TOKENS")
out="${OUT:-target/bench-serve.json}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
host_port=18631; llama_port=18632
bash scripts/fetch-model.sh >/dev/null
llama_bin=$(bash scripts/llamacpp-bin.sh)
if [[ -z "${HOST_BIN:-}" ]]; then
  bash scripts/build-release.sh >/dev/null 2>&1
  HOST_BIN=target/release/host
fi
work=$(mktemp -d)
pid=""
cleanup() { [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# Waits (at most 120 s) until GET $1 answers 200.
wait_ready() {
  for _ in $(seq 1200); do
    curl -sf -o /dev/null "$1" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "server exited during start-up" >&2; return 1; }
    sleep 0.1
  done
  echo "no answer from $1 within 120 s" >&2; return 1
}

# $1 and every process below it (host serve's engine core and workers).
tree() { echo "$1"; for child in $(pgrep -P "$1"); do tree "$child"; done; }
# tree_mib FIELD: /proc status FIELD (kB) summed over $pid's whole process
# tree, in MiB. For VmHWM, each process's own peak: at least the tree's peak
# at any one moment.
tree_mib() {
  local kib=0 p
  for p in $(tree "$pid"); do
    kib=$((kib + $(awk -v f="$1:" '$1 == f { v = $2 } END { print v + 0 }' "/proc/$p/status" 2>/dev/null || echo 0)))
  done
  echo $((kib / 1024))
}
peak_rss() { tree_mib VmHWM; }

# run LABEL PORT: drives the server on PORT, records its peak RSS, stops it.
run() {
  wait_ready "http://127.0.0.1:$2/health"
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$2" --label "$1" --num-requests "$n" \
    --concurrency "$c" --prompt-tokens "$p" --max-tokens "$m" --json "$work/$1.json" || true
  echo "{\"peak_rss_mib\": $(peak_rss)}" > "$work/$1.rss.json"
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}

# Both servers get the same shape: C sequences at once of up to P + M + 32
# tokens each (llama-server's slots split its context; host sizes its KV
# cache to max_num_seqs x max_model_len).
ctx=$((p + m + 32))
echo "llama-server --parallel $c ($threads threads) ..." >&2
"$llama_bin/llama-server" -m "$model" -t "$threads" --parallel "$c" -c $((c * ctx)) \
  --host 127.0.0.1 --port "$llama_port" >"$work/llama.log" 2>&1 &
pid=$!
run llama-server "$llama_port"

echo "host serve ($threads threads, KV cache $kv_dtype, ${BATCHED_TOKENS:-default} tokens a step) ..." >&2
"$HOST_BIN" --model "$model" --num-threads "$threads" --max-num-seqs "$c" --max-model-len "$ctx" \
  --kv-cache-dtype "$kv_dtype" "${budget[@]}" serve --port "$host_port" >"$work/host.log" 2>&1 &
pid=$!
run host "$host_port"

soak_json=null
if [[ -n "${SOAK:-}" ]]; then
  echo "soak: host serve, 256 streaming clients for ${SOAK} s ..." >&2
  "$HOST_BIN" --model "$model" --num-threads "$threads" serve --port "$host_port" >"$work/soak.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$host_port/health"
  rss_start=$(tree_mib VmRSS)
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$host_port" --label soak --concurrency 256 \
    --duration "$SOAK" --prompt-tokens "$p" --max-tokens 32 --json "$work/soak.json" || true
  sleep 1
  curl -s "http://127.0.0.1:$host_port/metrics" > "$work/soak.metrics"
  rss_end=$(tree_mib VmRSS)
  python3 - "$work/soak.json" "$work/soak.metrics" "$rss_start" "$rss_end" > "$work/soak.full.json" <<'PY'
import json, sys
soak = json.load(open(sys.argv[1]))
metrics = {}
for line in open(sys.argv[2]):
    if line.startswith("vllm:") and "le=" not in line and "finished_reason" not in line:
        metrics[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
soak["after"] = {k: metrics[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
soak["rss_mib"] = {"start": int(sys.argv[3]), "end": int(sys.argv[4])}
print(json.dumps(soak))
PY
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  soak_json=$(cat "$work/soak.full.json")
fi

python3 - "$work" "$out" "$soak_json" <<'PY'
import json, sys
work, out, soak = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
runs = {}
for label in ("llama-server", "host"):
    r = json.load(open(f"{work}/{label}.json"))
    r.update(json.load(open(f"{work}/{label}.rss.json")))
    runs[label] = r
ms = lambda s: "-" if s is None else f"{s * 1000:.0f}"
print(f"{runs['host']['num_requests']} requests, {runs['host']['concurrency']} concurrent, "
      f"{runs['host']['prompt_tokens']}-token prompts, {runs['host']['max_tokens']} output tokens, temperature 0\n")
print("| server | ok | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | peak RSS MiB |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for label, r in runs.items():
    print(f"| {label} | {r['completed']}/{r['num_requests']} | {r['output_tok_s']:.1f} | {ms(r['ttft_s']['p50'])} | "
          f"{ms(r['ttft_s']['p99'])} | {ms(r['itl_s']['p50'])} | {ms(r['itl_s']['p99'])} | {r['peak_rss_mib']} |")
ratio = runs["host"]["output_tok_s"] / runs["llama-server"]["output_tok_s"]
print(f"\nhost / llama-server output tok/s: {ratio:.2f}x")
if soak:
    print(f"\nsoak: {soak['completed']} ok, {soak['failed']} failed in {soak['wall_s']:.0f} s at 256 clients, "
          f"{soak['output_tok_s']:.1f} output tok/s; after: {soak['after']}; RSS MiB {soak['rss_mib']}")
json.dump({"runs": runs, "host_over_llama_server": ratio, "soak": soak}, open(out, "w"), indent=2)
print(f"\nJSON: {out}")
PY
