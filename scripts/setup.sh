#!/usr/bin/env bash
# Create .venv and install h3-stages with its test extras. One line per step; pip's own output goes to
# .venv/setup.log (shown when a step fails).
#   scripts/setup.sh            (PYTHON=python3.12 for another interpreter; TORCH_SPEC="torch==2.11.0" for another torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log=.venv/setup.log
t_all=$SECONDS

step() {  # step "what it does" command...: one line, "done (N s)" or the log's tail and exit 1
  local what="$1" t=$SECONDS; shift
  printf '%s ... ' "$what"
  if "$@" >>"$log" 2>&1; then
    echo "done ($((SECONDS - t)) s)"
  else
    echo "failed"; echo "--- last lines of $log:"; tail -n 25 "$log"; exit 1
  fi
}

if [[ -x .venv/bin/python ]]; then
  echo "using the existing .venv ($(.venv/bin/python --version 2>&1))"
else
  command -v "$PY" >/dev/null || { echo "setup.sh: $PY not found; install Python 3.10+ or set PYTHON" >&2; exit 1; }
  printf 'creating .venv with %s ... ' "$("$PY" --version 2>&1)"
  "$PY" -m venv .venv || { echo "failed (on Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
  echo "done"
fi
: > "$log"
step "updating pip" .venv/bin/python -m pip install --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build where a CPU build is at hand.
step "installing ${TORCH_SPEC:-torch==2.13.0} (the largest download)" .venv/bin/python -m pip install "${TORCH_SPEC:-torch==2.13.0}"
step "installing h3-stages (editable) and its test tools" .venv/bin/python -m pip install -e ".[test]"
# fp8 attention's graph API (stagekit/fp8_attention.py; tests check our graph against it on CPU). --no-deps: its
# declared extras (CuTe DSL, TVM FFI) serve the frontend's own Blackwell kernels, never imported on our path.
step "installing nvidia-cudnn-frontend 1.32.0 (no deps)" .venv/bin/python -m pip install --no-deps "nvidia-cudnn-frontend==1.32.0"
step "checking the imports" .venv/bin/python -c "import torch, grpc, av, comfy_kitchen, cudnn"
echo "h3-stages ready in $((SECONDS - t_all)) s: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')," \
     "log in $log. Next: .venv/bin/python -m client render --prompt \"...\" -o out.mp4"
