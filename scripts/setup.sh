#!/usr/bin/env bash
# Create .venv and install h3-stages with its test extras. One line per step; pip's own output goes to
# .venv/setup.log (shown when a step fails).
#   scripts/setup.sh [--cpu | --cuda | --build cpu|cu126|cu128|cu130] [--plan]
# The torch build fits the machine (client/machine.py): with an NVIDIA GPU and a driver that runs one, the CUDA build
# of torch that driver runs (plus nvidia-cudnn-frontend on Hopper and later, for fp8 attention, and fa3-fwd on Hopper,
# for FlashAttention-3), else the CPU build
# from PyTorch's CPU wheel index (PyPI's torch is the CUDA build: GBs of nvidia wheels); it says which and why.
# --cpu / --cuda override the choice (--cuda fails when no CUDA build can run here); --build names the build whatever
# this machine has (an image built for other machines: deploy/Dockerfile); --plan prints the choice and installs
# nothing. PYTHON=python3.12 for another interpreter; TORCH_SPEC="torch==2.11.0" with TORCH_INDEX_URL=<the index that
# has it> for another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log=.venv/setup.log
t_all=$SECONDS
force=(); named=0; plan=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu|--cuda) force=("$1"); shift;;
    --build) [[ $# -ge 2 ]] || { echo "setup.sh: --build needs a build: cpu, cu126, cu128 or cu130" >&2; exit 2; }
      force=(--build "$2"); named=1; shift 2;;
    --plan) plan=1; shift;;
    -h|--help) sed -n '2,11p' "$0"; exit 0;;
    *) echo "setup.sh: unknown option $1 (see --help)" >&2; exit 2;;
  esac
done
# An index goes with the torch it has: the build's own index for the build's own torch (a +cpu wheel is only on the
# CPU index, a CUDA build's on its cuXXX index), TORCH_INDEX_URL only beside the TORCH_SPEC it serves.
if [[ -n "${TORCH_INDEX_URL:-}" && -z "${TORCH_SPEC:-}" ]]; then
  echo "setup.sh: TORCH_INDEX_URL=$TORCH_INDEX_URL without TORCH_SPEC: the torch build comes from its own index" \
       "(--build cpu|cu126|cu128|cu130 names one); give TORCH_SPEC too for a torch of another index, or unset" \
       "TORCH_INDEX_URL" >&2
  exit 2
fi
command -v "$PY" >/dev/null || { echo "setup.sh: $PY not found; install Python 3.10+ or set PYTHON" >&2; exit 1; }
choice="$("$PY" -m client.machine torch "${force[@]}" 2>&1)" || {  # exit 1: no build fits; 2: a bad --build
  rc=$?; echo "setup.sh: $(sed -n 's/^why=//p; s/^.*: error: //p' <<<"$choice")" >&2; exit $rc; }
pick() { sed -n "s/^$1=//p" <<<"$choice"; }
build="$(pick build)"; torch_spec="${TORCH_SPEC:-$(pick spec)}"; index_url="${TORCH_INDEX_URL:-$(pick index_url)}"
echo "torch build: $build ($(pick why))"
# A CUDA build chosen for this machine's GPU is checked against it; one named with --build is for another machine.
check_gpu=0; [[ $build == cu* && $named == 0 ]] && check_gpu=1
# The CPU build: torch alone from the CPU wheel index (a wheel of it in pip's --find-links does as well), its
# requirements from the default index with the next step. One try and a 20 s timeout there, so an index this
# machine cannot reach costs seconds, not pip's five retries.
torch_args=(); [[ -n "$index_url" ]] && torch_args=(--index-url "$index_url")
if [[ $build == cpu ]]; then
  torch_args+=(--no-deps --retries 1 --timeout 20)
  echo "torch from $index_url, PyTorch's CPU wheel index: PyPI's torch is the CUDA build, several GB of nvidia" \
       "wheels that a machine without a GPU does not use"
fi
if [[ $plan == 1 ]]; then
  echo "plan: pip install $torch_spec ${torch_args[*]}"
  [[ "$(pick cudnn_frontend)" == 1 ]] && echo "plan: pip install --no-deps nvidia-cudnn-frontend==1.32.0"
  [[ "$(pick fa3)" == 1 ]] && echo "plan: pip install --no-deps fa3-fwd==0.0.3"
  [[ $check_gpu == 1 ]] && echo "plan: check that torch sees the GPU"
  exit 0
fi

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
  printf 'creating .venv with %s ... ' "$("$PY" --version 2>&1)"
  "$PY" -m venv .venv || { echo "failed (on Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
  echo "done"
fi
: > "$log"
step "updating pip" .venv/bin/python -m pip install --upgrade pip
# torch first and pinned, from its build's index: an unpinned torch from PyPI is a multi-GB CUDA build.
step "installing $torch_spec ($build build from ${index_url:-the default index}, the largest download)" \
  .venv/bin/python -m pip install "$torch_spec" "${torch_args[@]}"
step "installing h3-stages (editable) and its test tools" .venv/bin/python -m pip install -e ".[test]"
# fp8 attention's graph API (minimax_h3/kernels/fp8_attention.py; tests check our graph against it on CPU). --no-deps: its
# declared extras (CuTe DSL, TVM FFI) serve the frontend's own Blackwell kernels, never imported on our path.
imports="import torch, grpc, av, comfy_kitchen, huggingface_hub"
if [[ "$(pick cudnn_frontend)" == 1 ]]; then
  step "installing nvidia-cudnn-frontend 1.32.0 (no deps)" .venv/bin/python -m pip install --no-deps "nvidia-cudnn-frontend==1.32.0"
  imports+=", cudnn"
fi
# FlashAttention-3's forward kernels (minimax_h3/kernels/fa3_attention.py), built for Hopper only: the kernel registry
# offers them there and nowhere else. --no-deps: its declared build tools (ninja, packaging) are not needed to run it.
if [[ "$(pick fa3)" == 1 ]]; then
  step "installing fa3-fwd 0.0.3 (FlashAttention-3, no deps)" .venv/bin/python -m pip install --no-deps "fa3-fwd==0.0.3"
  # Its extension is built against one torch: where it does not load into ours, the registry says why and skips it.
  .venv/bin/python -c "import fa3_fwd_interface" >>"$log" 2>&1 \
    || echo "fa3-fwd does not load with this torch (see $log); the kernel registry skips FlashAttention-3"
fi
step "checking the imports" .venv/bin/python -c "$imports"
if [[ $check_gpu == 1 ]]; then
  step "checking that torch sees the GPU" .venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'"
fi
echo "h3-stages ready in $((SECONDS - t_all)) s: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')," \
     "log in $log. Next: .venv/bin/python -m client render --prompt \"...\" -o out.mp4"
