#!/usr/bin/env bash
# The CUDA runner's device check (issue 7), meant to finish in <= 8 minutes
# on one H200:
#   1. every kernel against a CPU reference on fresh random inputs (NaN-filled
#      outputs, so an unwritten element fails);
#   2. the GPU runner against the CPU runner on the default model (first-token
#      logits relative error < 1e-2, 32 greedy tokens equal on 5 prompts);
#   3. Llama-3.1-8B-shaped dummy weights: decode at batch 1 / 64 / 256 and an
#      8k prefill, as a table beside the HBM roofline measured in the same run.
#
# The device machine has no cargo and no network, so the check is built here
# and run there:
#   scripts/gpu-check.sh build   # here: test binaries into target/gpu-check/
#   scripts/gpu-check.sh run     # there (carry target/gpu-check): runs them
# With no argument it does both (a machine with cargo and a GPU).
# GPU_CHECK_MODEL: the .gguf for check 2 (default: the repository's cached
# default model; `dummy` for SmolLM2-shaped random weights). Any failure
# exits non-zero; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=target/gpu-check
log="${OUT:-$out_dir}/gpu-check.log"

build() {
    local args=(-p e2e --features cuda --test gpu_kernels --test gpu_runner)
    cargo test "${args[@]}" --no-run
    mkdir -p "$out_dir/bin"
    # The executables cargo just built, by name.
    cargo test "${args[@]}" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"].startswith("gpu_"):
        shutil.copy(exe, sys.argv[1] + "/" + m["target"]["name"])
' "$out_dir/bin"
    strip --strip-debug "$out_dir"/bin/gpu_* 2>/dev/null || true
    ls -la "$out_dir/bin"
}

run() {
    [[ -x $out_dir/bin/gpu_kernels && -x $out_dir/bin/gpu_runner ]] ||
        { echo "gpu-check: no binaries in $out_dir/bin; run 'scripts/gpu-check.sh build' first" >&2; exit 2; }
    mkdir -p "$(dirname "$log")"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv |& tee "$log"
    # CUDA libraries: the toolkit's, then any pip wheels' (nvidia/*/lib).
    local libs=/usr/local/cuda/lib64
    libs+=":$(python3 -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib"))))' 2>/dev/null || true)"
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export GPU_CHECK_MODEL="${GPU_CHECK_MODEL:-$PWD/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    local start=$SECONDS status=0
    echo "== 1. kernels against CPU references" | tee -a "$log"
    timeout 180 "$out_dir/bin/gpu_kernels" --test-threads=1 --nocapture |& tee -a "$log" || status=1
    echo "== 2+3. runner against the CPU runner; 8B-shaped speed" | tee -a "$log"
    timeout 300 "$out_dir/bin/gpu_runner" --test-threads=1 --nocapture |& tee -a "$log" || status=1
    echo "gpu-check: $((SECONDS - start)) s, $([[ $status == 0 ]] && echo PASSED || echo FAILED)" | tee -a "$log"
    return $status
}

case "${1:-all}" in
    build) build ;;
    run) run ;;
    all) build && run ;;
    *) echo "usage: scripts/gpu-check.sh [build|run]" >&2; exit 2 ;;
esac
