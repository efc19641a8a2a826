#!/usr/bin/env bash
# Structured-output benchmark (issue 15): one `host serve` with the shipped
# structured-output plugin, driven by scripts/bench_serve.py with N streaming
# requests, C at a time, M output tokens each, alternately unconstrained
# (ignore_eos) and constrained by a JSON schema whose answer is longer than M
# tokens (so both kinds produce exactly M tokens), REPS times each, in the
# same run. Prints each run's line and the constrained / unconstrained ratio
# of output tok/s (median of the pairs). Then the mask time per constrained
# token inside the host (criterion, plugin_structured) for the sandbox's
# overhead beside the native figure (cargo bench -p structured-output).
#
#   bash scripts/bench-structured.sh        # N=32 C=16 P=100 M=128 REPS=3
#
# Not part of CI: it takes minutes and the machines are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."

n="${N:-32}"; c="${C:-16}"; p="${P:-100}"; m="${M:-128}"; reps="${REPS:-3}"
port=18641
bash scripts/fetch-model.sh >/dev/null
if [[ -z "${HOST_BIN:-}" ]]; then
  cargo build --release -p host --bin host 2>/dev/null
  HOST_BIN=target/release/host
fi
(cd plugins && cargo build --release --target wasm32-wasip2 -p structured-output 2>/dev/null)
wasm=plugins/target/wasm32-wasip2/release/structured_output.wasm
work=$(mktemp -d)
pid=""
cleanup() { [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# Given by path, so the figure does not depend on what is installed beside
# the binary (an installed copy of the same name would clash).
extra=()
[[ -f "$(dirname "$HOST_BIN")/plugins/structured_output.wasm" ]] || extra=(--plugin "$wasm")
"$HOST_BIN" "${extra[@]}" serve --port "$port" >"$work/log" 2>&1 &
pid=$!
for _ in $(seq 1200); do
  curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/log" >&2; exit 1; }
  sleep 0.1
done

# A list of short records that never closes within M tokens.
schema='{"json": {"type": "object", "properties": {"people": {"type": "array", "maxItems": 1000, "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}}}, "required": ["people"]}}'
common=(--url "http://127.0.0.1:$port" --num-requests "$n" --concurrency "$c" --prompt-tokens "$p" --max-tokens "$m")
lscpu | sed -n 's/^Model name: *//p'
for r in $(seq "$reps"); do
  python3 scripts/bench_serve.py "${common[@]}" --label "free $r" --json "$work/free$r.json"
  python3 scripts/bench_serve.py "${common[@]}" --label "json-schema $r" --structured-outputs "$schema" --json "$work/json$r.json"
done
python3 - "$work" "$reps" <<'PY'
import json, statistics, sys
work, reps = sys.argv[1], int(sys.argv[2])
ratios = []
for r in range(1, reps + 1):
    free = json.load(open(f"{work}/free{r}.json"))
    con = json.load(open(f"{work}/json{r}.json"))
    assert con["output_tokens"] == free["output_tokens"], (con["output_tokens"], free["output_tokens"])
    ratios.append(con["output_tok_s"] / free["output_tok_s"])
    print(f"pair {r}: free {free['output_tok_s']:.1f} tok/s, json-schema {con['output_tok_s']:.1f} tok/s, ratio {ratios[-1]:.3f}")
print(f"json-schema / free output tok/s: median {statistics.median(ratios):.3f}")
PY
