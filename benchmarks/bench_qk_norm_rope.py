"""Op level: the DiT attention's q/k RMSNorm + RoPE + layout write, plain torch against the Triton kernel.

    python benchmarks/bench_qk_norm_rope.py --out $OUT               # one GPU: S = 14,882 and 37,748, H = 56 (< 1 min)
    python benchmarks/bench_qk_norm_rope.py --tiny --out /tmp/qk     # CPU dry run: small shapes, reference only, plus
                                                                  # the kernel in triton's interpreter if installed

For each S (y = the qkv projection's output [S, 3 * H * D], bf16; gains [D] bf16; cos/sin [S, r] fp32; out
[3, 1, H, S, D] bf16), CUDA events, median of --iters calls after a warm-up:
- `reference eager`: minimax_h3.dit.ops.qk_norm_rope_reference (the model's math, op by op);
- `reference compiled`: the same under torch.compile (what a compiled block did before the kernel, on its own);
- `triton BxW[xHxP]`: the kernel (torch op h3stages::qk_norm_rope_) with B rows of H (section, head) pairs per
  program (default 1), W warps and P loads in flight (default 1), for each of --configs;
- `triton ... e4m3 q/k`: the kernel writing q and k in e4m3 with the static scales of fp8 attention
  (minimax_h3/kernels/fp8_attention.py `static_qk_mult`), for each of --configs; `... e4m3 q/k, no v`: the same
  without the v copy (what the DiT blocks run with FlashAttention-3 fp8, which reads v from the projection).
Reported: ms, effective TB/s (bytes of y, cos and sin read once plus the outputs written once, over the time; the
e4m3 variants write a quarter less), and the kernel's error against the eager reference (bf16 out: max abs, max in
units of the value's ulp, fraction bitwise equal; e4m3 q/k: max e4m3 steps from the reference's e4m3, fraction
equal). Writes <out>/qk_norm_rope.json; exit 1 if a kernel's output is off by more than one ulp or one e4m3 step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import E4M3_STEP_BOUND, e4m3_deviation, over_bound, time_variants, write_result  # noqa: E402

SHAPES = (14882, 37748)  # rows of 832x480x124 and 1344x768x124 (docs/performance.md)
HEADS, HEAD_DIM, ROPE_DIM = 56, 128, 96
EPS = 1e-5  # the model's (docs/model.md §2)
CONFIGS = "16x4,32x4,8x4,16x2,8x2,16x4x8x2,16x4x16x2,32x4x8x2,16x4x112x2,8x2x8x3"  # rows x warps[x pairs x stages]
TINY = dict(shapes=(37, 100), heads=3, head_dim=32, rope_dim=24)


def inputs(s: int, heads: int, d: int, r: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(s)
    y = torch.randn(s, 3 * heads * d, generator=g, device=device).to(torch.bfloat16).view(s, 3, heads, d)
    gains = [(torch.randn(d, generator=g, device=device) * 0.3 + 1).to(torch.bfloat16) for _ in range(2)]
    angles = torch.rand(s, r // 2, generator=g, device=device) * 6.3
    rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    out = torch.empty(3, 1, heads, s, d, dtype=torch.bfloat16, device=device)
    return y, gains, rope, out


ABS_FLOOR = 1e-6  # absolute error allowed on top of one ulp (see errors())

def errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Max abs error, max error in units of the value's bf16 ulp (2^-7 |value|) plus ABS_FLOOR, fraction bitwise
    equal. The floor: where RoPE cancels to almost zero, the fp32 rounding of the two products (the kernel sums the
    squares in another order) is all that is left, a relative error without meaning (tests/test_qk_norm_rope.py
    bounds the error the same way)."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    ulps = diff / (want.abs() * torch.finfo(torch.bfloat16).eps + ABS_FLOOR)
    return {"max_abs": diff.max().item(), "max_ulps": ulps[diff > 0].max().item() if (diff > 0).any() else 0.0,
            "exact_fraction": (diff == 0).float().mean().item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for qk_norm_rope.json")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per variant (median)")
    ap.add_argument("--configs", default=CONFIGS, help="Triton launch configs: ROWSxWARPS[xPAIRSxSTAGES],...")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run (small shapes; the kernel interpreted)")
    args = ap.parse_args()
    if args.tiny:
        # Before minimax_h3.kernels.qk_norm_rope is imported: its kernel is then built for triton's CPU interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shapes, heads, d, r = torch.device("cpu"), TINY["shapes"], TINY["heads"], TINY["head_dim"], \
            TINY["rope_dim"]
        args.iters = min(args.iters, 2)
    elif torch.cuda.is_available():
        device, shapes, heads, d, r = torch.device("cuda"), SHAPES, HEADS, HEAD_DIM, ROPE_DIM
    else:
        print("bench_qk_norm_rope.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    from minimax_h3.dit.ops import qk_norm_rope_reference
    from minimax_h3.kernels import qk_norm_rope as qk
    from minimax_h3.kernels.fp8_attention import static_qk_mult

    configs = [(tuple(int(v) for v in c.split("x")) + (1, 1))[:4] for c in args.configs.split(",")]
    # --tiny without triton (CI): the reference only. Compiling on the CPU would time a C++ build, not the op.
    run_triton = qk.triton is not None
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--tiny)",
                    "torch": torch.__version__, "triton": qk.triton.__version__ if run_triton else None,
                    "heads": heads, "head_dim": d, "rope_dim": r, "dtype": "bfloat16", "iters": args.iters,
                    "shapes": []}
    worst_ulps, worst_steps = 0.0, 0
    for s in shapes:
        y, (qw, kw), rope, out = inputs(s, heads, d, r, device)
        qk8 = torch.empty(2, 1, heads, s, d, dtype=torch.float8_e4m3fn, device=device)
        mult = static_qk_mult(qw, kw)
        moved = 2 * y.numel() * y.element_size() + sum(t.numel() * t.element_size() for t in rope)
        moved8 = moved - qk8.numel() * (y.element_size() - 1)
        ref, ref8 = torch.empty_like(out), torch.empty_like(qk8)
        qk_norm_rope_reference(y, qw, kw, EPS, rope, ref[:2], ref[2])
        qk_norm_rope_reference(y, qw, kw, EPS, rope, ref8, ref[2], mult)
        variants = {"reference eager": lambda: qk_norm_rope_reference(y, qw, kw, EPS, rope, out[:2], out[2])}
        if device.type == "cuda":
            compiled = torch.compile(qk_norm_rope_reference, dynamic=False)
            variants["reference compiled"] = lambda: compiled(y, qw, kw, EPS, rope, out[:2], out[2])
        errs, variants8, variants8v = {}, {}, {}
        if run_triton:
            for b, w, h, p in configs:
                name = f"triton {b}x{w}" + (f"x{h}x{p}" if (h, p) != (1, 1) else "")
                variants[name] = lambda b=b, w=w, h=h, p=p: qk.qk_norm_rope_op(y, qw, kw, EPS, *rope, out[:2], out[2],
                                                                               None, b, w, h, p)
                out.fill_(float("nan"))
                variants[name]()
                errs[name] = errors(out, ref)
                worst_ulps = max(worst_ulps, errs[name]["max_ulps"])
                name8 = f"{name} e4m3 q/k"
                variants8[name8] = lambda b=b, w=w, h=h, p=p: qk.qk_norm_rope_op(y, qw, kw, EPS, *rope, qk8, out[2],
                                                                                 mult, b, w, h, p)
                variants8[name8]()
                errs[name8] = e4m3_deviation(qk8, ref8)
                worst_steps = max(worst_steps, errs[name8]["max_steps"])
                name8v = f"{name8}, no v"
                variants8v[name8v] = lambda b=b, w=w, h=h, p=p: qk.qk_norm_rope_op(y, qw, kw, EPS, *rope, qk8, None,
                                                                                   mult, b, w, h, p)
                qk8.fill_(0)
                variants8v[name8v]()
                errs[name8v] = e4m3_deviation(qk8, ref8)
                worst_steps = max(worst_steps, errs[name8v]["max_steps"])
        notes = {name: (f"  max |err| {e['max_abs']:.2e} ({e['max_ulps']:.2f} ulp), {e['exact_fraction']:.5f} "
                        "bitwise equal" if "max_ulps" in e else
                        f"  max {e['max_steps']} e4m3 steps, {e['exact_fraction']:.5f} equal")
                 for name, e in errs.items()}
        timed = time_variants(variants, device, args.iters, args.tiny, moved, f"S={s:6d}", notes)
        timed.update(time_variants(variants8, device, args.iters, args.tiny, moved8, f"S={s:6d}", notes))
        moved8v = moved8 - 2 * out[2].numel() * out.element_size()  # no v read or written
        timed.update(time_variants(variants8v, device, args.iters, args.tiny, moved8v, f"S={s:6d}", notes))
        result["shapes"].append({"rows": s, "bytes": moved, "bytes_e4m3_qk": moved8, "bytes_e4m3_qk_no_v": moved8v,
                                 "errors": errs,
                                 "variants": timed})
        del y, out, ref, qk8, ref8
    write_result(args.out, "qk_norm_rope.json", result)
    # One ulp is the bound on the GPU; the interpreter casts to bf16 toward zero, which can add another.
    bad = over_bound(worst_ulps, 1.0 if device.type == "cuda" else 2.0, "the kernel", "ulp")
    bad |= over_bound(worst_steps, E4M3_STEP_BOUND[device.type], "the kernel's e4m3 q/k", "e4m3 steps")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
