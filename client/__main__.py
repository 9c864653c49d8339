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

from client.checks import CheckError, check_for_local_stack, output_paths, read_keyframe, read_prompts
from client.endpoints import add_endpoint_args, configured_endpoints, connect_or_start
from client.stubs import SERVICE_NAMES, STAGES, Security, StageClients, health_of
from stagekit.errors import InvalidArgument
from stagekit.models import EMBEDDED_NOTE
from stagekit.render_params import (DEFAULT_FRAMES, DEFAULT_SIZE, DEFAULT_STEPS, MAX_FRAMES, MAX_SIDE, MAX_STEPS,
                                    MIN_FRAMES, MIN_SIDE, MIN_STEPS, SAMPLERS, SCHEDULERS, SIZE_MULTIPLE, RenderSpec,
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


def render_inputs(args):
    """(prompts, output paths, keyframe bytes, LoRAs) from the render flags, or CheckError: everything that can be
    refused without a stage (client/checks.py)."""
    prompts = read_prompts(args.prompt, args.prompts_file)
    try:
        for p in prompts:
            validate(_spec(args, p), need_prompt=True)
    except InvalidArgument as e:
        raise CheckError(e.message) from None
    keyframes = {f"{a}_frame": read_keyframe(getattr(args, f"{a}_frame"), f"--{a}-frame", args.width, args.height)
                 for a in ("first", "last") if getattr(args, f"{a}_frame")}
    if keyframes and len(prompts) != 1:
        raise CheckError("--first-frame/--last-frame take a single --prompt (not --prompts-file)")
    loras = [parse_lora_arg(x) for x in args.lora or ()]
    outs = output_paths(args.output, len(prompts))
    for o in outs:
        o.parent.mkdir(parents=True, exist_ok=True)
    return prompts, outs, keyframes, loras


def cmd_render(args) -> int:
    from client.progress import RenderProgress, print_summary
    from client.pipeline import render, render_many

    try:
        prompts, outs, keyframes, loras = render_inputs(args)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = [_spec(args, p) for p in prompts]
    security = Security(args.token, args.tls_ca)
    try:
        endpoints, stack = connect_or_start(
            args, security, before_start=lambda: check_for_local_stack(prompts, loras, args.models_dir))
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.models_dir and stack is not None:
        print(EMBEDDED_NOTE, file=sys.stderr)
    try:
        with StageClients(endpoints, security) as clients, RenderProgress() as progress:
            if len(specs) == 1:
                results = [render(clients, specs[0], outs[0], progress.update, crf=args.crf, loras=loras,
                                  **keyframes)]
            else:
                results = render_many(clients, list(zip(specs, outs)), progress.update, crf=args.crf, loras=loras)
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
    r.add_argument("--prompts-file", help="one prompt per line; renders all, stage-batched, into the -o folder")
    r.add_argument("-o", "--output", default="out.mp4",
                   help="output MP4 (default: out.mp4); a folder (a trailing / or an existing directory) gets "
                        "000.mp4, 001.mp4, ... in prompt order, as does any -o with several prompts")
    size_rule = f"a multiple of {SIZE_MULTIPLE}, {MIN_SIDE}..{MAX_SIDE}; width x height at most 1920x1088 pixels"
    r.add_argument("--width", type=int, default=DEFAULT_SIZE[0], help=f"{size_rule} (default: {DEFAULT_SIZE[0]})")
    r.add_argument("--height", type=int, default=DEFAULT_SIZE[1], help=f"{size_rule} (default: {DEFAULT_SIZE[1]})")
    r.add_argument("--frames", type=int, default=DEFAULT_FRAMES,
                   help=f"17n+5, {MIN_FRAMES}..{MAX_FRAMES}, at 24 fps (default: {DEFAULT_FRAMES} = 5.2 s)")
    r.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"sampling steps, {MIN_STEPS}..{MAX_STEPS} (default: {DEFAULT_STEPS})")
    r.add_argument("--seed", type=int, default=0, help="0..2^63-1; the same seed renders the same video (default: 0)")
    r.add_argument("--sampler", default="res_multistep", choices=SAMPLERS, help="(default: res_multistep)")
    r.add_argument("--scheduler", default="simple", choices=SCHEDULERS, help="(default: simple)")
    r.add_argument("--video-shift", type=float, default=0.0, help="0 = model default (12)")
    r.add_argument("--audio-shift", type=float, default=0.0, help="0 = model default (3)")
    r.add_argument("--crf", type=int, default=0, help="H.264 quality 1..51, lower is better (default: 0 = 18)")
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
