"""cuDNN fp8 SDPA on one GPU: every execution plan cuDNN offers, per memory layout, and the kernel under load.

    python benchmarks/bench_fp8_plans.py --out $OUT                    # one H200: about 2-3 minutes
    python benchmarks/bench_fp8_plans.py --out $OUT --parts plans      # one part

Why (docs/performance.md, "Why the isolated floor is not reached"): inside the DiT the fp8 SDPA kernel ran 8-11 % slower than the same kernel
timed on its own. Three candidate causes, one part each:

1. plans: the graph minimax_h3/kernels/fp8_attention.py declares, at the served [1, 56, S, 128], for q/k/v/O laid out BHSD
   (what the model's [3, 1, H, S, D] buffer gives) and BSHD (rows-major, [S, H, D] backed). cuDNN's heuristics
   (modes A, B, FALLBACK) rank the engine configs; every one that builds is timed (median of `--iters`, each call
   synchronised, then `--iters` calls back to back) and its O compared with the first plan's. The first plan is
   what `build_plans()` picks today.
2. sustained: the chosen plan back to back for `--seconds`, the GPU's SM clock / power / temperature sampled by
   `nvidia-smi` meanwhile: ms per call in the first and the last second.
3. interleaved: one DiT block's kernels in order (four fp8 row-wise GEMMs at the block's shapes around the SDPA),
   repeated, with CUDA events around each SDPA only: its ms when it follows GEMMs.

Writes <out>/fp8_plans.json; prints a summary. Needs a Hopper GPU and nvidia-cudnn-frontend.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_h3.kernels.fp8_attention import declare_graph, scale_constants, variant_pack  # noqa: E402
from minimax_h3.kernels.registry import time_ms  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

HEADS, HEAD_DIM = 56, 128
HIDDEN, FFN = 5376, 14336  # DiT block linear shapes (docs/model.md §2)
SHAPES = {"832x480x124": 14882, "1344x768x124": 37748}
PARTS = ("plans", "sustained", "interleaved")


def events_ms(fn, iters: int) -> tuple[float, float]:
    """(median ms of synchronised single calls, mean ms of `iters` back-to-back calls)."""
    single = time_ms(fn, torch.device("cuda"), iters)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return single, a.elapsed_time(b) / iters


def tflops(s: int, ms: float) -> float:
    return 4 * s * s * HEAD_DIM * HEADS / (ms * 1e-3) / 1e12


class Inputs:
    """e4m3 q, k, v, O buffers in one layout, plus the descales, for the plain graph (descale_v = 1)."""

    def __init__(self, s: int, layout: str, device):
        def e4m3():
            x = torch.randn(s, HEADS, HEAD_DIM, device=device) * 40  # [S, H, D] storage
            x = x.to(torch.float8_e4m3fn)
            return x.transpose(0, 1) if layout == "bshd" else x.transpose(0, 1).contiguous()  # [H, S, D] view

        self.q, self.k, self.v = e4m3(), e4m3(), e4m3()
        self.o = torch.empty_like(self.q)
        self.descale = torch.full((1, 1, 1, 1), 1 / 40.0 / math.sqrt(HEAD_DIM) ** 0.5, device=device)
        self.strides = tuple(tuple(x.stride()) for x in (self.q, self.k, self.v, self.o))

    def views(self):
        h, s, d = self.q.shape
        return [torch.as_strided(x, (1, h, s, d), (h * s * d, *x.stride())) for x in (self.q, self.k, self.v, self.o)]


def plans_part(args, device, result):
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    consts = scale_constants(device)
    amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device)
    for shape, s in SHAPES.items():
        for layout in ("bhsd", "bshd"):
            inp = Inputs(s, layout, device)
            graph, tensors = declare_graph(cudnn, handle, HEADS, s, HEAD_DIM, inp.strides)
            graph.build_operation_graph()
            t0 = time.perf_counter()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
            count = graph.get_execution_plan_count()
            try:
                graph.build_plans(cudnn.build_plan_policy.ALL)
            except Exception as e:  # some configs may not build; the loop below says which
                print(f"  build_plans(ALL): {type(e).__name__}: {str(e)[:200]}", flush=True)
            build_s = time.perf_counter() - t0
            q4, k4, v4, o4 = inp.views()
            pack = variant_pack(tensors, q4, k4, v4, o4, inp.descale, inp.descale, consts, amax)
            rows, first = [], None
            for i in range(count):
                row = {"index": i}
                try:
                    row["name"] = graph.get_plan_name_at_index(i)
                    ws = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), dtype=torch.uint8,
                                     device=device)
                    row["single_ms"], row["b2b_ms"] = events_ms(
                        lambda: graph.execute_plan_at_index(pack, ws, i, handle=handle), args.iters)
                    row["tflops_b2b"] = tflops(s, row["b2b_ms"])
                    o = inp.o.float()
                    if first is None:
                        first = o.clone()
                    row["max_abs_vs_plan0"] = (o - first).abs().max().item()
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(f"  {shape} {layout} plan {i}: {row}", flush=True)
            result["plans"][f"{shape}/{layout}"] = {"S": s, "strides": inp.strides, "count": count,
                                                    "build_s": build_s, "plans": rows}
            del graph, inp
            torch.cuda.empty_cache()


def smi_start(path: Path):
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu",
                                 "--format=csv,noheader", "-lms", "100"], stdout=open(path, "w"),
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def cudnn_default(s: int, layout: str, device):
    """The plan stagekit's CudnnFp8Sdpa builds (heuristics' first choice) -> a no-arg callable."""
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    inp = Inputs(s, layout, device)
    graph, tensors = declare_graph(cudnn, handle, HEADS, s, HEAD_DIM, inp.strides)
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    ws = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=device)
    q4, k4, v4, o4 = inp.views()
    pack = variant_pack(tensors, q4, k4, v4, o4, inp.descale, inp.descale, scale_constants(device),
                        torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device))
    return lambda: graph.execute(pack, ws, handle=handle)


def sustained_part(args, device, result, out: Path):
    for shape, s in SHAPES.items():
        fn = cudnn_default(s, "bhsd", device)
        fn()
        torch.cuda.synchronize()
        log = out / f"smi_sustained_{shape}.csv"
        smi = smi_start(log)
        time.sleep(0.5)
        per = []
        t_end = time.perf_counter() + args.seconds
        while time.perf_counter() < t_end:
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
            evs[0].record()
            for i in range(10):
                fn()
                evs[i + 1].record()
            evs[-1].synchronize()
            per += [evs[i].elapsed_time(evs[i + 1]) for i in range(10)]
        time.sleep(0.3)
        if smi:
            smi.terminate()
        n = max(1, len(per) // 10)
        result["sustained"][shape] = {"calls": len(per), "first_tenth_ms": statistics.mean(per[:n]),
                                      "last_tenth_ms": statistics.mean(per[-n:]), "min_ms": min(per),
                                      "smi": log.read_text().splitlines()[::5] if log.exists() else None}
        print(f"  sustained {shape}: {result['sustained'][shape]}", flush=True)


def interleaved_part(args, device, result, out: Path):
    def fp8_gemm(m, k, n):
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for shape, s in SHAPES.items():
        sdpa = cudnn_default(s, "bhsd", device)
        gemms = [fp8_gemm(s, HIDDEN, 3 * HEADS * HEAD_DIM), fp8_gemm(s, HEADS * HEAD_DIM, HIDDEN),
                 fp8_gemm(s, HIDDEN, 2 * FFN), fp8_gemm(s, FFN, HIDDEN)]
        for g in gemms:
            g()
        sdpa()
        torch.cuda.synchronize()
        log = out / f"smi_interleaved_{shape}.csv"
        smi = smi_start(log)
        per = []
        for _ in range(args.blocks):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gemms[0]()
            a.record()
            sdpa()
            b.record()
            for g in gemms[1:]:
                g()
            per.append((a, b))
        torch.cuda.synchronize()
        if smi:
            smi.terminate()
        ms = [a.elapsed_time(b) for a, b in per]
        result["interleaved"][shape] = {"blocks": len(ms), "sdpa_median_ms": statistics.median(ms),
                                        "sdpa_last_half_ms": statistics.mean(ms[len(ms) // 2:]),
                                        "smi": log.read_text().splitlines()[::5] if log.exists() else None}
        print(f"  interleaved {shape}: {result['interleaved'][shape]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=",".join(PARTS), type=comma_choices(PARTS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--blocks", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    import cudnn

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cudnn_backend": cudnn.backend_version(), "frontend": cudnn.__version__,
              "plans": {}, "sustained": {}, "interleaved": {}, "failures": []}
    parts = dict(zip(PARTS, (plans_part, sustained_part, interleaved_part)))
    for name in filter(None, args.parts.split(",")):
        print(f"== {name}", flush=True)
        try:
            fn = parts[name]
            fn(args, device, result) if name == "plans" else fn(args, device, result, out)
        except Exception as e:
            result["failures"].append(f"{name}: {type(e).__name__}: {str(e)[:500]}")
            print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
        (out / "fp8_plans.json").write_text(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
