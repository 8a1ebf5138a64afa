#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch but cannot reach PyPI (a compute node behind a firewall, a
# CUDA image with torch, torchvision and timm already in it): what the trainer and `launch/bench.py`
# import beyond that, at the versions in constraints.txt. Run here, where pip works:
#
#     bash launch/offline_wheels.sh [PYTHON_VERSION] [DEST]      # defaults: 3.12 .whl
#
# then on the GPU machine, from the repository root, with no network:
#
#     python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#     PYTHONPATH=/tmp/site python3 launch/bench.py gpu
#
# DeepSpeed ships only a source archive; it is built here into a pure-Python wheel (DS_BUILD_OPS=0:
# its C++/CUDA ops are JIT-built where they run), with .venv's torch (`make venv` first). MLflow is left
# out (with what it needs, 87 packages in .venv, torch among them): run with `tracking.enabled=false`
# there and upload the run later with `python launch/sync_mlflow.py RUN_DIR` (docs/tracking.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
DEST=${2:-.whl}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "offline_wheels.sh: $PY not found: run 'make venv' first (DeepSpeed's build imports torch)" >&2; exit 2; }

# Taken as there (a CUDA PyTorch image holds them): torch and what it needs, and of DeepSpeed's and
# webdataset's needs the common ones. Carried: the rest, and typing_extensions, since pydantic needs a
# newer one than an image may hold; and tifffile and pydicom, make_shards' readers of TIFF and DICOM
# (pipeline/data/pixels.py; pure Python, on numpy). tests/unit/test_bench.py checks that the two lists
# cover what DeepSpeed and webdataset require; test_offline_wheels.py installs them as below and reads both.
PRESENT=(torch numpy pyyaml pillow safetensors timm packaging psutil tqdm einops msgpack ninja py-cpuinfo)
PACKAGES=(deepspeed hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions
          webdataset braceexpand tifffile pydicom)
pin() {  # the version constraints.txt pins for package $1 (pip's names: '-' and '_' alike, any case)
  local v
  v=$(grep -iE "^${1//[-_]/[-_]}==" constraints.txt | cut -d= -f3)
  [ -n "$v" ] || { echo "offline_wheels.sh: constraints.txt pins no version of $1" >&2; exit 2; }
  echo "$v"
}

mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two wheels of one package stop the whole install there
binary=()
for p in "${PACKAGES[@]}"; do
  [ "$p" = deepspeed ] || binary+=("$p==$(pin "$p")")
done
# Binary wheels for the GPU machine's Python (pydantic_core is compiled), whatever this machine runs.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${binary[@]}"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$src" "deepspeed==$(pin deepspeed)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$DEST" "$src"/deepspeed-*.tar.gz
ls -1 "$DEST"/*.whl
echo "$(find "$DEST" -name '*.whl' | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1)), for Python $PYVER on x86-64 Linux"
echo "the GPU machine must already have: ${PRESENT[*]}"
