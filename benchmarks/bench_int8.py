"""Int8 ConvRot linear: comfy-kitchen kernel vs dequantise-once vs plain bf16, error and (on GPU) time.

    python benchmarks/bench_int8.py                       # x [512, 5376] @ W [7168, 5376]^T (a DiT out_proj-ish GEMM)
    python benchmarks/bench_int8.py --m 4096 --n 21504    # qkv at a longer sequence

Relative error = ||y - ref||_F / ||ref||_F with ref = fp32 x @ W^T on the unquantized weight. Two activation sets:
Gaussian, and Gaussian with 8 outlier channels x50 (DiT-like activations, where ConvRot matters).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_h3.kernels.int8 import Int8ConvRotLinear  # noqa: E402

OUTLIER_CHANNELS = 8
OUTLIER_GAIN = 50.0


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def time_call(fn, device: torch.device, iters: int) -> float:
    """Mean milliseconds per call (CUDA events on GPU, perf_counter on CPU), after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=512, help="tokens")
    ap.add_argument("--k", type=int, default=5376, help="in features")
    ap.add_argument("--n", type=int, default=7168, help="out features")
    ap.add_argument("--groupsize", type=int, default=256)
    ap.add_argument("--iters", type=int, default=None, help="timing iterations (default 50 GPU, 2 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    iters = args.iters or (50 if device.type == "cuda" else 2)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w = torch.randn(args.n, args.k, generator=gen, device=device) / args.k**0.5
    x = torch.randn(args.m, args.k, generator=gen, device=device)
    x_out = x.clone()
    x_out[:, torch.randperm(args.k, generator=gen, device=device)[:OUTLIER_CHANNELS]] *= OUTLIER_GAIN

    kernel = Int8ConvRotLinear.from_float(w, groupsize=args.groupsize, mode="kernel", compute_dtype=torch.bfloat16)
    dequant = Int8ConvRotLinear.from_float(w, groupsize=args.groupsize, mode="dequant", compute_dtype=torch.bfloat16)
    dequant.materialize()
    w_bf16 = w.to(torch.bfloat16)
    backend = kernel.kernel_backend(x.to(torch.bfloat16))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}; x [{args.m}, {args.k}] @ W [{args.n}, {args.k}]^T; ConvRot group {args.groupsize}; "
          f"comfy-kitchen backend for int8_linear: {backend}; bf16 activations")

    rows = []
    for label, xs in (("gaussian", x), ("outliers", x_out)):
        ref = xs @ w.T
        xb = xs.to(torch.bfloat16)
        paths = {
            "bf16 F.linear (unquantized)": lambda: torch.nn.functional.linear(xb, w_bf16),
            "int8 dequant-once + bf16": lambda: dequant(xb),
            f"int8 kernel ({backend})": lambda: kernel(xb),
        }
        outs = {p: fn() for p, fn in paths.items()}
        y_k, y_d = outs[f"int8 kernel ({backend})"], outs["int8 dequant-once + bf16"]
        for p, fn in paths.items():
            ms = time_call(fn, device, iters) if label == "gaussian" else float("nan")
            extra = rel_err(y_k, y_d.float()) if p.startswith("int8 kernel") else float("nan")
            rows.append((label, p, rel_err(outs[p], ref), extra, ms))

    tflop = 2 * args.m * args.k * args.n / 1e12
    print("\n| activations | path | rel err vs fp32 | kernel vs dequant | ms/call | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for label, p, err, kd, ms in rows:
        kd_s = "" if kd != kd else f"{kd:.2e}"
        ms_s, tf_s = ("", "") if ms != ms else (f"{ms:.3f}", f"{tflop / (ms / 1e3):.1f}")
        print(f"| {label} | {p} | {err:.2e} | {kd_s} | {ms_s} | {tf_s} |")


if __name__ == "__main__":
    main()
