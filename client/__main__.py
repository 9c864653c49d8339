"""h3-stages command line.

    python -m client render --prompt "..." -o out.mp4 [--width 832 --height 480 --frames 124 --steps 8 ...]
    python -m client render --prompts-file prompts.txt -o outdir/      (stage-batched)
    python -m client status
    python -m client loadtest --stage dit --concurrency 4 --requests 20

Endpoints come from --encoder/--dit/--decoder, env H3_ENCODER/H3_DIT/H3_DECODER,
or the endpoints file `scripts/up.sh` writes (run/endpoints.env). With none
configured and none reachable, `render` starts an embedded local stack.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

from client.endpoints import add_endpoint_args, configured_endpoints, connect_or_start
from client.stubs import SERVICE_NAMES, STAGES, Security, StageClients, health_of
from stagekit.errors import InvalidArgument
from stagekit.models import EMBEDDED_NOTE
from stagekit.render_params import (DEFAULT_FRAMES, DEFAULT_SIZE, DEFAULT_STEPS, SAMPLERS, SCHEDULERS, RenderSpec,
                                    validate)

def _spec(args, prompt: str) -> RenderSpec:
    return RenderSpec(prompt=prompt, width=args.width, height=args.height, frames=args.frames, steps=args.steps,
                      seed=args.seed, sampler=args.sampler, scheduler=args.scheduler,
                      video_shift=args.video_shift, audio_shift=args.audio_shift)


def parse_lora_arg(text: str) -> tuple[str, float]:
    """`name.safetensors:0.8` -> (name, 0.8); without a `:STRENGTH` suffix the strength is 1.0."""
    name, sep, tail = text.rpartition(":")
    if sep:
        try:
            return name, float(tail)
        except ValueError:
            pass
    return text, 1.0


def cmd_render(args) -> int:
    from client.progress import RenderProgress, print_summary
    from client.pipeline import render, render_many

    prompts = [args.prompt] if args.prompt else []
    if args.prompts_file:
        prompts += [p.strip() for p in Path(args.prompts_file).read_text(encoding="utf-8").splitlines() if p.strip()]
    if not prompts:
        raise SystemExit("give --prompt TEXT or --prompts-file FILE")
    keyframes = {}
    for anchor in ("first", "last"):
        path = getattr(args, f"{anchor}_frame")
        if path:
            try:
                keyframes[f"{anchor}_frame"] = Path(path).read_bytes()
            except OSError as e:
                print(f"error: cannot read --{anchor}-frame {path}: {e}", file=sys.stderr)
                return 2
    if keyframes and len(prompts) != 1:
        raise SystemExit("--first-frame/--last-frame take a single --prompt (not --prompts-file)")
    specs = [_spec(args, p) for p in prompts]
    loras = [parse_lora_arg(x) for x in args.lora or ()]
    try:
        for s in specs:
            validate(s, need_prompt=True)
    except InvalidArgument as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    security = Security(args.token, args.tls_ca)
    endpoints, stack = connect_or_start(args, security)
    if not args.models_dir and stack is not None:
        print(EMBEDDED_NOTE, file=sys.stderr)
    try:
        with StageClients(endpoints, security) as clients, RenderProgress() as progress:
            if len(specs) == 1:
                out = Path(args.output)
                results = [render(clients, specs[0], out, progress.update, crf=args.crf, loras=loras, **keyframes)]
            else:
                outdir = Path(args.output)
                outdir.mkdir(parents=True, exist_ok=True)
                jobs = [(s, outdir / f"{i:03d}.mp4") for i, s in enumerate(specs)]
                results = render_many(clients, jobs, progress.update, crf=args.crf, loras=loras)
        rc = 0
        for r in results:
            if isinstance(r, BaseException):
                rc = 1
                msg = r.details() if isinstance(r, grpc.RpcError) else str(r)
                print(f"error: {msg}", file=sys.stderr)
            else:
                print_summary(r)
        return rc
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()


def cmd_status(args) -> int:
    from client.progress import print_status
    from h3.v1 import common_pb2

    endpoints = configured_endpoints(args)
    if endpoints is None:
        print("no endpoints configured (start them with scripts/up.sh, or pass --encoder/--dit/--decoder)")
        return 1
    rows = []
    with StageClients(endpoints, Security(args.token, args.tls_ca)) as c:
        for s in STAGES:
            health = health_of(c.channels[s], SERVICE_NAMES[s])
            st = None
            if health != "UNREACHABLE":
                try:
                    st = c.stub(s).Status(common_pb2.StatusRequest(), timeout=5, metadata=c.security.metadata())
                except grpc.RpcError:
                    pass
            rows.append((s, endpoints.of(s), health, st))
    print_status(rows)
    return 0 if all(r[2] == "SERVING" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client", description="h3-stages client")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="prompt -> MP4 (video + audio)")
    r.add_argument("--prompt", help="what to generate (describe picture and sound)")
    r.add_argument("--prompts-file", help="one prompt per line; renders all, stage-batched, into -o DIR")
    r.add_argument("-o", "--output", default="out.mp4", help="output MP4 (or directory with --prompts-file)")
    r.add_argument("--width", type=int, default=DEFAULT_SIZE[0])
    r.add_argument("--height", type=int, default=DEFAULT_SIZE[1])
    r.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="17n+5 frames at 24 fps (124 = 5.2 s)")
    r.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--sampler", default="res_multistep", choices=SAMPLERS)
    r.add_argument("--scheduler", default="simple", choices=SCHEDULERS)
    r.add_argument("--video-shift", type=float, default=0.0, help="0 = model default (12)")
    r.add_argument("--audio-shift", type=float, default=0.0, help="0 = model default (3)")
    r.add_argument("--crf", type=int, default=0, help="H.264 quality (0 = default 18; lower is better)")
    r.add_argument("--first-frame", help="fl2va: PNG/JPEG the video starts from (fitted to --width x --height)")
    r.add_argument("--last-frame", help="fl2va: PNG/JPEG the video ends on (fitted to --width x --height)")
    r.add_argument("--lora", action="append", metavar="NAME[:STRENGTH]",
                   help="LoRA file name in the DiT server's <models_dir>/loras (repeatable; strength default 1.0)")
    r.add_argument("--models-dir", default=os.environ.get("H3_MODELS_DIR", ""),
                   help="real checkpoints for the embedded stack (default: tiny embedded model)")
    r.add_argument("--devices", default="", help="devices for the embedded stack (e.g. cuda:0)")
    add_endpoint_args(r)
    r.set_defaults(fn=cmd_render)
    s = sub.add_parser("status", help="health, residency, devices, kernels of each stage")
    add_endpoint_args(s)
    s.set_defaults(fn=cmd_status)
    try:
        from client.loadtest import add_parser as add_loadtest
    except ImportError:
        add_loadtest = None
    if add_loadtest is not None:
        add_loadtest(sub, add_endpoint_args)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
