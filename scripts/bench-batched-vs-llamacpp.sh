#!/usr/bin/env bash
# Offline batch throughput on the default model: llama.cpp's
# llama-batched-bench and `host bench throughput` in the same run, same
# threads, with the ratio. B requests of 128 prompt + 128 generated tokens,
# all in flight at once, for B = 16 and 64 (override with BATCHES="16 64").
# Not part of CI: it takes minutes and the machines are noisy.
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-$(nproc)}"
batches="${BATCHES:-16 64}"
npp="${NPP:-128}"
ntg="${NTG:-128}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/fetch-model.sh >/dev/null
llama_bin=$(bash scripts/llamacpp-bin.sh)
cargo build --release -p host --bin host 2>/dev/null

out=$(mktemp -d)
max_b=$(echo "$batches" | tr ' ' '\n' | sort -n | tail -1)
ctx=$((max_b * (npp + ntg)))
# Room for every sequence's KV at once: 46,080 bytes per token of SmolLM2.
kv_bytes=$((ctx * 46080 + (64 << 20)))
echo "llama-batched-bench ($threads threads, B = $batches) ..." >&2
"$llama_bin/llama-batched-bench" -m "$model" -t "$threads" -c "$ctx" -b 2048 -ub 512 \
  -npp "$npp" -ntg "$ntg" -npl "$(echo "$batches" | tr ' ' ',')" --output-format jsonl 2>/dev/null \
  | grep '^{' > "$out/llama.jsonl"
for b in $batches; do
  echo "host bench throughput ($threads threads, B = $b) ..." >&2
  target/release/host --model "$model" --num-threads "$threads" --set "cache.kv_cache_memory_bytes=$kv_bytes" \
    bench throughput --num-prompts "$b" --input-len "$npp" --output-len "$ntg" --json "$out/host-$b.json" >/dev/null
done

python3 - "$out" $batches <<'PY'
import json, sys
out, batches = sys.argv[1], [int(b) for b in sys.argv[2:]]
peer = {}
for line in open(f"{out}/llama.jsonl"):
    r = json.loads(line)
    peer[r["pl"]] = r
# Both count prompt + generated tokens over the whole run (llama-batched-bench's S).
print("| B | llama.cpp s | host s | llama.cpp tok/s | host tok/s | host / llama.cpp |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for b in batches:
    h = json.load(open(f"{out}/host-{b}.json"))
    p = peer[b]
    print(f"| {b} | {p['t']:.1f} | {h['elapsed_s']:.1f} | {p['speed']:.1f} | {h['total_tokens_per_s']:.1f} "
          f"| {h['total_tokens_per_s'] / p['speed']:.2f}× |")
PY
