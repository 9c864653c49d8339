#!/usr/bin/env python
"""Stages working at the same time: N jobs through the render service, pipelined (stage groups that share no device
run at once) against serial (`--no-pipeline`: one stage batch service-wide at a time), measured by the same script.

Starts the encoder, DiT and decoder (`--devices`: one device each, or one for all) and a render service over them,
warms every stage up with one render, times one job alone, then submits `--jobs` jobs at once (`Renderer.Submit`)
and waits for all of them. Reported per mode: wall time (first Submit to the last job's end), throughput, and each
stage's busy share: the stage's own compute seconds over all jobs (`StageRun.timing.compute_s`: the stage's worker
runs one job at a time) over the wall time. `--compare-serial` runs both modes on the same stages (the render service
restarted with `--no-pipeline`) and writes `pipelined_over_serial` (wall time ratio). Each mode has its own prompts
(the encoder's prompt cache would hide its work).

    # CPU, tiny embedded model, three virtual devices (every stage on its own):
    python benchmarks/bench_pipeline.py --compare-serial --json docs/performance_data/pipeline/cpu.json
    # one GPU, all stages resident (full-size random weights, written to --models-dir first if it has none):
    python benchmarks/bench_pipeline.py --devices cuda:0 --residency shared --models-dir /tmp/h3models \\
        --write-weights --width 832 --height 480 --frames 124 --steps 8 --jobs 4 --compare-serial --json $OUT/h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.embedded import EmbeddedStack, StackConfig  # noqa: E402
from client.render_client import render_request  # noqa: E402
from client.stubs import STAGES, open_channel  # noqa: E402
from h3.v1 import render_pb2, render_pb2_grpc  # noqa: E402
from minimax_h3.contract import RenderSpec  # noqa: E402

TERMINAL = (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED)


def run_jobs(target: str, specs: list[RenderSpec], label: str) -> dict:
    """Submit every spec at once, wait for all; wall time, throughput and each stage's busy share."""
    stub = render_pb2_grpc.RendererStub(open_channel(target))
    t0 = time.monotonic()
    ids = [stub.Submit(render_request(s, label=f"{label}{i}"), timeout=60).job_id for i, s in enumerate(specs)]
    ends: dict[str, float] = {}
    infos: dict[str, render_pb2.JobInfo] = {}
    while len(ends) < len(ids):
        for j in ids:
            if j in ends:
                continue
            info = stub.Get(render_pb2.JobRef(job_id=j), timeout=30)
            if info.state in TERMINAL:
                ends[j], infos[j] = time.monotonic(), info
        time.sleep(0.05)
    wall = max(ends.values()) - t0
    failed = [(i.job_id, i.error_code, i.error) for i in infos.values() if i.state != render_pb2.JOB_SUCCEEDED]
    if failed:
        raise SystemExit(f"{label}: jobs failed: {failed}")
    busy: dict[str, float] = {}
    for info in infos.values():
        for r in info.stages:
            busy[r.stage] = busy.get(r.stage, 0.0) + r.timing.compute_s
    share = {s: round(b / wall, 3) for s, b in busy.items()}
    runs = [r for i in infos.values() for r in i.stages]
    return {"jobs": len(ids), "wall_s": round(wall, 2), "jobs_per_min": round(60 * len(ids) / wall, 2),
            "latency_max_s": round(max(ends.values()) - t0, 2),
            "busy_s": {s: round(b, 2) for s, b in busy.items()}, "busy_share": share,
            "min_over_bottleneck_share": round(min(share.values()) / max(share.values()), 3),
            "batches": len({r.batch for r in runs}), "max_waited_batches": max(r.waited_batches for r in runs)}


def measure(stack: EmbeddedStack, stages, render_args: list[str], mode: str, args, spec) -> dict:
    """(Re)start the render service with `render_args`; one warm-up render, one job alone, then `--jobs` at once."""
    stack.stop_stage("render")
    stack.cfg.extra_args["render"] = render_args
    target = stack.start_render(stages)
    run_jobs(target, [spec(f"{mode} warm-up", 0)], f"{mode}-warm")
    one = run_jobs(target, [spec(f"{mode} alone", 0)], f"{mode}-one")
    many = run_jobs(target, [spec(f"{mode} take {i}", i) for i in range(args.jobs)], f"{mode}-")
    out = {"one_job_s": one["wall_s"], **many}
    print(mode, json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--frames", type=int, default=22)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--devices", default="virt0,virt1,virt2",
                    help="one device for all stages, or three: the encoder's, the DiT's, the decoder's")
    ap.add_argument("--residency", default="exclusive", choices=("exclusive", "shared"))
    ap.add_argument("--models-dir", default="", help="real (or full-size random) weights; default: the tiny model")
    ap.add_argument("--write-weights", action="store_true",
                    help="write full-size random weights into --models-dir first where it has none (GPU)")
    ap.add_argument("--weights-only", action="store_true", help="with --write-weights: write them, then exit")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per stage process (CPU)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--compare-serial", action="store_true", help="also run with --no-pipeline; the ratio")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    devices = args.devices.split(",")
    if len(devices) not in (1, len(STAGES)):
        raise SystemExit(f"--devices: one device, or {len(STAGES)} ({', '.join(STAGES)}); got {args.devices!r}")
    if args.write_weights:
        if not args.models_dir:
            raise SystemExit("--write-weights needs --models-dir")
        from benchmarks import bench_two_gpu

        print("weights:", bench_two_gpu.write_weights(Path(args.models_dir), tiny=False), flush=True)
        if args.weights_only:
            return

    def spec(prompt: str, seed: int) -> RenderSpec:
        return RenderSpec(prompt=f"{prompt}: rain on a tin roof, a bell, footsteps", width=args.width,
                          height=args.height, frames=args.frames, steps=args.steps, seed=seed)

    threads = str(args.threads)
    stage_args = {s: ["--devices", devices[i % len(devices)], "--idle-unload-s", "-1"] for i, s in enumerate(STAGES)}
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    stack = EmbeddedStack(StackConfig(run_dir=str(tmp / "run"), residency=args.residency, models_dir=args.models_dir,
                                      env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
                                      extra_args=stage_args))
    stages = stack.start()
    out: dict = {"config": vars(args), "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    try:
        base = ["--max-batch", str(args.max_batch)]
        out["pipelined"] = measure(stack, stages, base, "pipelined", args, spec)
        if args.compare_serial:
            out["serial"] = measure(stack, stages, [*base, "--no-pipeline"], "serial", args, spec)
            out["pipelined_over_serial"] = round(out["pipelined"]["wall_s"] / out["serial"]["wall_s"], 3)
            print("pipelined_over_serial", out["pipelined_over_serial"], flush=True)
    finally:
        stack.stop()
    out["load_average_after"] = os.getloadavg()  # other processes' CPU use: stages overlap only on idle cores
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
