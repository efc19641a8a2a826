#!/usr/bin/env bash
# Prefill (pp512) and single-stream decode (tg128) on the default model:
# llama.cpp's llama-bench and `host bench` in the same run, same threads,
# their repetitions interleaved (llama, host, llama, host, ...) so that the
# drift of a shared machine falls on both alike; medians and their ratio.
# Needs a llama.cpp build (scripts/llamacpp-bin.sh, run automatically) and a release build
# of host. Not part of CI: it takes minutes and the machines are noisy.
# HOST_CPU_KERNELS forces host's kernel family (see docs/benchmarks.md);
# DEPTH=4096 runs both tests after that many tokens of context (llama-bench's
# -d), which measures attention over a long context. KV_DTYPE=float16 gives
# host the KV-cache type llama.cpp uses by default (host's own default, auto,
# is f32 on the CPU); the table's header says which ran. MODEL=FILE.gguf
# measures another GGUF instead of the default model, e.g. a float copy of
# it from scripts/gguf-to-float.py.
set -euo pipefail
cd "$(dirname "$0")/.."

threads="${THREADS:-$(nproc)}"
reps="${REPS:-5}"
depth="${DEPTH:-0}"
kv_dtype="${KV_DTYPE:-auto}"
model="${MODEL:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
bash scripts/fetch-model.sh >/dev/null
llama="$(bash scripts/llamacpp-bin.sh)/llama-bench"
cargo build --release -p host --bin host 2>/dev/null

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in $(seq "$reps"); do
    echo "repetition $i of $reps: llama-bench, then host bench ($threads threads)" >&2
    "$llama" -m "$model" -t "$threads" -r 1 -p 512 -n 128 -d "$depth" -o json > "$out/llama-$i.json"
    target/release/host --model "$model" --num-threads "$threads" --kv-cache-dtype "$kv_dtype" \
        bench --repetitions 1 --depth "$depth" \
        --json "$out/host-$i.json" > "$out/host-$i.txt" 2> "$out/host-$i.log" \
        || { cat "$out/host-$i.log" >&2; exit 1; }
done
head -1 "$out/host-1.txt"
echo "KV cache: host $kv_dtype, llama.cpp f16 (its default)"

python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
llama, host = {}, {}
for i in range(1, reps + 1):
    for r in json.load(open(f"{out}/llama-{i}.json")):
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        if r.get("n_depth"):
            test += f" @ d{r['n_depth']}"
        llama.setdefault(test, []).append(r["avg_ts"])
    for r in json.load(open(f"{out}/host-{i}.json"))["results"]:
        host.setdefault(r["test"], []).append(r["tokens_per_s_mean"])
print(f"| test | llama.cpp tok/s | host tok/s | host / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
for test in host:
    p, h = statistics.median(llama[test]), statistics.median(host[test])
    ratios = [b / a for a, b in zip(llama[test], host[test])]
    print(f"| {test} | {p:.1f} | {h:.1f} | **{h / p:.2f}×** "
          f"(pairs {min(ratios):.2f}–{max(ratios):.2f}) |")
print(f"\n{reps} interleaved pairs; medians, and the range of the per-pair ratios.")
PY
