#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server from the
# source vendored in the PyPI sdist of llama-cpp-python, into .cache/llama.cpp/.
# Used only by the side-by-side benchmarks (scripts/bench-vs-llamacpp.sh), not by CI.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
dest="$root/.cache/llama.cpp"
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
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$tmp/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server >/dev/null
mkdir -p "$dest/bin"
cp "$tmp"/build/bin/llama-bench "$tmp"/build/bin/llama-batched-bench "$tmp"/build/bin/llama-server "$dest/bin/"
echo "llama.cpp ($version): $dest/bin"
