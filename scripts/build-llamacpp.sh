#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server from the
# source vendored in the PyPI sdist of llama-cpp-python, into .cache/llama.cpp/.
# Used only by the side-by-side benchmarks (scripts/bench-vs-llamacpp.sh), not by CI.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
dest="$root/.cache/llama.cpp"
# LLAMA_NO_AMX=1 builds a second copy without ggml's AMX code: GGML_NATIVE
# compiles it in on a CPU with AMX, and there its programs crash (SIGILL on
# the worker threads in issue 21's report, SIGSEGV on 2026-12-04).
# The compiler flags take the AMX instructions away, so ggml's AMX kernels
# (guarded by __AMX_INT8__) are left out and its AVX-512 VNNI ones run.
extra_flags=""
if [ "${LLAMA_NO_AMX:-0}" = 1 ]; then
    dest="$root/.cache/llama.cpp-noamx"
    extra_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-batched-bench" ] && [ -x "$dest/bin/llama-server" ]; then
    echo "llama.cpp: $dest/bin (present)"
    exit 0
fi
command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$tmp" "llama-cpp-python==$version"
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$extra_flags" -DCMAKE_CXX_FLAGS="$extra_flags" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$tmp/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server >/dev/null
mkdir -p "$dest/bin"
cp "$tmp"/build/bin/llama-bench "$tmp"/build/bin/llama-batched-bench "$tmp"/build/bin/llama-server "$dest/bin/"
echo "llama.cpp ($version): $dest/bin"
