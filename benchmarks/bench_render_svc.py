#!/usr/bin/env python
"""Stage batching across clients through the render service: weight swaps, wall time and job latency.

Starts the embedded stack (encoder, DiT, decoder, render service; exclusive residency on one virtual or real device),
then renders the same set of jobs two ways through the one-call API (`Renderer.Render`, thin client threads):
- one at a time: one client renders the jobs back to back (every stage batch holds one job);
- concurrent: `--clients` clients each render `--jobs-per-client` jobs at once (like `render --prompts-file`); the
  service batches the queued jobs of all clients by stage (`--max-batch`, fairness bound `--max-wait-batches`).
Each mode has its own prompts (the encoder's prompt cache would hide its swaps). Swaps are lease acquisitions in the
stages' host-wide event log. The fl2va part (decoder unloaded first) compares the bytes the decoder loads for the
keyframes (the VAE encoder alone) with its decode residency.

    python benchmarks/bench_render_svc.py                          # CPU, tiny embedded models, virtual device virt0
    python benchmarks/bench_render_svc.py --devices cuda:0 --models-dir ~/models --size 832x480x124 --steps 8
    python benchmarks/bench_render_svc.py --json docs/performance_data/render_svc_batching_cpu.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.embedded import EmbeddedStack, StackConfig  # noqa: E402
from client.render_client import RenderClient, render_request  # noqa: E402
from minimax_h3.contract import RenderSpec  # noqa: E402
from stagekit.lease import events_per_stage, read_events  # noqa: E402


def run_jobs(target: str, specs: list[RenderSpec], concurrent: bool, out_dir: Path) -> tuple[float, list[float], list]:
    """Render `specs` one after another, or all at once (each on its own Render call)."""

    def one(i: int):
        with RenderClient(target) as rc:
            t = time.monotonic()
            info = rc.render(render_request(specs[i], label=f"bench{i}"), out_dir / f"{i:03d}.mp4")
            return time.monotonic() - t, info

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(specs) if concurrent else 1) as pool:
        results = list(pool.map(one, range(len(specs))))
    return time.monotonic() - t0, [r[0] for r in results], [r[1] for r in results]


def summary(wall: float, lat: list[float], infos: list, swaps: dict[str, int], jobs: int) -> dict:
    runs = [r for i in infos for r in i.stages]
    return {"jobs": jobs, "wall_s": round(wall, 2), "latency_p50_s": round(statistics.median(lat), 2),
            "latency_max_s": round(max(lat), 2), "swaps": swaps, "swaps_total": sum(swaps.values()),
            "job_stages": jobs * 3, "batches": len({r.batch for r in runs}),
            "mean_batch_size": round(statistics.mean(r.batch_size for r in runs), 2),
            "max_waited_batches": max(r.waited_batches for r in runs)}


def fl2va_bytes(target: str, decoder: str, lease_dir: Path, spec: RenderSpec, out: Path) -> dict:
    import numpy as np
    from PIL import Image

    from h3.v1 import common_pb2, decoder_pb2_grpc
    from stagekit.channels import open_channel

    decoder_pb2_grpc.DecoderStub(open_channel(decoder)).Unload(common_pb2.UnloadRequest(), timeout=120)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (spec.height, spec.width, 3), dtype=np.uint8)).save(
        buf, "PNG")
    t0 = time.time()
    with RenderClient(target) as rc:
        rc.render(render_request(spec, first_frame=buf.getvalue()), out)
    loaded = [e["bytes"] for e in read_events(lease_dir)
              if e["event"] == "loaded" and e["holder"].startswith("decoder@") and e["t"] >= t0]
    return {"decoder_residencies_bytes": loaded, "keyframes_residency_bytes": loaded[0],
            "decode_residency_bytes": loaded[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--jobs-per-client", type=int, default=3)
    ap.add_argument("--size", default="256x256x22", help="WxHxF")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--devices", default="virt0")
    ap.add_argument("--models-dir", default="")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-batches", type=int, default=4)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    w, h, f = (int(x) for x in args.size.split("x"))
    jobs = args.clients * args.jobs_per_client

    def specs(mode: str) -> list[RenderSpec]:
        return [RenderSpec(prompt=f"{mode} take {i}: rain, a bell, footsteps", width=w, height=h, frames=f,
                           steps=args.steps, seed=i) for i in range(jobs)]

    tmp = Path(tempfile.mkdtemp(prefix="bench-render-svc-"))
    stack = EmbeddedStack(StackConfig(run_dir=str(tmp / "run"), devices=args.devices, models_dir=args.models_dir,
                                      with_render=True, env={"OMP_NUM_THREADS": "1"},
                                      extra_args={"render": ["--max-batch", str(args.max_batch),
                                                             "--max-wait-batches", str(args.max_wait_batches)]}))
    ep = stack.start()
    try:
        with RenderClient(ep.render) as rc:  # warm-up: first loads, embedded files written
            rc.render(render_request(specs("warm-up")[0]), tmp / "warm.mp4")
        out = {"config": vars(args)}
        for name in ("one_at_a_time", "concurrent"):
            t0 = time.time()
            wall, lat, infos = run_jobs(ep.render, specs(name), name == "concurrent", tmp / name)
            out[name] = summary(wall, lat, infos, events_per_stage(read_events(stack.lease_dir), t0, time.time()), jobs)
            print(name, json.dumps(out[name]), flush=True)
        out["fl2va"] = fl2va_bytes(ep.render, ep.decoder, stack.lease_dir, specs("fl2va")[0], tmp / "fl2va.mp4")
        print("fl2va", json.dumps(out["fl2va"]))
    finally:
        stack.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
