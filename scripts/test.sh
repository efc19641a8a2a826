#!/usr/bin/env bash
# Installs what the test suite needs on a fresh machine, then runs every test.
# This is README's second command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

# The WebAssembly target the plugins are built for.
rustup target add wasm32-wasip2
# The Python references the end-to-end tests compare against.
python3 -m pip install --quiet --disable-pip-version-check -r tests/reference/requirements.txt
# The default model (cached; checked by sha256).
bash scripts/fetch-model.sh
# The shipped and fixture plugins: their own workspace, built for WebAssembly
# (the end-to-end tests load them from plugins/target), and their unit tests.
(cd plugins && cargo build --release --target wasm32-wasip2 && cargo test)
# The plugin written in Python (componentize-py, pinned), built and unit-tested
# once per run; tests/plugins_python.rs loads it into the engine.
python3 -m pip install --quiet --disable-pip-version-check -r plugins/python/requirements.txt
bash plugins/python/longest-prompt-first/build.sh
python3 plugins/python/longest-prompt-first/test_app.py

cargo test --workspace --all-targets
