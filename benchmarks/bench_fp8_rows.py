"""Op level: the DiT block's fused "something + fp8 row quantisation" kernels (minimax_h3/kernels/fp8_rows.py), plain torch
against Triton, for each of --ops:

    python benchmarks/bench_fp8_rows.py --out $OUT               # one GPU, all ops: rows = 14,882 and 37,748
    python benchmarks/bench_fp8_rows.py --ops swiglu --out $OUT  # one op
    python benchmarks/bench_fp8_rows.py --tiny --out /tmp/fr     # CPU dry run: small shapes, reference only, plus the
                                                              # kernels in triton's interpreter if installed

- `modulate`: RMSNorm + AdaLN modulation + fp8 row quantisation (x = the fp32 residual [rows, C], C = 5376; norm
  gain [C] bf16; shift / scale = column chunks of one AdaLN output [M * 3, 6 * C] fp32 with M = 1 timestep; r [rows]
  as a t2va packed sequence has it: 38 text rows, 414 audio rows, then video rows, each block one table row).
  Bytes moved: x read (fp32), q + scales written once (the three AdaLN rows stay in cache).
  Writes <out>/fp8_rows.json.
- `addmod`: the attention's gated residual add made in the MLP's modulation, then `modulate` (x += gate[r] * part
  in place, part = out_proj's bf16 rows [rows, C], gate = a third column chunk of the same AdaLN output). Bytes
  moved: x read and written (fp32), part read (bf16), q + scales written once. Writes <out>/add_modulate_fp8.json.
- `swiglu`: the MLP's silu(gate) * value + fp8 row quantisation (y = fc1's bf16 output [rows, 2F] = [gate | value],
  F = 14336). Bytes moved: y read (bf16), q + scales written once. Writes <out>/swiglu_fp8.json.
- `orows`: fp8 attention's O dequantisation + out_proj's fp8 row quantisation (o8 = the attention kernel's e4m3 O
  [H, rows, D], H = 56 heads, D = 128, per-head scale [H, 1, 1] and V-smoothing shift [H, 1, D] -> rows
  [rows, H * D] e4m3 + scales). Bytes moved: o8 read, q + scales written once. Writes <out>/o_rows_fp8.json.
- `orows-fa3`: the same kernel on FlashAttention-3's O as the model hands it over (bf16 [S, H, D] viewed as
  [H, S, D], unit scales, the shift). Bytes moved: O read (bf16), q + scales written once. Writes
  <out>/o_rows_fa3.json.

For each row count, CUDA events, median of --iters calls after a warm-up:
- `reference eager`: the plain-torch reference (the model's previous math, then quantize_fp8_rowwise);
- `reference compiled`: the same under torch.compile (Inductor's fusion: what a compiled block runs without the
  kernel, on its own; the number the kernel must beat to be used inside compiled blocks);
- `triton BxW`: the kernel (its torch op) with B rows per program and W warps, for each of --configs (default: the
  op's own list, its first entry the op's default launch); `BxWpK` (all but swiglu): at most K programs per SM,
  each looping over row blocks with the next block's loads in flight (`programs_per_sm`).
Reported: ms, effective TB/s (the bytes above over the time), and the deviation from the eager reference (max
relative scale difference, max e4m3 steps apart, fraction of e4m3 values bitwise equal). Exit 1 if a kernel is
more than one e4m3 step off the reference (8 in the interpreter, which can miss a carry when it rounds to e4m3).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_h3.dit.config import TAG_AUDIO, TAG_TEXT, TAG_VIDEO  # noqa: E402
from kernel_bench import E4M3_STEP_BOUND, e4m3_deviation, over_bound, time_variants, write_result  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

SHAPES = (14882, 37748)  # rows of 832x480x124 and 1344x768x124 (docs/performance.md)
TINY_SHAPES = (37, 100)
M = 1  # timesteps: AdaLN table rows 0..2
TEXT_ROWS, AUDIO_ROWS = 38, 414  # t2va at 124 frames: the first rows of both SHAPES, then video (docs/performance.md)
EPS = 1e-6
O_HEAD_DIM = 128  # `orows`: the DiT's head_dim; width = heads x head_dim (56 heads on one GPU)

@dataclass(frozen=True)
class Op:
    """One kernel under test: its output file, width (C, F or H x D) on the GPU and in --tiny, default launch configs
    (rows per program x warps, the first the op's default), its inputs, and its reference / kernel in
    minimax_h3.kernels.fp8_rows (the kernel takes the inputs, then block_rows, num_warps[, programs_per_sm])."""
    json: str
    width: int
    tiny_width: int
    configs: str
    inputs: Callable[[int, int, torch.device], tuple[tuple, int]]  # (rows, width, device) -> (args, bytes moved)
    reference: str
    kernel: str
    mutates_first: bool = False  # the op writes its first input (timed calls keep adding to it; checks get a copy)


def modulate_inputs(rows: int, c: int, device: torch.device) -> tuple[tuple, int]:
    g = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, c, generator=g, device=device) * 3
    weight = (torch.randn(c, generator=g, device=device) * 0.2 + 1).to(torch.bfloat16)
    shift, scale = (torch.randn(M * 3, 6 * c, generator=g, device=device) * 0.5).chunk(6, dim=-1)[:2]
    r = torch.full((rows,), TAG_VIDEO, device=device)  # table row = timestep index (0) * 3 + modality tag
    r[:TEXT_ROWS + AUDIO_ROWS] = TAG_AUDIO
    r[:TEXT_ROWS] = TAG_TEXT
    return (x, weight, EPS, shift, scale, r), x.numel() * 4 + x.numel() + rows * 4  # fp32 x in, e4m3 + scales out


def add_modulate_inputs(rows: int, c: int, device: torch.device) -> tuple[tuple, int]:
    (x, weight, eps, shift, scale, r), _ = modulate_inputs(rows, c, device)
    g = torch.Generator(device=device).manual_seed(rows + 1)
    gate = (torch.randn(M * 3, 6 * c, generator=g, device=device) * 0.5).chunk(6, dim=-1)[2]
    part = torch.randn(rows, c, generator=g, device=device).to(torch.bfloat16)
    # fp32 x in and out, bf16 part in, e4m3 + scales out
    return (x, gate, part, weight, eps, shift, scale, r), x.numel() * (4 + 4 + 2 + 1) + rows * 4


def o_rows_inputs(rows: int, c: int, device: torch.device) -> tuple[tuple, int]:
    h, d = c // O_HEAD_DIM, O_HEAD_DIM
    g = torch.Generator(device=device).manual_seed(rows)
    o8 = (torch.randn(h, rows, d, generator=g, device=device) * 150).clamp(-448, 448).to(torch.float8_e4m3fn)
    o_scale = torch.rand(h, 1, 1, generator=g, device=device) * 1e-2 + 1e-4
    o_shift = torch.randn(h, 1, d, generator=g, device=device) * 0.05
    return (o8, o_scale, o_shift), o8.numel() * 2 + rows * 4  # e4m3 O in, e4m3 q + fp32 scales out


def o_rows_fa3_inputs(rows: int, c: int, device: torch.device) -> tuple[tuple, int]:
    """FlashAttention-3's O as the model hands it over: bf16 [S, H, D] viewed as [H, S, D], unit scales."""
    h, d = c // O_HEAD_DIM, O_HEAD_DIM
    g = torch.Generator(device=device).manual_seed(rows)
    o = (torch.randn(rows, h, d, generator=g, device=device) * 0.5).to(torch.bfloat16).permute(1, 0, 2)
    o_shift = torch.randn(h, 1, d, generator=g, device=device) * 0.05
    ones = torch.ones(h, 1, 1, device=device)
    return (o, ones, o_shift), o.numel() * 3 + rows * 4  # bf16 O in, e4m3 q + fp32 scales out


def swiglu_inputs(rows: int, f: int, device: torch.device) -> tuple[tuple, int]:
    g = torch.Generator(device=device).manual_seed(rows)
    y = (torch.randn(rows, 2 * f, generator=g, device=device) * 2).to(torch.bfloat16)
    return (y,), y.numel() * 2 + rows * f + rows * 4  # bf16 y in, e4m3 q + fp32 scales out


OPS = {
    "modulate": Op("fp8_rows.json", 5376, 96, "1x4,1x8,1x4p2,1x8p2,1x8p4,2x8", modulate_inputs,
                   "modulate_fp8_reference", "modulate_fp8_rows_op"),
    "addmod": Op("add_modulate_fp8.json", 5376, 96, "1x4,1x8,1x4p2,1x8p2,1x8p1,2x8", add_modulate_inputs,
                 "add_modulate_fp8_reference", "add_modulate_fp8_rows_op", mutates_first=True),
    "swiglu": Op("swiglu_fp8.json", 14336, 96, "1x32,1x16,2x16,4x16,2x32", swiglu_inputs, "swiglu_fp8_reference",
                 "swiglu_fp8_rows_op"),
    "orows": Op("o_rows_fp8.json", 56 * O_HEAD_DIM, 3 * O_HEAD_DIM, "2x8p1,1x4,1x8,1x16,1x32,2x16,1x4p2,1x8p2",
                o_rows_inputs, "o_rows_fp8_reference", "o_rows_fp8_op"),
    "orows-fa3": Op("o_rows_fa3.json", 56 * O_HEAD_DIM, 3 * O_HEAD_DIM, "2x8p1,1x4,1x8,1x16,2x16,1x4p2,1x8p2",
                    o_rows_fa3_inputs, "o_rows_fp8_reference", "o_rows_fp8_op"),
}


def parse_config(cfg: str) -> tuple[str, int, int, tuple[int, ...]]:
    """"BxW" (B rows per program, W warps, a program per block of rows) or "BxWpK" (at most K programs per SM,
    looping over the row blocks) -> (name, B, W, (K,) or ())."""
    rows, rest = cfg.split("x")
    warps, _, per_sm = rest.partition("p")
    return cfg, int(rows), int(warps), (int(per_sm),) if per_sm else ()


def deviation(got, want) -> dict:
    return {"max_scale_rel": ((got[1] - want.scale).abs() / want.scale).max().item(),
            **e4m3_deviation(got[0], want.q)}


def bench_op(fr, name: str, op: Op, device: torch.device, shapes, width: int, configs, args) -> tuple[dict, int]:
    """One op at each row count: its result dict and the worst e4m3 steps of any kernel launch."""
    # --tiny without triton (CI): the reference only. Compiling on the CPU would time a C++ build, not the op.
    run_triton = fr.triton is not None
    result: dict = {"op": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--tiny)",
                    "torch": torch.__version__, "triton": fr.triton.__version__ if run_triton else None,
                    "width": width, "iters": args.iters, "shapes": []}
    if name in ("modulate", "addmod"):
        result["timesteps"] = M
    if name.startswith("orows"):
        result["heads"], result["head_dim"] = width // O_HEAD_DIM, O_HEAD_DIM
    worst_steps = 0
    reference, kernel = getattr(fr, op.reference), getattr(fr, op.kernel)
    compiled = torch.compile(reference, dynamic=False) if device.type == "cuda" else None
    for rows in shapes:
        inputs, moved = op.inputs(rows, width, device)

        def fresh(inputs=inputs):  # the inputs as made (a copy of the first where the op writes it)
            return (inputs[0].clone(), *inputs[1:]) if op.mutates_first else inputs

        ref = reference(*fresh())
        variants = {"reference eager": lambda: reference(*inputs)}
        devs = {}
        if compiled is not None:
            variants["reference compiled"] = lambda: compiled(*inputs)
            devs["reference compiled"] = deviation(compiled(*fresh()), ref)
        if run_triton:
            for cfg, b, nw, more in configs:
                variant = f"triton {cfg}"
                variants[variant] = lambda b=b, nw=nw, more=more: kernel(*inputs, b, nw, *more)
                devs[variant] = deviation(kernel(*fresh(), b, nw, *more), ref)
                worst_steps = max(worst_steps, devs[variant]["max_steps"])
        notes = {v: f"  scale rel {d['max_scale_rel']:.1e}, max {d['max_steps']} e4m3 steps, "
                    f"{d['exact_fraction']:.5f} bitwise equal" for v, d in devs.items()}
        result["shapes"].append({"rows": rows, "bytes": moved, "deviation": devs, "variants": time_variants(
            variants, device, args.iters, args.tiny, moved, f"{name:8s} rows={rows:6d}", notes)})
        del inputs, ref, variants
    write_result(args.out, op.json, result)
    return result, worst_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON files (one per op)")
    ap.add_argument("--ops", default="modulate,addmod,swiglu,orows,orows-fa3", type=comma_choices(OPS),
                    help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per variant (median)")
    ap.add_argument("--configs", default=None,
                    help="Triton launch configs ROWSxWARPS,... for every op (default: each op's own list)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run (small shapes; the kernels interpreted)")
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    if args.tiny:
        # Before minimax_h3.kernels.fp8_rows is imported: its kernels are then built for triton's CPU interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shapes = torch.device("cpu"), TINY_SHAPES
        args.iters = min(args.iters, 2)
        tiny_configs = 2  # the interpreter's timings mean nothing and it is slow: two launches check the plumbing
    elif torch.cuda.is_available():
        device, shapes = torch.device("cuda"), SHAPES
    else:
        print("bench_fp8_rows.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    from minimax_h3.kernels import fp8_rows as fr

    worst_steps = 0
    for name in ops:
        op = OPS[name]
        configs = [parse_config(cfg) for cfg in (args.configs or op.configs).split(",")]
        if args.tiny:
            configs = configs[:tiny_configs]
        width = op.tiny_width if args.tiny else op.width
        _, steps = bench_op(fr, name, op, device, shapes, width, configs, args)
        worst_steps = max(worst_steps, steps)
    return 1 if over_bound(worst_steps, E4M3_STEP_BOUND[device.type], "a kernel", "e4m3 steps") else 0


if __name__ == "__main__":
    sys.exit(main())
