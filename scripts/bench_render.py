#!/usr/bin/env python
"""Time a whole render per stage through real servers (the embedded stack unless endpoints are given).

    python scripts/bench_render.py [--width 832 --height 480 --frames 124 --steps 8] [--repeats 1] [--json out.json]

Reports stack start-up, then per stage: wall, queue, lease wait, load, compute, transfer.
"""

import argparse
import json
import time
from pathlib import Path

from client.embedded import EmbeddedStack, StackConfig
from client.pipeline import render
from client.stubs import StageClients
from stagekit.render_params import RenderSpec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--frames", type=int, default=124)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="/tmp/bench_render.mp4")
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.monotonic()
    stack = EmbeddedStack(StackConfig())
    endpoints = stack.start()
    startup = time.monotonic() - t0
    rows = []
    try:
        with StageClients(endpoints) as c:
            for i in range(args.repeats):
                spec = RenderSpec(prompt=f"a brass band marching through rain, take {i}", width=args.width,
                                  height=args.height, frames=args.frames, steps=args.steps, seed=i)
                r = render(c, spec, Path(args.out))
                rows.append({s.stage: dict(wall=s.wall_s, queue=s.timing.queue_s, lease=s.timing.lease_wait_s,
                                           load=s.timing.load_s, compute=s.timing.compute_s,
                                           transfer=s.timing.transfer_s) for s in r.stages})
                rows[-1]["total"] = r.total_s
    finally:
        stack.stop()
    print(f"stack start-up: {startup:.1f} s   ({args.width}x{args.height}x{args.frames}, {args.steps} steps)")
    print(f"{'run':>3} {'stage':>8} {'wall':>7} {'queue':>6} {'lease':>6} {'load':>6} {'compute':>8} {'xfer':>6}")
    for i, row in enumerate(rows):
        for stage in ("encoder", "dit", "decoder"):
            s = row[stage]
            print(f"{i:>3} {stage:>8} {s['wall']:>7.2f} {s['queue']:>6.2f} {s['lease']:>6.2f} {s['load']:>6.2f} "
                  f"{s['compute']:>8.2f} {s['transfer']:>6.2f}")
        print(f"{i:>3} {'total':>8} {row['total']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"startup_s": startup, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
