#!/usr/bin/env bash
# Prefill (pp512) and single-stream decode (tg128) on the default model:
# llama.cpp's llama-bench and `host bench` in the same run, same threads, with
# the ratio. Needs scripts/build-llamacpp.sh (run automatically) and a release
# build of host. Not part of CI: it takes minutes and the machines are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-$(nproc)}"
reps="${REPS:-3}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/fetch-model.sh >/dev/null
bash scripts/build-llamacpp.sh >/dev/null
cargo build --release -p host --bin host 2>/dev/null

out=$(mktemp -d)
echo "llama-bench ($threads threads, $reps repetitions) ..." >&2
.cache/llama.cpp/bin/llama-bench -m "$model" -t "$threads" -r "$reps" -p 512 -n 128 -o json > "$out/llama.json"
echo "host bench ($threads threads, $reps repetitions) ..." >&2
target/release/host --model "$model" --num-threads "$threads" bench --repetitions "$reps" --json "$out/host.json" >/dev/null

python3 - "$out/llama.json" "$out/host.json" <<'PY'
import json, sys
llama = json.load(open(sys.argv[1]))
host = json.load(open(sys.argv[2]))
peer = {}
for r in llama:
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    peer[test] = (r["avg_ts"], r["stddev_ts"])
print("| test | llama.cpp tok/s | host tok/s | host / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
for r in host["results"]:
    p, ps = peer[r["test"]]
    h, hs = r["tokens_per_s_mean"], r["tokens_per_s_stddev"]
    print(f"| {r['test']} | {p:.1f} ± {ps:.1f} | {h:.1f} ± {hs:.1f} | {h / p:.2f}× |")
PY
