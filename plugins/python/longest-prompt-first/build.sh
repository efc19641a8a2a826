#!/usr/bin/env bash
# Builds the Python scheduling policy `py:longest-prompt-first` into a
# WebAssembly component with componentize-py (plugins/python/requirements.txt):
#
#   bash plugins/python/longest-prompt-first/build.sh [OUT.wasm]
#
# OUT defaults to plugins/target/python/longest_prompt_first.wasm, where the
# tests look. Rebuilds only when app.py, the WIT file or this script is newer
# than OUT, so calling it again is a no-op (scripts/test.sh and the tests both do).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
# The WIT package version this plugin is built against.
wit="$root/wit/v0.2.0"
out="$(realpath -m "${1:-$root/plugins/target/python/longest_prompt_first.wasm}")"

# Through python3 rather than the `componentize-py` script, so the tool comes
# from the environment `python3 -m pip` installed it into (a pyenv shim for a
# new script only appears after `pyenv rehash`).
componentize_py() {
    python3 -c 'import sys, componentize_py; sys.argv[0] = "componentize-py"; sys.exit(componentize_py.script())' "$@"
}
if ! python3 -c 'import componentize_py' 2>/dev/null; then
    echo "componentize-py is not installed for $(command -v python3); run:" >&2
    echo "  python3 -m pip install -r $root/plugins/python/requirements.txt" >&2
    exit 1
fi
if [[ -f "$out" && "$out" -nt "$here/app.py" && "$out" -nt "$wit/plugins.wit" && "$out" -nt "$0" ]]; then
    exit 0
fi
mkdir -p "$(dirname "$out")"
# --stub-wasi: the component imports nothing, as the sandbox grants nothing
# (without it, CPython's runtime asks wasi:random for a fresh seed on its
# first call, which the host traps). Written to a temporary name first so an
# interrupted build never leaves a half-written component behind.
cd "$here"
componentize_py --quiet -d "$wit" -w scheduling-policy-plugin \
    componentize --stub-wasi app -o "$out.tmp"
mv "$out.tmp" "$out"
echo "built $out"
