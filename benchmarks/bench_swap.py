#!/usr/bin/env python
"""Swap cost per stage, and how many swaps stage batching saves, on the embedded stack (exclusive residency).

Starts the three stage servers on one (virtual or real) device, then:
1. swap cost: per stage, `--repeats` x (Unload + Load) through the lifecycle RPCs (the servers' own timings);
2. swaps for `--jobs` queued jobs, counted as lease `acquire` events in the host-wide event log:
   - interleaved: one client renders the jobs one after another (encode, sample, decode, next job);
   - batched: `render_svc.engine.render_jobs` (encode all, sample all, decode all);
   - concurrent: `--jobs` clients submit whole renders at once; the stages batch what is queued
     (`--max-batch-before-yield` bounds a batch while another stage waits).

    python benchmarks/bench_swap.py                      # CPU, tiny embedded models, virtual device virt0
    python benchmarks/bench_swap.py --devices cuda:0     # one real GPU
    python benchmarks/bench_swap.py --calibrate cuda:0   # DiT memory estimate vs measured peak (no servers)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minimax_h3.contract import TEXT_STATES, RenderSpec


def swap_cost(clients, repeats: int) -> dict[str, dict[str, float]]:
    from h3.v1 import common_pb2
    from minimax_h3.services import STAGES

    out = {}
    for stage in STAGES:
        stub = clients.stub(stage)
        loads, unloads = [], []
        stub.Load(common_pb2.LoadRequest())
        for _ in range(repeats):
            unloads.append(stub.Unload(common_pb2.UnloadRequest()).seconds)
            loads.append(stub.Load(common_pb2.LoadRequest()).seconds)
        stub.Unload(common_pb2.UnloadRequest())
        out[stage] = {"load_s": statistics.median(loads), "unload_s": statistics.median(unloads),
                      "swap_s": statistics.median(loads) + statistics.median(unloads),
                      "resident_mib": 0.0}
        stub.Load(common_pb2.LoadRequest())
        out[stage]["resident_mib"] = stub.Status(common_pb2.StatusRequest()).memory_bytes / 2**20
        stub.Unload(common_pb2.UnloadRequest())
    return out


# A mid-size H3-shaped DiT (release head size and rope ratio, fewer/narrower layers): big enough that activations
# dominate the way they do at full size, small enough to write and load in seconds.
CALIBRATION_DIT = dict(num_heads=12, head_dim=128, hidden=1536, num_layers=4, num_refiner_layers=1, ffn=4096,
                       text_dim=1024, freq_dim=256, time_embed_hidden=1536, time_embed_dim=768, rope_freq_dim=16)
CALIBRATION_SIZES = ["256x256x22", "832x480x124", "1344x768x124", "1920x1088x124"]


def calibrate(device: str, sizes: list[str], text_len: int, chunk_rows: int) -> list[dict]:
    """DiTEngine.estimate_bytes vs the measured peak of one sampling step (weights included), per size."""
    import torch

    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_tiny_checkpoint
    from stagekit.checkpoints import WeightSource
    from stagekit.dist import RankGroup, RankInfo
    from stagekit.runtime import JobContext

    tmp = Path(tempfile.mkdtemp(prefix="calib-"))
    ckpt = write_tiny_checkpoint(DiTConfig.tiny(**CALIBRATION_DIT), tmp / "minimax_h3_calib_bf16.safetensors", "bf16")
    group = RankGroup(RankInfo(0, 1, 0), "gloo", 60)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    eng = DiTEngine(DiTEngineConfig(str(ckpt), "", tmp, device, dtype, chunk_rows=chunk_rows), group)
    eng.load(WeightSource(eng.weight_files()))
    cuda = device.startswith("cuda")
    out = []
    for size in sizes:
        w, h, f = (int(x) for x in size.split("x"))
        spec = RenderSpec(width=w, height=h, frames=f, steps=1, seed=0)
        text = torch.randn(text_len, eng.model_cfg.text_dim)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.monotonic()
        eng.run(spec, {TEXT_STATES: text}, JobContext(group, None, "dit"))
        secs = time.monotonic() - t0
        row = {"size": size, "weights_mib": eng.weight_bytes() / 2**20, "resident_mib": eng.resident_bytes() / 2**20,
               "estimate_mib": eng.estimate_bytes(spec, text_len) / 2**20, "step_s": secs}
        if cuda:
            torch.cuda.synchronize()
            row["measured_peak_mib"] = (torch.cuda.max_memory_allocated() - base + eng.resident_bytes()) / 2**20
            row["estimate_over_measured"] = row["estimate_mib"] / row["measured_peak_mib"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="virt0")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="256x256x22", help="WxHxFRAMES of each job")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--max-batch-before-yield", type=int, default=8)
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--json", default="", help="also write the numbers here")
    ap.add_argument("--calibrate", default="", metavar="DEVICE",
                    help="only compare the DiT memory estimate with the measured peak on DEVICE (e.g. cuda:0)")
    ap.add_argument("--calibrate-sizes", nargs="+", default=CALIBRATION_SIZES)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--chunk-rows", type=int, default=4096)
    args = ap.parse_args()
    if args.calibrate:
        rows = calibrate(args.calibrate, args.calibrate_sizes, args.text_len, args.chunk_rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    # Imported here so --calibrate needs only torch (+ safetensors) on a bare GPU machine.
    from client.embedded import EmbeddedStack, StackConfig
    from client.render_client import render_request
    from minimax_h3.services import STAGES, StageClients
    from render_svc.engine import Outcome, render, render_jobs
    from stagekit.lease import events_per_stage, read_events

    w, h, f = (int(x) for x in args.size.split("x"))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    stage_args = ["--idle-unload-s", "-1", "--max-batch-before-yield", str(args.max_batch_before_yield)]
    stack = EmbeddedStack(StackConfig(run_dir=str(run_dir), devices=args.devices, cache_dir=args.cache_dir,
                                      env={"OMP_NUM_THREADS": "2"}, extra_args={s: stage_args for s in STAGES}))
    endpoints = stack.start()
    results: dict = {"devices": args.devices, "jobs": args.jobs, "size": args.size, "steps": args.steps,
                     "max_batch_before_yield": args.max_batch_before_yield}
    try:
        with StageClients(endpoints) as clients:
            results["swap_cost"] = swap_cost(clients, args.repeats)

            def specs(tag):
                return [(render_request(RenderSpec(prompt=f"{tag} job {i}: a fox in the snow", width=w, height=h,
                                                   frames=f, steps=args.steps, seed=i)), run_dir / f"{tag}{i}.mp4")
                        for i in range(args.jobs)]

            scenarios = {}
            t0 = time.time()
            for req, out in specs("interleaved"):
                render(clients, req, out)
            scenarios["interleaved"] = (t0, time.time())

            t0 = time.time()
            bad = [r for r in render_jobs(clients, specs("batched")) if isinstance(r, Outcome)]
            if bad:
                raise RuntimeError(f"render failed: {bad[0].code}: {bad[0].message}")
            scenarios["batched"] = (t0, time.time())

            t0 = time.time()
            with ThreadPoolExecutor(args.jobs) as pool:
                for fut in [pool.submit(render, clients, s, o) for s, o in specs("concurrent")]:
                    fut.result()
            scenarios["concurrent"] = (t0, time.time())
        time.sleep(0.2)
        events = read_events(stack.lease_dir)
        results["scenarios"] = {}
        for name, (a, b) in scenarios.items():
            acq = events_per_stage(events, a, b)
            results["scenarios"][name] = {"acquires": acq, "swaps": sum(acq.values()), "wall_s": b - a,
                                          "yields": sum(events_per_stage(events, a, b, "yield").values())}
    finally:
        stack.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print("\nstage     load s  unload s  swap s  resident MiB")
    for stage, c in results["swap_cost"].items():
        print(f"{stage:9} {c['load_s']:6.3f}  {c['unload_s']:8.3f}  {c['swap_s']:6.3f}  {c['resident_mib']:8.1f}")
    print(f"\n{args.jobs} jobs       swaps (lease acquires)  wall s")
    for name, r in results["scenarios"].items():
        print(f"{name:12} {r['swaps']:4d} {json.dumps(r['acquires']):40} {r['wall_s']:6.1f}")


if __name__ == "__main__":
    main()
