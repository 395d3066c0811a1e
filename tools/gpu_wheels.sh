#!/usr/bin/env bash
# Wheels that a GPU machine with Python 3.12 and torch 2.11+CUDA (the device image: transformers 5.17, accelerate,
# peft, tensorboard, rich, pyarrow, pandas, xxhash, but no deepspeed, datasets, torchao or pydantic) lacks for
# train.py and `python -m data_pipeline` (orjson), built here on a CPU machine into .gpu_wheels/ (ignored by git):
#
#     bash tools/gpu_wheels.sh            # download and build the bundle (about 30 MB)
#     bash tools/gpu_wheels.sh --check    # also install it with --no-index into a clean Python 3.12 venv
#                                         # (PYTHON312=/path/to/python3.12 if that is not on PATH)
#
# On the GPU machine:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu_wheels/*.whl && export PYTHONPATH=/tmp/site
#
# Versions are requirements.txt's pins except torchao: 0.17.0 is the release built against torch 2.11 (0.18.0
# expects a newer torch). deepspeed ships only a source archive; its wheel is pure Python (ops are JIT-built
# on first use, with the machine's nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu_wheels
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
PACKAGES=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  hjson==3.1.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0
  transformers==5.23.0 tokenizers==0.23.3
  torchao==0.17.0 lion-pytorch==0.2.5
  orjson==3.13.0
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$OUT" "${PACKAGES[@]}"
if ! ls "$OUT"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8
fi
du -sh "$OUT"
if [[ "${1:-}" == "--check" ]]; then
  CHECK=$(mktemp -d)
  "${PYTHON312:-python3.12}" -m venv "$CHECK/venv"
  "$CHECK/venv/bin/python" -m pip install -q --no-index --no-deps --target "$CHECK/site" "$OUT"/*.whl
  PYTHONPATH="$CHECK/site" "$CHECK/venv/bin/python" -c \
    "import pydantic, hjson, dill, multiprocess, annotated_types, fsspec; print('bundle installs into', __import__('sys').version.split()[0])"
  rm -rf "$CHECK"
fi
