#!/usr/bin/env bash
# The release build of `host` as a user installs it: the binary, and the
# shipped structured-output plugin (JSON schemas, regexes, tool calls) built
# for WebAssembly into target/release/plugins/, where `host` looks for it.
# Used by the quickstart and the benchmarks, so both measure the same thing.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p host --bin host
rustup target add wasm32-wasip2
(cd plugins && cargo build --release --target wasm32-wasip2 -p structured-output)
mkdir -p target/release/plugins
cp plugins/target/wasm32-wasip2/release/structured_output.wasm target/release/plugins/
