"""What the NaN / Inf check of the weights costs (docs/checkpoints.md, "Finite weights"): seconds per GiB.

    python benchmarks/bench_finite.py                      # 1 GiB per dtype, CPU
    python benchmarks/bench_finite.py --gib 4 --device cuda:0

For each dtype (bf16, fp16, fp32) it writes a safetensors file of `--gib` GiB in 64 MiB tensors, reads it once to
warm the page cache, then times, best of `--repeat`:
  1. read: every tensor through `TensorReader` with the check off, copied once (safetensors maps the file: the
     copy is where a loader's cast or device copy first touches the pages);
  2. read + check: the same with the CPU check on (what every CPU loader does);
  3. check: `nonfinite_flag` alone on tensors already in memory (the CPU path's own cost);
  4. with `--device cuda:N`: copy to the GPU, then `FiniteCheck` on the device (one flag per tensor, one host sync),
     against the copy alone.
Prints one JSON line per dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stagekit.checkpoints import FiniteCheck, TensorReader, nonfinite_flag, open_checkpoint  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

TENSOR_BYTES = 64 << 20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def best_of(fn, repeat: int, device: str = "cpu") -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench(dtype: torch.dtype, gib: float, repeat: int, device: str, tmp: Path) -> dict:
    per = TENSOR_BYTES // torch.empty((), dtype=dtype).element_size()
    n = max(1, int(gib * (1 << 30) // TENSOR_BYTES))
    g = torch.Generator().manual_seed(0)
    file = tmp / f"weights_{str(dtype).replace('torch.', '')}.safetensors"
    save_file({f"w{i}": torch.randn(per, generator=g).to(dtype) for i in range(n)}, str(file))
    entries = open_checkpoint(file).tensors
    size = n * TENSOR_BYTES / (1 << 30)

    def read_all(check: bool) -> list[torch.Tensor]:
        reader = TensorReader(entries, check_finite=check)
        out = [reader.whole(k).clone() for k in entries]
        reader.close()
        return out

    tensors = read_all(False)  # warms the page cache
    row = {"dtype": str(dtype).replace("torch.", ""), "gib": round(size, 3), "threads": torch.get_num_threads(),
           "read_s_per_gib": best_of(lambda: read_all(False), repeat) / size,
           "read_check_s_per_gib": best_of(lambda: read_all(True), repeat) / size,
           "check_s_per_gib": best_of(lambda: [nonfinite_flag(t) for t in tensors], repeat) / size}
    if device.startswith("cuda"):
        def copy_check(check: bool) -> None:
            finite = FiniteCheck()
            for k, t in zip(entries, tensors):
                d = t.to(device, non_blocking=True)
                if check:
                    finite.add(file, k, d)
            finite.raise_if_bad()

        row["copy_s_per_gib"] = best_of(lambda: copy_check(False), repeat, device) / size
        row["copy_check_s_per_gib"] = best_of(lambda: copy_check(True), repeat, device) / size
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of weights per dtype")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N to time the on-device check too")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", type=comma_choices(DTYPES))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-finite-") as d:
        for name in filter(None, args.dtypes.split(",")):
            print(json.dumps(bench(DTYPES[name], args.gib, args.repeat, args.device, Path(d))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
