#!/usr/bin/env bash
# Speculative decoding by n-gram lookup: one request at a time
# (max_num_seqs = 1, so each request's decode speed is its own), the same
# four greedy requests without drafts (the default configuration, async
# scheduling on) and with K drafts per step (default 4; LOOKUP_MIN and
# LOOKUP_MAX, default 5 and 5 as in vLLM, bound the n-gram lengths),
# alternating REPS times so drift on a shared machine cancels. The requests:
# a code edit that copies most of a function, a sentence to copy, a plain
# completion (which this small model ends up repeating) and a short poem.
# Prints each request's decode tok/s ((tokens - 1) / (e2e - TTFT)) per run,
# the medians and their ratio, and fails if the tokens differ.
#
#   bash scripts/bench-speculative.sh          # K=4 REPS=3
#
# Not part of CI: the machines are noisy. HOST_BIN picks the binary
# (default: a release build).
set -euo pipefail
cd "$(dirname "$0")/.."

k="${K:-4}"; reps="${REPS:-3}"
lookup_min="${LOOKUP_MIN:-5}"; lookup_max="${LOOKUP_MAX:-5}"
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/fetch-model.sh >/dev/null
host="${HOST_BIN:-}"
if [[ -z "$host" ]]; then
    cargo build --release -p host >&2
    host=target/release/host
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

python3 - "$dir/requests.jsonl" <<'PY'
import json, sys
code = (
    "def parse_config(path):\n    config = {}\n    with open(path) as f:\n"
    "        for line in f:\n            line = line.strip()\n"
    "            if not line or line.startswith(\"#\"):\n                continue\n"
    "            key, value = line.split(\"=\", 1)\n"
    "            config[key.strip()] = value.strip()\n    return config\n"
)
chat = lambda text: {"messages": [{"role": "user", "content": text}]}
requests = [
    chat("Rename the function parse_config to load_config in this code and "
         "show the whole code:\n```python\n" + code + "```"),
    chat("Copy this sentence exactly three times: The printing press spread "
         "across Europe within fifty years and made books cheap."),
    {"prompt": "The invention of the printing press"},
    chat("Write a short poem about the sea."),
]
with open(sys.argv[1], "w") as f:
    for r in requests:
        f.write(json.dumps({**r, "max_tokens": 128, "temperature": 0}) + "\n")
PY

for rep in $(seq "$reps"); do
    for drafts in 0 "$k"; do
        "$host" --model "$model" --max-num-seqs 1 \
            --speculative-config "{\"num_speculative_tokens\": $drafts, \"prompt_lookup_min\": $lookup_min, \"prompt_lookup_max\": $lookup_max}" \
            generate --input "$dir/requests.jsonl" --output "$dir/out_${drafts}_$rep.jsonl" 2>/dev/null
    done
done

python3 - "$dir" "$k" "$reps" <<'PY'
import json, statistics, sys
d, k, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(drafts, rep):
    return [json.loads(l) for l in open(f"{d}/out_{drafts}_{rep}.jsonl")]
def speed(r):
    m = r["metrics"]
    return (len(r["token_ids"]) - 1) / (m["e2e_latency_s"] - m["time_to_first_token_s"])
names = ["code edit", "copy a sentence", "completion", "poem"]
base = load(0, 1)
for rep in range(1, reps + 1):
    for drafts in ("0", k):
        rows = load(drafts, rep)
        if [r["token_ids"] for r in rows] != [r["token_ids"] for r in base]:
            sys.exit(f"run {rep} with {drafts} drafts produced other tokens")
        print(f"run {rep}, {drafts} drafts: " + ", ".join(f"{speed(r):.0f}" for r in rows))
print(f"\n| request | tokens | decode tok/s, no drafts | with {k} drafts | ratio |")
print("| --- | ---: | ---: | ---: | ---: |")
for i, name in enumerate(names):
    a = statistics.median(speed(load(0, rep)[i]) for rep in range(1, reps + 1))
    b = statistics.median(speed(load(k, rep)[i]) for rep in range(1, reps + 1))
    print(f"| {name} | {len(base[i]['token_ids'])} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")
PY
