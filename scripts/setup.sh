#!/usr/bin/env bash
# Create .venv and install h3-stages with its test extras.
#   scripts/setup.sh            (TORCH_SPEC=... to pick another torch build, e.g. "torch==2.11.0")
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -d .venv ]] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build where a CPU build is at hand.
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
python -c "import torch, grpc, av, comfy_kitchen; print('h3-stages ready: torch', torch.__version__)"
