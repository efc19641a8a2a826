#!/usr/bin/env bash
# Installs what the test suite needs on a fresh machine, then runs every test.
# This is README's second command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
# A run builds once from scratch: incremental compilation's caches would
# only take disk (about 2 GiB of the 6 the test build needs), which a CI
# machine may be short of. Say how much there is, for when it runs out.
export CARGO_INCREMENTAL=0
df -h . | tail -1 | awk '{print "disk: " $4 " free of " $2}'

# The WebAssembly target the plugins are built for, and the lint tools.
rustup target add wasm32-wasip2
rustup component add rustfmt clippy
# Formatting, first because it is cheap: the root workspace and the plugins'.
cargo fmt --all --check
(cd plugins && cargo fmt --all --check)
# The Python references the end-to-end tests compare against.
python3 -m pip install --quiet --disable-pip-version-check -r tests/reference/requirements.txt
# NVRTC, so the CUDA kernels compile to PTX here although no GPU is present.
python3 -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12>=12.4,<13"
# The default model (cached; checked by sha256).
bash scripts/fetch-model.sh
# The shipped and fixture plugins: their own workspace, built for WebAssembly
# (the end-to-end tests load them from plugins/target), and their unit tests.
(cd plugins && cargo build --release --target wasm32-wasip2 && cargo test)
# Installed beside the test binary of `host` (target/debug/plugins/), where
# it looks for the shipped plugins: the tests serve the default
# configuration, structured output included.
mkdir -p target/debug/plugins
cp plugins/target/wasm32-wasip2/release/structured_output.wasm target/debug/plugins/
# Lints, warnings as errors: the plugins as built (wasm32-wasip2) and as
# unit-tested (the host target), then the root workspace with every target
# (the host crate, its tests and benches, the end-to-end tests).
(cd plugins &&
    cargo clippy --workspace --all-targets --target wasm32-wasip2 -- -D warnings &&
    cargo clippy --workspace --all-targets -- -D warnings)
cargo clippy --workspace --all-targets -- -D warnings
# The plugin written in Python (componentize-py, pinned), built and unit-tested
# once per run; tests/plugins_python.rs loads it into the engine.
python3 -m pip install --quiet --disable-pip-version-check -r plugins/python/requirements.txt
bash plugins/python/longest-prompt-first/build.sh
python3 plugins/python/longest-prompt-first/test_app.py

# The browser test (tests/server_web.rs): Debian's chromium and its driver
# (no browser download), driven by selenium.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver
fi
python3 -m pip install --quiet --disable-pip-version-check -r tests/browser/requirements.txt
# The multi-node tests (tests/multi_node.rs) run node 1 in a network
# namespace behind a veth pair: iproute2's `ip`, as root.
if ! command -v ip >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends iproute2
fi

cargo test --workspace --all-targets

# The run above used the fastest kernel family this CPU has. Batched tokens
# must equal tokens run alone on every family (the quantized matmuls are
# bit-identical across families, which the unit tests check; the norms and
# softmax are not), so the batched-vs-alone tests (with an f32 and with
# half-width KV caches) run with each family forced in turn, skipping those
# the CPU lacks (`host` refuses them). They run from the test binary the
# build above made: a `cargo test` naming one target resolves the
# dependencies' features without the host's dev-dependencies and rebuilds
# half the tree (2.5 minutes) for it.
suite="$(cargo test --workspace --all-targets --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "suite" and m["executable"]:
        print(m["executable"])')"
for kernels in scalar avx2 avxvnni avx512vnni amx; do
    if HOST_CPU_KERNELS=$kernels target/debug/host config show >/dev/null 2>&1; then
        (cd tests && HOST_CPU_KERNELS=$kernels "$suite" \
            engine::batched_greedy_equals_one_at_a_time engine::half_width_kv_caches)
    fi
done

# The deployment files (docs/deploy/): strict Kubernetes schemas, the custom
# resources' fields, and the node place the engine takes under each launcher.
python3 -m pip install --quiet --disable-pip-version-check -r tests/deploy/requirements.txt
python3 tests/deploy/check.py target/debug/host

# The CUDA runner's CPU-verifiable parts (`--features cuda`): every kernel
# compiled to PTX for sm_90 by the wheel's NVRTC (a kernel that does not
# compile fails here), and the host-side logic. The GPU checks themselves
# are scripts/gpu-check.sh, on a machine with a GPU. None of these tests runs
# the model, so the host crate is built unoptimised for them: a third of the
# optimised build's time (2.5 minutes), the tests themselves no slower.
NVRTC_LIB_DIR="$(python3 -c 'import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0] + "/lib")')"
LD_LIBRARY_PATH="$NVRTC_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CARGO_PROFILE_TEST_OPT_LEVEL=0 \
    cargo test -p host --features cuda --lib cuda
# The same lints over the code only `--features cuda` compiles.
cargo clippy -p host --features cuda --all-targets -- -D warnings
# The same code against CUDA 13.0's bindings (the variant scripts/gpu-check.sh
# builds for a CUDA 13 device), linted so that it cannot rot: a check reuses
# the step above's dependencies but cudarc's (30 s, against 2.5 minutes for
# a test build).
CUDARC_CUDA_VERSION=13000 cargo clippy -p host --features cuda --all-targets -- -D warnings
