#!/usr/bin/env bash
# The portable kernels on another architecture: cross-builds host for
# aarch64-unknown-linux-gnu and, under qemu-user, runs the kernel and worker
# unit tests (the worker ones on the real model), then checks that a greedy
# `host generate` there gives exactly the tokens of this machine's scalar
# kernel family. Needs an x86-64 Debian/Ubuntu machine (installs the cross
# compiler and qemu-user with apt). Not part of CI: about 40 minutes on two
# cores with nothing built yet, most of it building host for both targets.
#
# qemu-user cannot run the unit tests that start child processes (with no
# binfmt handler registered, as in a container, the child's exec fails) or
# that compare /proc/<pid>/stat read from two threads (qemu answers with the
# calling thread's start time), so those run on real aarch64 machines only.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_INCREMENTAL=0
target=aarch64-unknown-linux-gnu

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu \
        g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
fi
rustup target add "$target"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
bash scripts/fetch-model.sh >/dev/null
model=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

# No x86-only item may leak into (or be dead code in) the portable build.
cargo clippy --target "$target" -p host --all-targets -- -D warnings
cargo test --target "$target" -p host --lib -- kernels worker::tests

# Greedy continuations of a few prompts, here with the scalar family and
# there with the only family aarch64 has: the same float operations in the
# same order, so the same tokens.
cargo build -p host --bin host
cargo build --target "$target" -p host --bin host
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cat > "$out/prompts.jsonl" <<'EOF'
{"prompt": "The capital of France is", "max_tokens": 48, "temperature": 0}
{"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 48, "temperature": 0}
{"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}
EOF
HOST_CPU_KERNELS=scalar target/debug/host generate --model "$model" \
    --input "$out/prompts.jsonl" --output "$out/x86_64.jsonl" 2>/dev/null
qemu-aarch64 -L /usr/aarch64-linux-gnu "target/$target/debug/host" generate --model "$model" \
    --input "$out/prompts.jsonl" --output "$out/aarch64.jsonl" 2>/dev/null
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {arch: [json.loads(l) for l in open(f"{out}/{arch}.jsonl")] for arch in ("x86_64", "aarch64")}
same = True
for i, (a, b) in enumerate(zip(rows["x86_64"], rows["aarch64"])):
    ok = a["token_ids"] == b["token_ids"]
    same &= ok
    print(f"prompt {i}: {'same tokens' if ok else 'DIFFERENT tokens'}: {b['text'][:60]!r}")
sys.exit(0 if same and len(rows["aarch64"]) == 3 else 1)
PY
echo "aarch64: clippy clean, unit tests passed, greedy tokens equal the x86-64 scalar family's"
