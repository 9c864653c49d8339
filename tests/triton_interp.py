"""Running a test module's Triton checks in Triton's CPU interpreter, in a fresh process: TRITON_INTERPRET is read
when the kernels are defined (at import), so the current process, which imported them compiled, cannot. Without a
GPU, install Triton into the venv first (`.venv/bin/pip install --no-deps triton`; a CUDA torch already has it),
then e.g. `.venv/bin/python -m pytest tests/test_qk_norm_rope.py -k interpreter`. CI's CPU torch has no Triton,
so there these tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimax_h3.kernels.triton_ops import triton

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not importable (CUDA builds of torch ship it)")


def run_in_interpreter(code: str, expect: str = "") -> None:
    """Runs `code` (Python) under TRITON_INTERPRET=1 from the repo root; it must exit 0 (and print `expect`)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and expect in run.stdout, (run.stdout + run.stderr)[-3000:]


def run_bench_tiny(script: str, out: Path) -> dict:
    """`python benchmarks/<script> --tiny --out <out>` (a GPU benchmark's CPU dry run) must exit 0; its JSON files
    (name -> content; one per op the script times)."""
    import json

    run = subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return {path.name: json.loads(path.read_text()) for path in out.glob("*.json")}
