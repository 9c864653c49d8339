#!/usr/bin/env python
"""DiT tensor-parallel scaling through the service's own engine: load speed, s/step, all-reduce share, peak memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --weights dit.safetensors --out tp2.json
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_tp.py --weights dit.safetensors --out tp1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --weights dit.safetensors --sp-degree 2 --out sp2.json
    python benchmarks/bench_tp.py --tiny --out tp.json          # CPU dry run (embedded tiny model, gloo)

Every rank builds `dit_svc.engine.DiTEngine` exactly as the DiT service does (the real checkpoint loader reading
only this rank's slices, the kernel registry, the Megatron TP model), so the numbers are the service's minus gRPC:
1. load: seconds and GB/s of this rank's shard from the page cache (the file was just written or read), a reload
   after an unload (the swap a render pays), and the rank's resident weight bytes;
2. per shape: median s/step over `--iters` forwards after one warm-up (one step = one DiT evaluation), peak
   allocated / reserved GiB on the rank, and from torch.profiler over one step the NCCL kernel time (the
   all-reduces of attention and MLP, the AdaLN all-gathers) as a share of the step;
3. rank 0 writes the JSON (`--out`), with every rank's numbers and the SHA-256 of every rank's output, which
   must agree (ranks bitwise identical); after each shape it writes its own numbers so far ("partial": true).
   A shape that fails (out of memory, a kernel error) is recorded with its error and the next shape still runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_svc.engine import DiTEngine, DiTEngineConfig  # noqa: E402
from minimax_h3.dit.layout import build_layout  # noqa: E402
from minimax_h3.kernels.registry import AUTO, default_attention_candidates, default_linear_candidates  # noqa: E402
from stagekit.checkpoints import WeightSource  # noqa: E402
from stagekit.dist import RankGroup, rank_info_from_env  # noqa: E402

GIB = 2**30
T_VIDEO, T_AUDIO = 0.4, 0.55  # any mid-schedule noise levels
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def nccl_share(model, args_fn, device: str) -> dict:
    """One step under torch.profiler: NCCL kernel time and total GPU kernel time (ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(*args_fn())
        sync(device)
    nccl = total = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        t = getattr(ev, "self_cuda_time_total", 0.0) if t is None else t
        total += t
        if "nccl" in ev.key.lower():
            nccl += t
    return {"nccl_ms": nccl / 1000, "gpu_kernels_ms": total / 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="", help="DiT checkpoint ('' with --tiny: the embedded model)")
    ap.add_argument("--shapes", default="832x480x124,1344x768x124", help="WxHxF list")
    ap.add_argument("--linear-kernel", default="auto", choices=(AUTO, *default_linear_candidates()))
    ap.add_argument("--attention-kernel", default="auto", choices=(AUTO, *default_attention_candidates()))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--chunk-rows", type=int, default=4096)
    ap.add_argument("--sp-degree", type=int, default=1, help="sequence-parallel degree (TP = ranks / this)")
    ap.add_argument("--compile-blocks", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--text-len", type=int, default=38)
    ap.add_argument("--profile", action="store_true", help="also profile one step for the NCCL share")
    ap.add_argument("--no-reload", action="store_true", help="skip the unload + reload timing (saves a load)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with the embedded tiny model")
    ap.add_argument("--out", default="", help="JSON file (rank 0)")
    args = ap.parse_args()

    info = rank_info_from_env()
    device = "cpu" if args.tiny else f"cuda:{info.local_rank}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    group = RankGroup(info, "gloo" if args.tiny else "nccl", 120.0)
    cfg = DiTEngineConfig(weights=args.weights, models_dir="", cache_dir=Path(tempfile.gettempdir()) / "h3-bench-tp",
                          device=device, compute_dtype=DTYPES[args.dtype], linear_kernel=args.linear_kernel,
                          attention_kernel=args.attention_kernel, chunk_rows=args.chunk_rows,
                          sp_degree=args.sp_degree, compile_blocks=args.compile_blocks)
    engine = DiTEngine(cfg, group)
    res: dict = {"rank": info.rank, "tp": engine.parallel.tp_size, "sp": engine.parallel.sp_size, "device": device,
                 "kernels": engine.kernel_rows(), "compile_blocks": args.compile_blocks,
                 "dtype": args.dtype, "chunk_rows": args.chunk_rows, "shapes": {}}

    # 1. load, unload, reload
    for phase in ("load_s",) if args.no_reload else ("load_s", "reload_s"):
        if phase == "reload_s":
            t0 = time.monotonic()
            engine.unload()
            res["unload_s"] = time.monotonic() - t0
        if group.compute is not None:
            dist.barrier(group=group.compute)
        t0 = time.monotonic()
        engine.load(WeightSource(engine.weight_files()))
        sync(device)
        res[phase] = time.monotonic() - t0
    res["resident_gib"] = engine.resident_bytes() / GIB
    res["load_gb_per_s"] = engine.resident_bytes() / 1e9 / res.get("reload_s", res["load_s"])

    model, mcfg = engine.model, engine.model_cfg
    for key in args.shapes.split(","):
        w, h, f = (int(v) for v in key.lower().split("x"))
        if args.tiny:
            w, h, f = 256, 256, 22
        lay = build_layout(mcfg, args.text_len, f, h, w).to(device)
        g = torch.Generator(device=device).manual_seed(1)
        video = torch.randn(lay.num_video_rows, mcfg.video_patch_dim, generator=g, device=device)
        audio = torch.randn(lay.num_audio_rows, mcfg.audio_in_channels, generator=g, device=device)
        text = torch.randn(lay.text_len, mcfg.text_dim, generator=g, device=device).to(cfg.compute_dtype)
        inputs = lambda: (video, audio, text, T_VIDEO, T_AUDIO, lay)  # noqa: E731
        row: dict = {"S": lay.seq_len}
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            try:
                model(*inputs())  # warm-up (kernel autotuning, cuDNN plans)
                sync(device)
                times = []
                for _ in range(args.iters):
                    if group.compute is not None:
                        dist.barrier(group=group.compute)
                    t0 = time.perf_counter()
                    v, a = model(*inputs())
                    sync(device)
                    times.append(time.perf_counter() - t0)
                row["s_per_step"] = statistics.median(times)
                row["sha256"] = hashlib.sha256(v.float().cpu().numpy().tobytes() + a.float().cpu().numpy().tobytes()
                                               ).hexdigest()[:16]
                row["finite"] = bool(torch.isfinite(v).all() and torch.isfinite(a).all())
                if device.startswith("cuda"):
                    row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
                    row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
                    if args.profile:
                        row.update(nccl_share(model, inputs, device))
                        row["nccl_share"] = row["nccl_ms"] / 1000 / row["s_per_step"]
            except Exception as e:  # recorded; the next shape still runs
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                v = a = None
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
        res["shapes"][key] = row
        print(f"rank {info.rank}: {key} {json.dumps(row)}", flush=True)
        if info.is_leader and args.out:  # rank 0's numbers so far, should a later shape not finish
            Path(args.out).write_text(json.dumps({"partial": True, "tp": res["tp"], "sp": res["sp"], "ranks": [res]},
                                                 indent=1))

    ranks = group.gather_objects(res)
    if info.is_leader:
        out = {"tp": engine.parallel.tp_size, "sp": engine.parallel.sp_size, "ranks": ranks}
        for key in res["shapes"]:
            hashes = {r["shapes"][key].get("sha256") for r in ranks}
            out.setdefault("ranks_bitwise_equal", {})[key] = len(hashes) == 1
        print(json.dumps(out, indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
