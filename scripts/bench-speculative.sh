#!/usr/bin/env bash
# Speculative decoding by n-gram lookup: one request at a time
# (max_num_seqs = 1, so each request's decode speed is its own), the same
# four greedy requests without drafts (the default configuration, async
# scheduling on) and with K drafts per step (default 4; LOOKUP_MIN and
# LOOKUP_MAX, default 5 and 5 as in vLLM, bound the n-gram lengths),
# alternating REPS times so drift on a shared machine cancels. The requests:
# a code edit that copies most of a function, a sentence to copy, a plain
# completion (which this small model ends up repeating), a short poem and a
# function written from its description; with drafts, the code edit and the
# description once more with the code as their predicted output (OpenAI's
# `prediction`), each set beside its request without drafts.
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

python3 - "$dir/requests.jsonl" "$dir/predicted.jsonl" <<'PY'
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
    chat("Write a Python function parse_config(path) that reads a file of key=value "
         "lines into a dict, skipping blank lines and lines that start with #."),
]
lines = [json.dumps({**r, "max_tokens": 128, "temperature": 0}) for r in requests]
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
predicted = [json.dumps({**json.loads(lines[i]), "prediction": code}) for i in (0, 4)]
open(sys.argv[2], "w").write("\n".join(lines + predicted) + "\n")
PY

for rep in $(seq "$reps"); do
    for drafts in 0 "$k"; do
        input="$dir/predicted.jsonl"
        [[ "$drafts" == 0 ]] && input="$dir/requests.jsonl"
        "$host" --model "$model" --max-num-seqs 1 \
            --speculative-config "{\"num_speculative_tokens\": $drafts, \"prompt_lookup_min\": $lookup_min, \"prompt_lookup_max\": $lookup_max}" \
            generate --input "$input" --output "$dir/out_${drafts}_$rep.jsonl" 2>/dev/null
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
names = ["code edit", "copy a sentence", "completion", "poem", "code from a description",
         "code edit, predicted", "code from a description, predicted"]
# The predicted requests (rows 5 and 6, drafting runs only) answer as the
# same requests without a prediction (rows 0 and 4).
plain_row = [0, 1, 2, 3, 4, 0, 4]
base = load(0, 1)
for rep in range(1, reps + 1):
    for drafts in ("0", k):
        rows = load(drafts, rep)
        want = [base[plain_row[i]]["token_ids"] for i in range(len(rows))]
        if [r["token_ids"] for r in rows] != want:
            sys.exit(f"run {rep} with {drafts} drafts produced other tokens")
        print(f"run {rep}, {drafts} drafts: " + ", ".join(f"{speed(r):.0f}" for r in rows))
print(f"\n| request | tokens | decode tok/s, no drafts | with {k} drafts | ratio |")
print("| --- | ---: | ---: | ---: | ---: |")
for i, name in enumerate(names):
    j = plain_row[i]
    a = statistics.median(speed(load(0, rep)[j]) for rep in range(1, reps + 1))
    b = statistics.median(speed(load(k, rep)[i]) for rep in range(1, reps + 1))
    kept = ""
    if "prediction_tokens" in load(k, 1)[i]:
        t = load(k, 1)[i]["prediction_tokens"]
        kept = f" ({t['accepted']} predicted tokens kept, {t['rejected']} not)"
    print(f"| {name} | {len(base[j]['token_ids'])} | {a:.0f} | {b:.0f} | {b / a:.2f}x{kept} |")
PY
