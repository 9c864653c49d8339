#!/usr/bin/env python
"""Time a whole render per stage through real servers (the embedded stack).

    .venv/bin/python benchmarks/bench_render.py [--width 832 --height 480 --frames 124 --steps 8] [--repeats 1]
                                             [--hogs N] [--cli] [--json out.json]

Reports stack start-up, then per stage: wall, queue, lease wait, load, compute, transfer. `--cli` also times what a
user sees: the README's first command (`python -m client render --prompt ... -o out.mp4`: stack start, render, stop)
from start to exit. `--hogs N` keeps N CPU hogs running meanwhile (stress-ng if installed, else busy loops): the
"loaded" condition. The load average at the start is printed, so a "quiet" run can be told from a busy one.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from client.embedded import EmbeddedStack, StackConfig
from client.render_client import render_request
from minimax_h3.contract import RenderSpec
from minimax_h3.services import StageClients
from render_svc.engine import render


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--frames", type=int, default=124)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="/tmp/bench_render.mp4")
    ap.add_argument("--hogs", type=int, default=0, help="CPU hogs beside the render (the loaded condition)")
    ap.add_argument("--cli", action="store_true", help="also time the README's render command, start to exit")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f} (1 min) before the run, {args.hogs} hog(s)")
    hogs = start_hogs(args.hogs)
    try:
        result = run(args)
    finally:
        for h in hogs:
            h.terminate()
            h.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def start_hogs(n: int) -> list[subprocess.Popen]:
    if n <= 0:
        return []
    if shutil.which("stress-ng"):
        return [subprocess.Popen(["stress-ng", "--cpu", str(n), "--timeout", "0", "--quiet"])]
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(args) -> dict:
    cli = []
    if args.cli:  # first: a cold start, as the user's first command
        for i in range(args.repeats):
            out = Path(args.out)
            t = time.monotonic()
            subprocess.run([sys.executable, "-m", "client", "render", "--prompt", f"a cat playing the piano, take {i}",
                            "-o", str(out), "--width", str(args.width), "--height", str(args.height),
                            "--frames", str(args.frames), "--steps", str(args.steps), "--seed", str(i),
                            "--endpoints-file", os.devnull], check=True, capture_output=True,
                           cwd=Path(__file__).resolve().parents[1])
            cli.append(time.monotonic() - t)
            print(f"cli {i}: python -m client render, start to exit: {cli[-1]:.1f} s")
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
                r = render(c, render_request(spec), Path(args.out))
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
    return {"startup_s": startup, "runs": rows, "cli_s": cli, "hogs": args.hogs}


if __name__ == "__main__":
    main()
