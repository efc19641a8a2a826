#!/usr/bin/env bash
# Prints the bin directory of a llama.cpp build that runs on this CPU, for
# the scripts that measure host beside llama.cpp. The native build
# (scripts/build-llamacpp.sh) compiles in ggml's AMX kernels on a CPU with
# AMX, and there its programs crash (SIGILL or SIGSEGV); then the copy built
# without AMX (LLAMA_NO_AMX=1, ggml's AVX-512 VNNI kernels) is built once
# and used instead. Needs the default model (scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
bash scripts/build-llamacpp.sh >/dev/null
bin=.cache/llama.cpp/bin
if ! "$bin/llama-bench" -m "$model" -t 2 -r 1 -p 8 -n 1 -o json >/dev/null 2>&1; then
    echo "llama.cpp's native build failed its smoke run; using the build without AMX" >&2
    LLAMA_NO_AMX=1 bash scripts/build-llamacpp.sh >/dev/null
    bin=.cache/llama.cpp-noamx/bin
fi
echo "$bin"
