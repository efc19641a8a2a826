#!/usr/bin/env bash
# The CUDA runner's device check (issue 7), meant to finish in <= 8 minutes
# on one H200:
#   1. every kernel against a CPU reference on fresh random inputs (NaN-filled
#      outputs, so an unwritten element fails);
#   2. split-K decode attention against one-pass attention and a CPU softmax;
#   3. the GPU runner against the CPU runner on the default model (first-token
#      logits relative error < 1e-2, 32 greedy tokens equal on 5 prompts), and
#      CUDA-graph replay against eager decode at batch 1 / 3 / 17;
#   4. Llama-3.1-8B-shaped dummy weights: decode at batch 1 / 64 / 256 (eager
#      and CUDA graphs) and an 8k prefill, as a table beside the HBM roofline
#      measured in the same run;
#   5. the engine on the GPU worker (worker.cls = "gpu", needs the real
#      model): greedy agreement with the CPU engine, graphs against
#      enforce_eager, sleep levels 1 / 2 freeing memory, update_weights.
#
# The device machine has no cargo and no network, so the check is built here
# and run there:
#   scripts/gpu-check.sh build   # here: test binaries into target/gpu-check/
#   scripts/gpu-check.sh run     # there (carry target/gpu-check): runs them
# With no argument it does both (a machine with cargo and a GPU).
#
# CUDA versions: cudarc's bindings are built for one (CUDARC_CUDA_VERSION),
# and look for that major version's sonames (libcublas.so.12 or .so.13).
# `build` makes the checks twice, cuda12.tar.xz (12.8 bindings, the default
# build) and cuda13.tar.xz (13.0 bindings, built in target/cuda13), and exports
# every kernel's sm_90 PTX to ptx/ with this machine's NVRTC. `run` picks the
# variant matching the device's libraries, says which and why, and if the
# first check fails to load a library, tries the other variant once. A
# variant whose NVRTC cannot load (CUDA 12 bindings, CUDA 13's NVRTC) reads
# the exported PTX instead ($HOST_PTX_DIR).
# GPU_CHECK_MODEL: the .gguf for the runner check (default: the repository's
# cached default model; `dummy` for SmolLM2-shaped random weights).
#
# The default model (98 MB) is more than one device call carries (64 MiB),
# so `build` also cuts it into two pieces under target/gpu-model/, and `run`
# joins them when the model is not on the device. A GPU session makes three
# calls back to back (a warm machine keeps what earlier calls carried):
#   carry [target/gpu-model/part-aa], command: true
#   carry [target/gpu-model/part-ab], command: true
#   carry [target/gpu-check],         command: bash scripts/gpu-check.sh run
# GPU_CHECK_VARIANT=cuda12|cuda13 forces a variant. Any failure exits
# non-zero; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir=target/gpu-check
default_model=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
log="${OUT:-$out_dir}/gpu-check.log"
# The order the checks run in, each with its time limit in seconds and a
# title; a device check not listed runs last with 120 s. All of them
# together stop at `budget` seconds (8 minutes with start-up).
checks=(
    "gpu_kernels 180 kernels against CPU references"
    "gpu_attention 60 split-K decode attention against one-pass and a CPU softmax"
    "gpu_runner 300 runner against the CPU runner; 8B-shaped speed"
    "gpu_worker 150 the engine on the GPU worker: CPU agreement, graphs, sleep, update_weights"
)
budget=460

# The device checks: e2e's test targets that need the `cuda` feature.
device_tests() {
    cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "e2e":
        for t in p["targets"]:
            if "cuda" in (t.get("required-features") or []):
                print(t["name"])'
}

