"""What the op-level benchmarks of the Triton kernels share (benchmarks/bench_qk_norm_rope.py, benchmarks/bench_fp8_rows.py):
timing each variant of one op at one size, comparing e4m3 outputs, failing on an error bound, and writing the result
file. Importing it under `--tiny` (a CPU dry run) sets TRITON_INTERPRET=1 first: Triton reads it when the kernels
are defined, which the imports below already do."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_h3.kernels.registry import time_ms  # noqa: E402


def time_variants(variants: dict[str, Callable[[], object]], device: torch.device, iters: int, tiny: bool,
                  moved: int, label: str, notes: dict[str, str]) -> dict[str, dict]:
    """Median ms of each no-arg variant (`iters` calls after a warm-up) and the effective TB/s for `moved` bytes;
    prints one line per variant, `label` first and the variant's note (its error, say) last."""
    timed = {}
    for name, fn in variants.items():
        ms = time_ms(fn, device, iters, warmup=1 if tiny else 3)
        timed[name] = {"ms": ms, "tb_s": moved / ms / 1e9}
        print(f"{label} {name:20s} {ms:9.3f} ms {moved / ms / 1e9:7.3f} TB/s{notes.get(name, '')}", flush=True)
    return timed


def e4m3_deviation(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far a kernel's e4m3 output is from its reference's: the most e4m3 steps apart and the share equal."""
    from minimax_h3.kernels.fp8_attention import e4m3_steps

    steps = e4m3_steps(got, want)
    return {"max_steps": steps.max().item(), "exact_fraction": (steps == 0).float().mean().item()}


# The most e4m3 steps a kernel may be off its reference: one on a GPU; Triton's CPU interpreter can also miss the
# carry into the next power of two when it rounds to e4m3 (a value half the reference's, 8 steps;
# tests/test_fp8_rows.py).
E4M3_STEP_BOUND = {"cuda": 1, "cpu": 8}


def over_bound(worst: float, bound: float, what: str, unit: str) -> bool:
    """Whether `worst` exceeds `bound`; if so, says so on stderr ("FAIL: <what> is <worst> <unit> off ...")."""
    if worst <= bound:
        return False
    print(f"FAIL: {what} is {worst:g} {unit} off its reference (bound {bound:g})", file=sys.stderr)
    return True


def write_result(out: str, filename: str, result: dict) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / filename).write_text(json.dumps(result, indent=1))
    print(f"wrote {path / filename}")
