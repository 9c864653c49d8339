#!/usr/bin/env python
"""The DiT block linears one by one: which 8-bit GEMM form is fastest at the real shapes (docs/performance.md).

    python benchmarks/bench_linear.py --out $OUT/linear.json                   # one GPU (sm_89+), about a minute
    python benchmarks/bench_linear.py --autotune --out $OUT/linear.json        # + torch.compile max-autotune (minutes)
    python benchmarks/bench_linear.py --tiny --out /tmp/linear.json            # CPU dry run (forms that run there)

For every block linear (qkv, out, fc1, fc2 of docs/model.md; one GPU, no tensor parallelism) at M = S rows of
832x480x124 and 1344x768x124, ms per call (CUDA-synchronised median) and TFLOP/s of:
  bf16            F.linear in bf16 (cuBLAS)
  rowwise         what `--linear-kernel fp8` runs (minimax_h3/kernels/registry.Fp8RowwiseLinear): the activation quantised
                  per row, then torch._scaled_mm with row-wise scales (eager: quantisation kernels + GEMM)
  rowwise_gemm    the GEMM alone (activation already quantised)
  rowwise_gemm_fast_accum  the same with use_fast_accum=True (the tensor cores' reduced-precision accumulation,
                  no periodic fp32 promotion: minimax_h3/kernels/tuning.json "fp8_fast_accum")
  tensorwise_gemm the same fp8 operands through torch._scaled_mm with scalar scales (cuBLAS's fp8 path), the row
                  and column scales left out (what a scale epilogue would have to add back)
  tensorwise_epilogue_compiled  quantisation, the scalar-scale GEMM and the row x column scales applied to its
                  bf16 output, under torch.compile (the epilogue a fused consumer would absorb)
  rowwise_compiled  quantisation + GEMM under torch.compile (as inside a compiled block)
  rowwise_autotune  the same with mode="max-autotune-no-cudagraphs" (--autotune; Triton GEMM templates compete)
and each form's relative error vs the bf16 result. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_h3.dit.config import DiTConfig  # noqa: E402
from minimax_h3.kernels.fp8 import quantize_fp8_rowwise  # noqa: E402
from minimax_h3.kernels.registry import Fp8RowwiseLinear, rel_err, time_ms  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

S_BY_SHAPE = {"832x480x124": 14882, "1344x768x124": 37748}
# The forms timed (bf16 alone on a CPU; rowwise_autotune with --autotune).
FORMS = ("bf16", "rowwise", "rowwise_gemm", "rowwise_gemm_fast_accum", "tensorwise_gemm",
         "tensorwise_epilogue_compiled", "rowwise_compiled", "rowwise_autotune")


def linears(cfg: DiTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of a block's linears, docs/model.md (fc1 holds gate and value: 2 x ffn rows)."""
    return {"qkv": (cfg.hidden, 3 * cfg.attn_inner), "out": (cfg.attn_inner, cfg.hidden),
            "fc1": (cfg.hidden, 2 * cfg.ffn), "fc2": (cfg.ffn, cfg.hidden)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--autotune", action="store_true", help="also torch.compile(mode='max-autotune-no-cudagraphs')")
    ap.add_argument("--shapes", default=",".join(S_BY_SHAPE), type=comma_choices(S_BY_SHAPE),
                    help="comma-separated, from " + ", ".join(S_BY_SHAPE))
    ap.add_argument("--forms", default="", type=comma_choices(FORMS),
                    help="comma-separated forms to run (default: all)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny config, the forms that run on a CPU")
    args = ap.parse_args()
    gpu = not args.tiny
    dev = torch.device("cuda" if gpu else "cpu")
    cfg = DiTConfig.full() if gpu else DiTConfig.tiny()
    sizes = {k: S_BY_SHAPE[k] for k in args.shapes.split(",")} if gpu else {"tiny": 64}
    result: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
                    "rows": {}, "failures": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for shape, m in sizes.items():
        for name, (fin, fout) in linears(cfg).items():
            x = torch.randn(m, fin, device=dev, dtype=torch.bfloat16)
            w = torch.randn(fout, fin, device=dev, dtype=torch.bfloat16) * fin ** -0.5
            ref = F.linear(x, w)
            flop = 2.0 * m * fin * fout
            row: dict = {"shape": shape, "linear": name, "M": m, "K": fin, "N": fout}
            forms = {"bf16": lambda: F.linear(x, w)}
            if gpu:
                lin = Fp8RowwiseLinear.from_dense(w)
                xq, xs = quantize_fp8_rowwise(x)
                one = torch.ones((), device=dev, dtype=torch.float32)
                forms["rowwise"] = lambda: lin(x)
                forms["rowwise_gemm"] = lambda: torch._scaled_mm(xq, lin.weight.t(), scale_a=xs,
                                                                 scale_b=lin.weight_scale.t(),
                                                                 out_dtype=torch.bfloat16)
                forms["rowwise_gemm_fast_accum"] = lambda: torch._scaled_mm(
                    xq, lin.weight.t(), scale_a=xs, scale_b=lin.weight_scale.t(), out_dtype=torch.bfloat16,
                    use_fast_accum=True)
                forms["tensorwise_gemm"] = lambda: torch._scaled_mm(xq, lin.weight.t(), scale_a=one, scale_b=one,
                                                                    out_dtype=torch.bfloat16)

                def tensorwise_epilogue(x2, wq=lin.weight, ws=lin.weight_scale, one=one):
                    q, s = quantize_fp8_rowwise(x2)
                    y = torch._scaled_mm(q, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                    return (y.float() * s * ws.t()).to(torch.bfloat16)

                epi = torch.compile(tensorwise_epilogue, dynamic=False)
                forms["tensorwise_epilogue_compiled"] = lambda: epi(x)
                compiled = torch.compile(lin, dynamic=False)
                forms["rowwise_compiled"] = lambda: compiled(x)
                if args.autotune:
                    tuned = torch.compile(lin, dynamic=False, mode="max-autotune-no-cudagraphs")
                    forms["rowwise_autotune"] = lambda: tuned(x)
            for form, fn in forms.items():
                if args.forms and form not in args.forms.split(","):
                    continue
                try:
                    with torch.inference_mode():
                        t0 = time.time()
                        y = fn()  # the first call compiles the compiled forms
                        if gpu:
                            torch.cuda.synchronize()
                        first_s = time.time() - t0
                        ms = time_ms(fn, dev, args.iters)
                    # The scalar-scale GEMM leaves the row and column scales out: its values are not y's.
                    err = None if form == "tensorwise_gemm" else rel_err(y.float(), ref.float())
                    row[form] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                                 "rel_err_vs_bf16": err, "first_call_s": round(first_s, 2)}
                except Exception as e:  # one form that fails must not hide the others
                    result["failures"].append(f"{shape} {name} {form}: {type(e).__name__}: {str(e)[:300]}")
            result["rows"].setdefault(shape, []).append(row)
            print(f"[{time.strftime('%H:%M:%S')}] {shape} {name} M={m} K={fin} N={fout}: "
                  + ", ".join(f"{f} {r['ms']:.3f} ms ({r['tflops']:.0f} TFLOP/s)"
                              for f, r in row.items() if isinstance(r, dict)), flush=True)
            out.write_text(json.dumps(result, indent=1))
            del x, w, ref
            if gpu:
                torch.cuda.empty_cache()
    for f in result["failures"]:
        print(f"FAILED: {f}", flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
