#!/usr/bin/env python
"""The int8 ConvRot linear for a few rows (minimax_h3/kernels/int8_gemv.py) against comfy-kitchen's op at the
DiT's AdaLN shape (M rows x K = 2,688 -> N = 64,512, ConvRot group 64, fp32 in and out, a bias; docs/kernels.md).

    python benchmarks/bench_int8_gemv.py --out $OUT                  # one GPU, under a minute
    python benchmarks/bench_int8_gemv.py --tiny --out /tmp/gemv      # CPU dry run in Triton's interpreter

Per row count: ms per call (median) and the weight stream's TB/s (N * K int8 bytes) of comfy-kitchen's op
(`comfy`), the layer's few-row path as tuning.json sets it (`few_rows`: with `int8_gemv.enabled`, comfy-kitchen's
activation step + the kernel at the tuned launch; otherwise comfy-kitchen's op) and the kernel alone at each launch
of `--configs` (BLOCK_N x BLOCK_K x warps x stages), each checked bitwise against comfy-kitchen's output. Writes
<out>/int8_gemv.json; exits 1 when an output differs or a launch fails (recorded under "errors"; the other
launches are still timed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from kernel_bench import time_variants, write_result  # noqa: E402
from minimax_h3.kernels import int8_gemv  # noqa: E402
from minimax_h3.kernels.int8 import (Int8ConvRotLinear, comfy_backend, comfy_int8_linear,  # noqa: E402
                                     quantize_activation)
from minimax_h3.kernels.tuning import launch_params  # noqa: E402

CONFIGS = "32x256x4x4,64x256x4x4,64x128x4x4,128x128x4x3,64x512x4x3,128x256x8x3,32x512x4x4,64x256x4x6,16x512x4x4"


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for int8_gemv.json")
    ap.add_argument("--rows", default="2,3", help="row counts (the AdaLN has one per distinct timestep)")
    ap.add_argument("--n", type=int, default=64512)
    ap.add_argument("--k", type=int, default=2688)
    ap.add_argument("--groupsize", type=int, default=64)
    ap.add_argument("--configs", default=CONFIGS, type=parse_configs,
                    help="kernel launches BLOCK_NxBLOCK_KxWARPSxSTAGES, comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: small shapes in Triton's interpreter")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    n, k, iters = (96, 128, 2) if args.tiny else (args.n, args.k, args.iters)
    configs = [(32, 64, 4, 2)] if args.tiny else args.configs
    torch.manual_seed(0)
    layer = Int8ConvRotLinear.from_float(torch.randn(n, k, device=device) * 0.02, torch.randn(n, device=device),
                                         groupsize=args.groupsize)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "n": n, "k": k, "groupsize": args.groupsize, "tuned": launch_params("int8_gemv", device), "rows": {}}
    failed = False
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, k, device=device)
        bias = layer.bias.float()
        comfy = lambda: comfy_int8_linear(x, layer.weight, layer.weight_scale, bias, torch.float32,  # noqa: E731
                                          args.groupsize)
        want = comfy()
        if args.tiny:  # comfy-kitchen's quantiser does not run in the interpreter; any int8 rows time the kernel
            x_scale = x.abs().amax(dim=1, keepdim=True) / 127
            x_int8 = (x / x_scale).round().clamp(-128, 127).to(torch.int8)
        else:
            x_int8, x_scale = quantize_activation(x, args.groupsize)
        variants = {"comfy": comfy}
        if device.type == "cuda":
            variants["few_rows"] = lambda: layer(x)
        for bn, bk, w, st in configs:
            variants[f"{bn}x{bk}x{w}x{st}"] = (
                lambda bn=bn, bk=bk, w=w, st=st: int8_gemv.launch(x_int8, x_scale, layer.weight, layer.weight_scale,
                                                                  bias, torch.float32, bn, bk, w, st))
        equal, errors = {}, {}
        for name, fn in list(variants.items())[1:]:
            try:
                equal[name] = bool(torch.equal(fn(), want))
            except Exception as e:  # a launch that does not build or run: recorded, the others still timed
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
                del variants[name]
                print(f"M={m} {name}: {errors[name]}", flush=True)
        notes = {name: "  DIFFERS from comfy-kitchen" for name, ok in equal.items() if not ok and not args.tiny}
        timed = time_variants(variants, device, iters, args.tiny, n * k, f"M={m}", notes)
        result["rows"][m] = {"comfy_backend": comfy_backend(x, layer.weight, layer.weight_scale, bias,
                                                            torch.float32, args.groupsize),
                             "timed": timed, "bitwise_equal": equal, "errors": errors}
        # In the interpreter comfy-kitchen's op is its eager path (not its Triton kernel): equality is a GPU check.
        failed |= bool(errors) or (device.type == "cuda" and not all(equal.values()))
    write_result(args.out, "int8_gemv.json", result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