# Builds the device checks against CUDA $1's bindings (12 or 13), stripped,
# into $out_dir/cuda$1.tar.xz: both variants unpacked are over the 64 MiB a
# device call carries (gpu_worker links the whole engine), packed ~18 MB.
build_variant() {
    local version=12080 target=target dest="target/gpu-check-bin/cuda$1" args=(-p e2e --features cuda)
    [[ $1 == 13 ]] && version=13000 target=target/cuda13
    for t in $(device_tests); do args+=(--test "$t"); done
    export CUDARC_CUDA_VERSION=$version CARGO_TARGET_DIR=$target
    cargo test "${args[@]}" --no-run
    rm -rf "$dest" && mkdir -p "$dest"
    # The executables cargo just built, by name.
    cargo test "${args[@]}" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"].startswith("gpu_"):
        shutil.copy(exe, sys.argv[1] + "/" + m["target"]["name"])
' "$dest"
    strip --strip-debug "$dest"/gpu_*
    ls -la "$dest"
    XZ_OPT=-T2 tar -C "$(dirname "$dest")" -cJf "$out_dir/cuda$1.tar.xz" "cuda$1"
    unset CUDARC_CUDA_VERSION CARGO_TARGET_DIR
}

build() {
    rm -rf "$out_dir" && mkdir -p "$out_dir"
    build_variant 12
    build_variant 13
    # Every kernel's sm_90 PTX from the wheel's NVRTC (what CI compiles).
    local nvrtc
    nvrtc="$(python3 -c 'import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0] + "/lib")')" ||
        { echo "gpu-check: no NVRTC; python3 -m pip install 'nvidia-cuda-nvrtc-cu12>=12.4,<13'" >&2; exit 2; }
    rm -rf "$out_dir/ptx"
    LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        cargo run -p host --features cuda --example export_ptx -- "$out_dir/ptx"
    # The default model in two pieces a device call can carry each.
    [[ -f $default_model ]] || bash scripts/fetch-model.sh
    rm -rf target/gpu-model && mkdir -p target/gpu-model
    split -b 48M "$default_model" target/gpu-model/part-
    ls -la target/gpu-model
    ls -la "$out_dir" "$out_dir/ptx"
    du -sh "$out_dir"
}

# Where the dynamic loader would find library $1 (a soname): the
# LD_LIBRARY_PATH folders, then ldconfig's cache; nothing if nowhere.
find_lib() {
    local dir
    for dir in ${LD_LIBRARY_PATH//:/ }; do
        [[ -e $dir/$1 ]] && { echo "$dir/$1"; return; }
    done
    ldconfig -p 2>/dev/null | awk -v l="$1" '$1 == l { print $NF; exit }'
}

# Sets `variant` (cuda12 / cuda13) for this machine's CUDA libraries, and
# `reason` to why.
choose_variant() {
    local found
    if [[ -n ${GPU_CHECK_VARIANT:-} ]]; then
        variant=$GPU_CHECK_VARIANT reason="as GPU_CHECK_VARIANT says"
    elif found=$(find_lib libcublas.so.13) && [[ -n $found ]]; then
        variant=cuda13 reason="CUDA 13's cuBLAS is here ($found)"
    elif found=$(find_lib libcublas.so.12) && [[ -n $found ]]; then
        variant=cuda12 reason="CUDA 12's cuBLAS is here ($found)"
    elif nvidia-smi 2>/dev/null | grep -q 'CUDA Version: 13'; then
        variant=cuda13 reason="no libcublas.so.1[23] found; the driver says CUDA 13"
    else
        variant=cuda12 reason="no libcublas.so.1[23] found; the driver is not CUDA 13"
    fi
}

# CUDA 12 bindings look for libcublas.so or .so.12. CUDA 13's cuBLAS exports
# every symbol they resolve, so where only .so.13 is here, a folder with a
# libcublas.so link to it lets the cuda12 variant run as a fallback.
cublas_link_for_cuda12() {
    local found
    [[ -z $(find_lib libcublas.so.12) && -z $(find_lib libcublas.so) ]] || return 0
    found=$(find_lib libcublas.so.13)
    [[ -n $found ]] || return 0
    mkdir -p "$out_dir/lib12" && ln -sf "$found" "$out_dir/lib12/libcublas.so"
    export LD_LIBRARY_PATH="$PWD/$out_dir/lib12:$LD_LIBRARY_PATH"
    echo "gpu-check: cuda12 uses $found through $out_dir/lib12/libcublas.so" | tee -a "$log"
}

# Runs check $2 of variant $1 for at most $3 seconds, into the log and
# $out_dir/last.log; returns its status.
run_check() {
    local bin="$out_dir/bin/$1/$2"
    [[ -x $bin ]] || { echo "gpu-check: $bin missing; rebuild with 'scripts/gpu-check.sh build'" | tee -a "$log"; return 1; }
    : >"$out_dir/last.log"
    timeout -k 10 "$3" "$bin" --test-threads=1 --nocapture 2>&1 | tee -a "$log" "$out_dir/last.log"
    return "${PIPESTATUS[0]}"
}

# Whether the last check failed on loading a CUDA library (libs.rs's errors,
# or cudarc's own panic where it is reached first).
failed_on_a_library() {
    grep -qE 'the CUDA library|the library cudarc found|Expected symbol in library|Unable to dynamically load' "$out_dir/last.log"
}

run() {
    [[ -f $out_dir/cuda12.tar.xz && -f $out_dir/cuda13.tar.xz ]] ||
        { echo "gpu-check: no cuda12/13.tar.xz in $out_dir; run 'scripts/gpu-check.sh build' first" >&2; exit 2; }
    mkdir -p "$(dirname "$log")"
    # Both variants unpacked into bin/ (Python's tarfile: no xz binary needed).
    rm -rf "$out_dir/bin" && mkdir -p "$out_dir/bin"
    python3 -c '
import sys, tarfile
for archive in sys.argv[2:]:
    with tarfile.open(archive) as t:
        t.extractall(sys.argv[1], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
' "$out_dir/bin" "$out_dir"/cuda1[23].tar.xz
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv |& tee "$log"
    # CUDA libraries: the toolkit's, then any pip wheels' (nvidia/*/lib, which
    # is nvidia/cu13/lib for CUDA 13's wheels).
    local libs=/usr/local/cuda/lib64
    libs+=":$(python3 -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib"))))' 2>/dev/null || true)"
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export HOST_PTX_DIR="$PWD/$out_dir/ptx"
    if [[ -z ${GPU_CHECK_MODEL:-} && ! -f $default_model && -f target/gpu-model/part-aa ]]; then
        mkdir -p "$(dirname "$default_model")"
        cat target/gpu-model/part-* >"$default_model.tmp" && mv "$default_model.tmp" "$default_model"
        echo "gpu-check: joined the carried pieces into $default_model" | tee -a "$log"
    fi
    export GPU_CHECK_MODEL="${GPU_CHECK_MODEL:-$PWD/$default_model}"
    local variant reason other start=$SECONDS status=0 line name limit title left all
    choose_variant
    echo "gpu-check: variant $variant: $reason" | tee -a "$log"
    [[ $variant == cuda12 ]] && cublas_link_for_cuda12
    # Every device check that was built: the listed ones first, in order.
    all=()
    for line in "${checks[@]}"; do
        [[ -x $out_dir/bin/$variant/${line%% *} ]] && all+=("$line")
    done
    for name in $(ls "$out_dir/bin/$variant"); do
        printf '%s\n' "${checks[@]}" | grep -q "^$name " || all+=("$name 120 $name")
    done
    for line in "${all[@]}"; do
        read -r name limit title <<<"$line"
        left=$((budget - (SECONDS - start)))
        ((left > 0)) || { echo "gpu-check: out of time before $name" | tee -a "$log"; status=1; break; }
        echo "== $name ($variant): $title" | tee -a "$log"
        if run_check "$variant" "$name" $((limit < left ? limit : left)); then continue; fi
        if [[ -z ${other:-} ]] && failed_on_a_library; then
            other=$([[ $variant == cuda13 ]] && echo cuda12 || echo cuda13)
            echo "gpu-check: $variant could not load a CUDA library; trying $other once" | tee -a "$log"
            [[ $other == cuda12 ]] && cublas_link_for_cuda12
            if run_check "$other" "$name" $((limit < left ? limit : left)); then
                variant=$other
                continue
            fi
        fi
        other=${other:-none}
        status=1
    done
    echo "gpu-check: variant $variant, $((SECONDS - start)) s, $([[ $status == 0 ]] && echo PASSED || echo FAILED)" | tee -a "$log"
    return $status
}

case "${1:-all}" in
    build) build ;;
    run) run ;;
    all) build && run ;;
    *) echo "usage: scripts/gpu-check.sh [build|run]" >&2; exit 2 ;;
esac
