"""h3-stages command line.

    python -m client render --prompt "..." -o out.mp4 [--width 832 --height 480 --frames 124 --steps 8 ...]
    python -m client render --prompts-file prompts.txt -o outdir/      (stage-batched by the render service)
    python -m client render --workflow graph.json [--set NODE.WIDGET=VALUE ...] -o out.mp4   (a ComfyUI graph)
    python -m client render --prompt "..." --prompt "..." --seconds 60 -o long.mp4   (sampled in windows)
    python -m client extend JOB_ID --seconds 10 --prompt "..." -o longer.mp4
    python -m client jobs list | get ID | watch ID | fetch ID [--wait] -o out.mp4 | cancel ID
    python -m client status
    python -m client loadtest --stage dit --concurrency 4 --requests 20
    python -m client models fetch --to DIR | models check DIR
    python -m client doctor

`render` and `jobs` talk to the render service only (thin: this process never imports torch or numpy). It is found
from --render, env H3_RENDER or the endpoints file `scripts/up.sh` writes (run/endpoints.env). With none configured,
`render` starts one: over the configured stages (--encoder/--dit/--decoder, env H3_ENCODER/H3_DIT/H3_DECODER or the
endpoints file), else, with nothing configured at all, in an embedded local stack. Anything configured that does not
answer is an error (exit 1), never a silent fall-back to the tiny model; a local-stack flag (--models-dir, --devices)
that a configured stack does not serve is refused (exit 2), naming what it serves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from client.checks import (CheckError, add_set_flag, check_for_local_stack, check_running_stack, output_paths,
                           read_guides, read_keyframe, read_prompts, read_references, refuse_existing, window_prompts)
from client.command import self_command
from client.embedded import CtrlC, StackStartError
from client.endpoints import (DEFAULT_ENDPOINTS_FILE, EndpointError, add_endpoint_args, check_render_reachable,
                              configured_endpoints, configured_render, connect_render)
from client.render_client import state_name
from client.words import job_error_words, rpc_words
from h3.v1 import render_pb2
from minimax_h3.contract import (DEFAULT_CRF, DEFAULT_FRAMES, DEFAULT_SIZE, DEFAULT_STEPS, FPS, IMAGE_CRF,
                                 IMAGE_FRAMES, MAX_AREA, MAX_ASPECT, MAX_ASPECT_CHANGE, MAX_CRF, MAX_FRAMES,
                                 MAX_OUTPUT_SIDE, MAX_SIDE, MAX_STEPS, MAX_WINDOW_FRAMES, MIN_FRAMES, MIN_SIDE,
                                 MIN_STEPS, PNG, QUALITIES, REF_IMAGE_SIZES, SAMPLERS, SCHEDULERS, SINGLE,
                                 SIZE_MULTIPLE, WINDOW_FUSES, WINDOW_MODES, RenderSpec, check_output, plan_windows,
                                 snap_frames, spec_from_proto, validate)
from minimax_h3.files import EMBEDDED_NOTE
from minimax_h3.services import SERVICE_NAMES, STAGES, Endpoints, StageClients
from stagekit.channels import Security, health_of, replicas_of
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.transport import MAX_MESSAGE_BYTES

# A RenderRequest (keyframes included) is one gRPC message; reference files are uploaded before it, in chunks.
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES - (64 << 10)


def _frames(args) -> int:
    """--frames, or --seconds as the smallest valid frame count lasting at least that long."""
    if args.seconds is None:
        return args.frames if args.frames is not None else DEFAULT_FRAMES
    if args.frames is not None:
        raise CheckError("give --frames or --seconds, not both")
    if not 0 < args.seconds <= MAX_FRAMES / FPS:
        raise CheckError(f"--seconds {args.seconds:g}: give a length from 0 to {MAX_FRAMES / FPS:.1f} s")
    return snap_frames(math.ceil(args.seconds * FPS - 1e-9))


def _spec(args, prompt: str, more: tuple[tuple[str, ...], tuple[float, ...]] = ((), ())) -> RenderSpec:
    return RenderSpec(prompt=prompt, width=args.width, height=args.height, frames=_frames(args), steps=args.steps,
                      seed=args.seed, sampler=args.sampler, scheduler=args.scheduler,
                      video_shift=args.video_shift, audio_shift=args.audio_shift, quality=args.quality,
                      ref_image_size=args.ref_image_size,
                      window_frames=args.window_frames, window_overlap=args.window_overlap,
                      window_mode=args.window_mode, window_fuse=args.window_fuse, more_prompts=more[0],
                      prompt_starts=more[1])


def parse_lora_arg(text: str) -> tuple[str, float]:
    """`name.safetensors:0.8` -> (name, 0.8); without a `:STRENGTH` suffix the strength is 1.0."""
    name, sep, tail = text.rpartition(":")
    if sep:
        try:
            return name, float(tail)
        except ValueError:
            pass
    return text, 1.0


def parse_size(text: str) -> tuple[int, int]:
    """'1920x1080' -> (1920, 1080). A zero side is refused: on the wire 0x0 means "no upscale", so a given 0x0 would
    be dropped without a word."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"--upscale {text!r}: give WIDTHxHEIGHT, e.g. 1920x1080")
    if int(w) == 0 or int(h) == 0:
        raise ValueError(f"--upscale {text}: the MP4's width and height must both be above 0, e.g. 1920x1080 "
                         "(leave --upscale out to keep the render's size)")
    return int(w), int(h)


def _render_requests(args, prompts: list[str], keyframes: dict[str, bytes], more):
    from client.render_client import render_request

    loras = [parse_lora_arg(x) for x in args.lora or ()]
    upscale = parse_size(args.upscale) if args.upscale is not None else (0, 0)
    reqs = []
    for i, p in enumerate(prompts):
        spec = _spec(args, p, more)  # valid: render_inputs validated it
        check_output(spec, args.crf, *upscale)  # the render service's and the decoder's own rule
        key = f"{args.idempotency_key}-{i}" if args.idempotency_key and len(prompts) > 1 else args.idempotency_key
        reqs.append(render_request(spec, crf=args.crf, loras=loras, upscale=upscale, idempotency_key=key or "",
                                   label=args.label, **keyframes))
    uploaded = [*reqs[0].references, *(getattr(g, p) for g in reqs[0].guides for p in ("image", "audio")
                                       if g.HasField(p))] if reqs else []
    size = reqs[0].ByteSize() - sum(len(r.data) for r in uploaded) if reqs else 0
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"the keyframe files are {size} bytes together; one request carries at most "
                         f"{MAX_REQUEST_BYTES} bytes: send smaller files")
    return reqs


# The flags' defaults, applied where no flag is given (a --workflow graph keeps its own values there). --frames is not
# among them: _frames() reads --frames or --seconds.
RENDER_DEFAULTS = {"width": DEFAULT_SIZE[0], "height": DEFAULT_SIZE[1], "steps": DEFAULT_STEPS, "seed": 0,
                   "sampler": SAMPLERS[0], "scheduler": SCHEDULERS[0], "video_shift": 0.0, "audio_shift": 0.0,
                   "quality": QUALITIES[0], "ref_image_size": "", "crf": DEFAULT_CRF}


def render_inputs(args):
    """(requests, output paths) from the render flags, or CheckError: everything that can be refused
    without a stage (client/checks.py). A --workflow graph gives the values no flag sets (workflow_inputs)."""
    given = [flag for flag, v in (("--set", args.set), ("--input-dir", args.input_dir), ("--explain", args.explain))
             if v]
    if given:
        raise CheckError(f"{', '.join(given)} read a graph: give it with --workflow FILE.json")
    crf_given = args.crf is not None
    for name, default in RENDER_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    given = args.prompt or []
    if len(given) > 1 and args.prompts_file:
        raise CheckError("--prompt given more than once makes one long render (a prompt per part); --prompts-file "
                         "makes one render per line: use one or the other")
    more = window_prompts(given, args.timed_prompt or [])
    prompts = read_prompts(given[0] if given else None, args.prompts_file)
    if any(more) and len(prompts) != 1:
        raise CheckError("--timed-prompt adds to a single --prompt (not --prompts-file)")
    try:
        for p in prompts:
            validate(_spec(args, p, more), need_prompt=True)
    except InvalidArgument as e:
        raise CheckError(e.message) from None
    keyframes = {f"{a}_frame": read_keyframe(getattr(args, f"{a}_frame"), f"--{a}-frame", args.width, args.height)
                 for a in ("first", "last") if getattr(args, f"{a}_frame")}
    if keyframes and len(prompts) != 1:
        raise CheckError("--first-frame/--last-frame take a single --prompt (not --prompts-file)")
    if args.ref:
        if keyframes:
            raise CheckError("--ref does not combine with --first-frame/--last-frame: the model's reference "
                             "partition (ref2va) takes references only; give the frame as --ref image.png and say "
                             "in the prompt how the video uses <Picture 1>")
        keyframes = {"references": read_references(args.ref, prompts, _frames(args))}
    if args.guide:
        keyframes["guides"] = read_guides(args.guide, _frames(args), args.width, args.height)
    windows = plan_windows(_spec(args, prompts[0], more))
    if keyframes and windows.mode != SINGLE:
        raise CheckError(f"--first-frame/--last-frame/--ref/--guide condition one window, and this render is sampled "
                         f"in windows ({windows.describe()}): render at most {MAX_WINDOW_FRAMES} frames with them")
    image = _frames(args) == IMAGE_FRAMES
    if image and keyframes:
        raise CheckError("--frames 1 renders an image from the prompt alone: --first-frame/--last-frame/--ref/--guide "
                         "condition a video")
    if image and not crf_given:
        args.crf = IMAGE_CRF  # the picture is taken from an MP4 written at the least lossy quality
    try:
        reqs = _render_requests(args, prompts, keyframes, more)
    except ValueError as e:  # InvalidArgument included
        raise CheckError(getattr(e, "message", None) or str(e)) from None
    if image:
        for req in reqs:
            req.output_format = PNG
    if args.detach:  # the output stays with the render service until `jobs fetch`: no file here to name or check
        if args.output is not None:
            raise CheckError("-o: --detach writes no file here (the output stays with the render service): leave "
                             "out -o and fetch it with `jobs fetch ID -o FILE`")
        return reqs, []
    return reqs, _outputs(args, image, len(reqs), "--frames 1 renders an image: name a .png" if image else
                          "this render is a video: name an .mp4 (--frames 1 renders an image)")


def workflow_inputs(args):
    """([the request], [its output path], what the graph became) of a --workflow graph: the graph's values, the
    flags over them, the files its loader nodes read from --input-dir (default: the graph's folder), everything
    checked as the render service will (minimax_h3/comfy/workflow.py); CheckError naming each node the product does
    not run."""
    from client.checks import check_request_files
    from minimax_h3.comfy.workflow import apply_workflow, folder_reader
    from minimax_h3.labels import EXTENSIONS, kind_of

    if args.prompts_file:
        raise CheckError("--prompts-file does not combine with --workflow: a graph is one render (--prompt replaces "
                         "its prompt)")
    path = Path(args.workflow)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckError(f"cannot read --workflow {path}: {getattr(e, 'strerror', None) or e}") from None
    req = render_pb2.RenderRequest(workflow_json=text, workflow_set=args.set or [], crf=args.crf or 0,
                                   label=args.label, idempotency_key=args.idempotency_key)
    p = req.params
    if args.timed_prompt or len(args.prompt or ()) > 1:
        raise CheckError("--workflow renders the graph's one prompt: give at most one --prompt (and no "
                         "--timed-prompt) to replace it")
    if args.guide:
        raise CheckError("--guide does not combine with --workflow: the graph's MiniMaxH3AddGuide nodes place its "
                         "guides (change one with --set NODE.frame_idx=N, or its LoadImage's file with --set)")
    if args.prompt:
        p.prompt = args.prompt[0]
    for name in RENDER_DEFAULTS:
        value = getattr(args, name)
        if name != "crf" and value is not None:
            setattr(p, name, value)
    if args.frames is not None or args.seconds is not None:
        p.frames = _frames(args)
    for text_ in args.lora or ():
        name, strength = parse_lora_arg(text_)
        req.loras.add(name=name, strength=strength)
    try:
        if args.upscale is not None:
            req.upscale_width, req.upscale_height = parse_size(args.upscale)
        for anchor in ("first", "last"):
            if getattr(args, f"{anchor}_frame"):
                setattr(req, f"{anchor}_frame", _read_flag_file(getattr(args, f"{anchor}_frame"), f"--{anchor}-frame"))
        for spec in args.ref or ():
            kind, sep, ref_path = spec.partition(":")
            if not sep or kind not in EXTENSIONS:
                kind, ref_path = kind_of(spec), spec
            req.references.add(kind=kind, data=_read_flag_file(ref_path, f"--ref {spec}"), name=Path(ref_path).name)
        render = apply_workflow(req, folder_reader(Path(args.input_dir) if args.input_dir else path.parent))
        render.notes.extend(check_request_files(req))
        check_output(spec_from_proto(p), req.crf, req.upscale_width, req.upscale_height)
    except ValueError as e:  # InvalidArgument (a refused graph, a wrong value) included
        raise CheckError(getattr(e, "message", None) or str(e)) from None
    if args.detach or args.explain:
        if args.output is not None and args.detach:
            raise CheckError("-o: --detach writes no file here (the output stays with the render service): leave out "
                             "-o and fetch it with `jobs fetch ID -o FILE`")
        return [req], [], render
    png = req.output_format == PNG
    outs = _outputs(args, png, 1, "this graph saves an image (SaveImage): name a .png" if png else
                    "this graph saves a video: name an .mp4")
    return [req], outs, render


def _outputs(args, png: bool, n: int, wrong_name: str) -> list[Path]:
    """The output paths of `n` renders: `-o` (default out.png for an image, else out.mp4); CheckError `wrong_name`
    when -o names the other kind of file."""
    out = args.output or ("out.png" if png else "out.mp4")
    if png != out.lower().endswith(".png") and not out.endswith(("/", os.sep)):
        raise CheckError(f"-o {out}: {wrong_name}")
    outs = [o.with_suffix(".png") if png and o.suffix != ".png" else o
            for o in output_paths(out, n, overwrite=args.overwrite)]
    for o in outs:
        o.parent.mkdir(parents=True, exist_ok=True)
    return outs


def _read_flag_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CheckError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def explain(req: render_pb2.RenderRequest, render) -> dict:
    """What a --workflow graph became: the request's values and files, the graph's files and notes."""
    p = req.params
    return {"params": {f: getattr(p, f) for f in ("prompt", "width", "height", "frames", "steps", "seed", "sampler",
                                                   "scheduler", "video_shift", "audio_shift", "ref_image_size")},
            "loras": [[lo.name, lo.strength] for lo in req.loras],
            "first_frame": len(req.first_frame) or None, "last_frame": len(req.last_frame) or None,
            "references": [[r.kind, r.name] for r in req.references],
            "guides": [[g.frame, g.image.name if g.HasField("image") else None,
                        g.audio.name if g.HasField("audio") else None] for g in req.guides], "crf": req.crf,
            "output_format": req.output_format or "mp4", "graph": render.summary()}


def _received(out: Path) -> Path:
    """Where the job's MP4 is written: `out` itself, or beside a .png output (its picture is taken from it)."""
    return out.with_name(f".{out.name}.mp4") if out.suffix.lower() == ".png" else out


def _deliver(out: Path) -> None:
    """A .png output: the first frame of the MP4 received beside it, written in its place (the MP4 removed)."""
    if out.suffix.lower() != ".png":
        return
    from minimax_h3.comfy.workflow import first_frame_png

    mp4 = _received(out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(first_frame_png(mp4))
    tmp.replace(out)
    mp4.unlink()


def _refused(e: grpc.RpcError) -> bool:
    """The render service refused the request itself (INVALID_ARGUMENT, or NOT_FOUND for a LoRA the DiT does not
    have, from Submit or Upload, before any job): exit 2, as for what this client refuses by itself."""
    return e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def _failed(e: Exception, refusal_exits_2: bool = True) -> int:
    """Say on stderr what stopped a command; returns its exit code: 2 for the input's fault (what this client
    refuses, and with `refusal_exits_2` what the render service refuses), else 1."""
    if isinstance(e, grpc.RpcError):
        print(f"error: {rpc_words(e)}", file=sys.stderr)
        return 2 if refusal_exits_2 and _refused(e) else 1
    print(f"error: {e}", file=sys.stderr)
    return 2 if isinstance(e, CheckError) else 1


def cmd_render(args) -> int:
    """`render`; Ctrl-C exits 130: a local stack says at once that it stops, and stops (client/embedded.py CtrlC)."""
    with CtrlC() as ctrl_c:
        try:
            return _render(args, ctrl_c)
        except KeyboardInterrupt:
            return 130


def _render(args, ctrl_c: CtrlC) -> int:
    from client.progress import RenderProgress, print_summary
    from client.render_client import TERMINAL, RenderClient

    security = Security(args.token, args.tls_ca)
    try:
        if args.workflow:
            reqs, outs, graph = workflow_inputs(args)
            for note in graph.notes:
                print(f"note: {note}", file=sys.stderr)
            if args.explain:
                print(json.dumps(explain(reqs[0], graph), indent=2))
                return 0
        else:
            reqs, outs = render_inputs(args)
        target, stack = connect_render(
            args, security, before_embedded=lambda: check_for_local_stack(args.models_dir), ctrl_c=ctrl_c,
            running=lambda where, source, served: check_running_stack(args.models_dir, args.devices, where, source,
                                                                      served, args.endpoints_file))
    except (CheckError, EndpointError, StackStartError) as e:
        return _failed(e)
    if not args.models_dir and stack is not None and stack.procs.keys() >= set(STAGES):
        print(EMBEDDED_NOTE, file=sys.stderr)
    job_ids: dict[int, str] = {}
    refused: set[int] = set()  # renders the service refused at Submit (no job): the input's fault, exit 2

    def fetch_command(i: int) -> str:
        """What gets render i's MP4 once this client is gone, whether its job is still queued or running or done:
        with the flags that found the service here (its environment finds it again by itself)."""
        where = {"--render": args.render,
                 "--endpoints-file": args.endpoints_file if args.endpoints_file != str(DEFAULT_ENDPOINTS_FILE) else "",
                 "--tls-ca": args.tls_ca if args.tls_ca != os.environ.get("H3_TLS_CA", "") else ""}
        flags = "".join(f" {flag} {shlex.quote(value)}" for flag, value in where.items() if value)
        return f"{self_command()} jobs fetch {job_ids[i]} --wait -o {shlex.quote(str(outs[i]))}{flags}"
    try:
        with RenderClient(target, security) as rc:
            for req in reqs:
                rc.upload_references(req)
            if args.detach:
                for req in reqs:
                    info = rc.submit(req)
                    print(f"job {info.job_id} {state_name(info.state)}")
                return 0
            with RenderProgress() as progress:
                def queued(i: int, job_id: str) -> None:
                    job_ids[i] = job_id
                    hint = "" if stack is not None else f"; if this client stops, get it with: {fetch_command(i)}"
                    # One line as written (no wrapping, no markup): the command in it is copied and run.
                    progress.progress.console.print(f"job {job_id} queued{hint}", soft_wrap=True, markup=False,
                                                    highlight=False)

                def on_event(i: int):
                    def fn(ev):
                        if ev.WhichOneof("event") == "progress":
                            progress.update(ev.progress)
                        elif i not in job_ids:
                            queued(i, ev.job_id)
                    return fn

                def outcome(i: int, call):
                    try:
                        info = call()
                    except grpc.RpcError as e:
                        if _refused(e) and i not in job_ids:
                            refused.add(i)
                        return rpc_words(e)
                    if info is None or info.state not in TERMINAL:
                        return "the job's event stream ended before the job did; follow it with `jobs watch`"
                    return info if info.state == render_pb2.JOB_SUCCEEDED else job_error_words(info)

                if len(reqs) == 1:  # one call
                    results = [outcome(0, lambda: rc.render(reqs[0], _received(outs[0]), on_event(0)))]
                else:  # every prompt queued at once (the service batches them with everyone's), then followed
                    results = [None] * len(reqs)
                    for i, req in enumerate(reqs):
                        try:
                            queued(i, rc.submit(req).job_id)
                        except grpc.RpcError as e:
                            if _refused(e):
                                refused.add(i)
                            results[i] = rpc_words(e)
                    todo = [i for i in job_ids]
                    with ThreadPoolExecutor(max_workers=min(16, len(todo) or 1)) as pool:
                        for i, r in zip(todo, pool.map(
                                lambda i: outcome(i, lambda: rc.follow(job_ids[i], _received(outs[i]), on_event(i))),
                                todo)):
                            results[i] = r
        rc_code = 0
        for i, r in enumerate(results):
            if isinstance(r, str):
                rc_code = 1 if rc_code == 1 or i not in refused else 2
                print(f"error: {'job ' + job_ids[i] + ': ' if i in job_ids else ''}{r}", file=sys.stderr)
            else:
                _deliver(outs[i])
                print_summary(outs[i], r.stages)
        return rc_code
    except grpc.RpcError as e:
        return _failed(e)
    except KeyboardInterrupt:
        if stack is None and job_ids:
            gets = "".join(f"\n  {fetch_command(i)}" for i in sorted(job_ids))
            print(f"interrupted; the render service goes on with the job(s); to wait for each and get its MP4:{gets}"
                  f"\n(or: {self_command()} jobs watch|cancel ID)", file=sys.stderr)
        return 130
    finally:
        if stack is not None:
            ctrl_c.stop_stack()


def _no_render_service() -> int:
    print("error: no render service configured: start one with scripts/up.sh, or pass --render HOST:PORT",
          file=sys.stderr)
    return 1


def cmd_extend(args) -> int:
    """A new job continuing a finished one by --seconds, rendered to one MP4 of the stitched whole."""
    from client.progress import RenderProgress, print_summary
    from client.render_client import RenderClient

    target, security = configured_render(args), Security(args.token, args.tls_ca)
    if not target:
        return _no_render_service()
    try:
        more = window_prompts(args.prompt, args.timed_prompt or [])
        if args.seconds <= 0:
            raise CheckError(f"--seconds {args.seconds:g}: give the seconds to add (above 0)")
        out = Path(args.output or f"{args.job_id}-extended.mp4")
        if not args.detach:
            refuse_existing([out], args.overwrite)
        ext = render_pb2.ExtendRequest(job_id=args.job_id, seconds=args.seconds, label=args.label,
                                       idempotency_key=args.idempotency_key)
        ext.params.prompt = args.prompt[0]
        ext.params.more_prompts.extend(more[0])
        ext.params.prompt_starts.extend(more[1])
        ext.params.seed = args.seed
        if args.steps is not None:
            ext.params.steps = args.steps
        check_render_reachable(args, target, security)
        with RenderClient(target, security) as rc:
            info = rc.extend(ext)
            print(f"job {info.job_id} {state_name(info.state)}: extends {args.job_id} to {info.params.frames} frames "
                  f"({info.windows})")
            if args.detach:
                return 0
            with RenderProgress() as progress:
                info = rc.follow(info.job_id, out, lambda ev: progress.update(ev.progress)
                                 if ev.WhichOneof("event") == "progress" else None)
            if info.state != render_pb2.JOB_SUCCEEDED:
                print(f"error: job {info.job_id} {state_name(info.state)}: {job_error_words(info)}", file=sys.stderr)
                return 1
            print_summary(out, info.stages)
            return 0
    except (CheckError, EndpointError, grpc.RpcError) as e:
        return _failed(e)


def _add_extend_parser(sub) -> None:
    x = sub.add_parser("extend", help="continue a finished job: one MP4 of the stitched whole",
                       description="A new job that continues a finished one by --seconds, conditioned on its last "
                                   "frames, at its size and settings, and writes the stitched whole as one MP4 "
                                   "(docs/long_video.md).")
    x.add_argument("job_id", help="the finished job to continue")
    x.add_argument("--seconds", type=float, required=True, help="seconds to add")
    x.add_argument("--prompt", action="append", required=True,
                   help="what happens next (picture and sound); given again, the prompts take turns over the added part")
    x.add_argument("--timed-prompt", action="append", metavar="SECONDS:TEXT",
                   help="a later prompt, from that second of the stitched clip on (repeatable; after one --prompt)")
    x.add_argument("--steps", type=int, help="sampling steps (default: the source job's)")
    x.add_argument("--seed", type=int, default=0, help="0..2^63-1 (default: 0)")
    x.add_argument("-o", "--output", help="the MP4 (default: JOB_ID-extended.mp4)")
    x.add_argument("--overwrite", action="store_true", help="replace the -o file if it exists (default: refuse)")
    x.add_argument("--detach", action="store_true", help="submit the extension, print its id and return")
    x.add_argument("--label", default="", help="free text shown by `jobs list` and the web page")
    x.add_argument("--idempotency-key", default="", help="a retried extend with the same key returns the same job")
    add_endpoint_args(x.add_argument_group("where the service is"), render=True, stages=False)
    x.set_defaults(fn=cmd_extend)


def _print_job(info) -> None:
    p = info.progress
    where = f"{info.stage}" + (f" {p.phase} {p.step}/{p.total}" if p.total else f" {p.phase}" if p.phase else "")
    if info.state == render_pb2.JOB_SUCCEEDED:
        where = "done"
    elif info.state == render_pb2.JOB_CANCELLED:
        where = f"cancelled at {info.stage}" if info.stage else "cancelled"
    size = f"{info.output_bytes / 2**20:.1f} MiB" if info.output_bytes else "-"
    print(f"{info.job_id}  {state_name(info.state):<9}  {where.strip() or '-':<24}  {info.width}x{info.height}x"
          f"{info.params.frames}  {size:>9}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.created_unix))}"
          f"  {info.label or info.params.prompt[:40]!r}" + ("  (output expired)" if info.output_expired else "")
          + (f"  {job_error_words(info)}" if info.error_code else ""))
    if info.windows and not info.windows.startswith("one window"):
        print(f"  windows: {info.windows}" + (f"; extends {info.extend_job_id}" if info.extend_job_id else ""))


def cmd_jobs(args) -> int:
    from client.render_client import TERMINAL, RenderClient

    target, security = configured_render(args), Security(args.token, args.tls_ca)
    if not target:
        return _no_render_service()
    try:
        check_render_reachable(args, target, security)
        if args.action == "fetch":
            out = Path(args.output or f"{args.job_id}.mp4")
            refuse_existing([out], args.overwrite)
        with RenderClient(target, security) as rc:
            if args.action == "list":
                states = [render_pb2.JobState.Value(f"JOB_{s.upper()}") for s in args.state or ()]
                for info in rc.list(states, args.limit):
                    _print_job(info)
                return 0
            if not args.job_id:
                print(f"error: jobs {args.action} needs a JOB_ID", file=sys.stderr)
                return 2
            if args.action == "get":
                info = rc.get(args.job_id)
                _print_job(info)
                for s in info.stages:
                    cached = ""
                    if s.stage == "dit":
                        cached = f", {s.cached_steps} of {info.params.steps} steps cached"
                        if info.params.HasField("sparse_attention"):
                            cached += f", {s.sparse_steps} sparse (VSA)"
                    print(f"  {s.stage:<9} {s.wall_s:8.2f} s  batch {s.batch} ({s.batch_size} jobs, waited "
                          f"{s.waited_batches}){cached}")
                return 0
            if args.action == "cancel":
                info = rc.cancel(args.job_id)
                _print_job(info)
                return 0 if info.state in TERMINAL else 1
            if args.action == "fetch":
                if not args.wait:
                    rc.fetch(args.job_id, _received(out))
                else:  # followed to its end as `watch` does (a service restart is waited out), then fetched
                    info = rc.follow(args.job_id, _received(out))
                    if info.state != render_pb2.JOB_SUCCEEDED:
                        print(f"error: job {args.job_id} {state_name(info.state)}: {job_error_words(info)}",
                              file=sys.stderr)
                        return 1
                _deliver(out)
                print(f"wrote {out}")
                return 0
            last = None  # watch
            for ev in rc.watch(args.job_id, args.from_index):
                kind = ev.WhichOneof("event")
                if kind == "progress":
                    p = ev.progress
                    print(f"[{ev.index}] {p.stage} {p.phase} {p.step}/{p.total} {p.message}".rstrip())
                else:
                    last = ev.job
                    print(f"[{ev.index}] {state_name(ev.job.state)} {ev.job.stage}".rstrip())
            return 0 if last is not None and last.state == render_pb2.JOB_SUCCEEDED else 1
    except (CheckError, EndpointError, grpc.RpcError) as e:
        return _failed(e, refusal_exits_2=False)


def cmd_status(args) -> int:
    """Health and status of the configured render service and of every configured stage (any subset: a DiT
    started alone is looked at alone), one block per replica of a stage listed with several (`dit/1`, `dit/2`);
    exit 1 when something configured does not serve."""
    from client.progress import print_status
    from h3.v1 import common_pb2

    endpoints = configured_endpoints(args)
    render = configured_render(args)
    if endpoints is None and not render:
        print("error: no endpoints configured: start them with scripts/up.sh, or pass --render / --encoder / --dit / "
              "--decoder HOST:PORT", file=sys.stderr)
        return 1
    security = Security(args.token, args.tls_ca)
    ok = True
    if render:
        from client.render_client import RenderClient

        with RenderClient(render, security) as rc:
            try:
                st = rc.status()
                print(f"render   {render}  {st.health}  queued={st.queued}  running={st.running}  "
                      f"succeeded={st.succeeded}  failed={st.failed}  cancelled={st.cancelled}  batches={st.batches}"
                      + (f"  web={st.web_url}" if st.web_url else ""))
            except grpc.RpcError as e:
                ok = False
                print(f"render   {render}  not answering ({rpc_words(e)})")
    if endpoints is None:
        return 0 if ok else 1
    rows = []
    for s in endpoints.stages:
        try:
            replicas = replicas_of(endpoints.of(s))
        except FailedPrecondition as e:
            print(f"error: --{s} / H3_{s.upper()}: {e}", file=sys.stderr)
            return 1
        for name, addr in replicas:  # each replica on its own (a list's channel would answer for any one of them)
            with StageClients(Endpoints(**{s: addr}), security) as c:
                health = health_of(c.channels[s], SERVICE_NAMES[s])
                st = None
                if health != "UNREACHABLE":
                    try:
                        st = c.stub(s).Status(common_pb2.StatusRequest(), timeout=5, metadata=c.security.metadata())
                    except grpc.RpcError:
                        pass
            rows.append((f"{s}/{name}" if name else s, addr, health, st))
    print_status(rows)
    return 0 if ok and all(r[2] == "SERVING" for r in rows) else 1


def _add_render_parser(sub) -> None:
    r = sub.add_parser("render", help="prompt -> MP4 (video + audio)",
                       description="Render prompts into MP4s (H.264 + AAC 32 kHz stereo, 24 fps) through the render "
                                   "service. Everything below is checked here first, by the service's own rules: a "
                                   "refusal exits 2 before anything starts.")
    what = r.add_argument_group("what to render")
    what.add_argument("--prompt", action="append",
                      help="what to generate (describe picture and sound); given again, the prompts take turns over "
                           "a long render, spread evenly (each window takes the one in effect: docs/long_video.md); "
                           "with --workflow, replaces the graph's prompt")
    what.add_argument("--timed-prompt", action="append", metavar="SECONDS:TEXT",
                      help="a later prompt of a long render, from that second on (repeatable; after one --prompt)")
    what.add_argument("--workflow", metavar="FILE.json",
                      help="a ComfyUI graph (the editor's saved workflow, subgraphs included, or the API format): the "
                           "render is what it says; the flags given override its values (docs/workflows.md)")
    add_set_flag(what)
    what.add_argument("--input-dir", metavar="DIR",
                      help="--workflow: the folder the graph's LoadImage / LoadAudio / LoadVideo files are read from "
                           "(ComfyUI's input folder; default: the graph file's folder)")
    what.add_argument("--explain", action="store_true",
                      help="--workflow: print the request the graph becomes (JSON) and start nothing")
    what.add_argument("--prompts-file", help="one prompt per line; renders all, stage-batched, into the -o folder")
    what.add_argument("--first-frame", help="fl2va: PNG/JPEG the video starts from (fitted to --width x --height)")
    what.add_argument("--last-frame", help="fl2va: PNG/JPEG the video ends on (fitted to --width x --height)")
    what.add_argument("--ref", action="append", metavar="[KIND:]PATH",
                      help="ref2va reference, repeatable, in order: an image (<Picture i> in the prompt), a video with "
                           "its sound (<Video k>; its sound <Audio j>) or an audio clip (<Audio j>); the kind comes "
                           "from the extension or KIND (image|video|audio). Not with --first-frame/--last-frame "
                           "(docs/references.md)")
    what.add_argument("--guide", action="append", metavar="FILE[+FILE]@WHEN",
                      help="a guide, repeatable: an image and / or an audio file anchored at WHEN, seconds into the "
                           "video (1.5, 1.5s; negative from the end) or a frame fN (f36, f-1 = the last), as ComfyUI's "
                           "MiniMaxH3AddGuide: the image conditions that frame (fitted to --width x --height), the "
                           "sound the audio from there on. With a text, first/last-frame or --ref render "
                           "(docs/references.md)")
    what.add_argument("--lora", action="append", metavar="NAME[:STRENGTH]",
                      help="LoRA file name in the DiT server's <models_dir>/loras (repeatable; strength default 1.0)")
    size_rule = (f"a multiple of {SIZE_MULTIPLE}, {MIN_SIDE}..{MAX_SIDE}; width x height at most {MAX_AREA} pixels "
                 f"(1920x1088), aspect at most {MAX_ASPECT:g}:1")
    shape = r.add_argument_group("size, length and sampling")
    # Defaults are filled in by render_inputs (RENDER_DEFAULTS), so a --workflow graph's values hold where no flag is
    # given.
    shape.add_argument("--width", type=int, help=f"{size_rule} (default: {DEFAULT_SIZE[0]})")
    shape.add_argument("--height", type=int, help=f"{size_rule} (default: {DEFAULT_SIZE[1]})")
    shape.add_argument("--frames", type=int,
                       help=f"17n+5, {MIN_FRAMES}..{MAX_FRAMES}, at 24 fps (default: {DEFAULT_FRAMES} = 5.2 s); past "
                            f"{MAX_WINDOW_FRAMES} the render is sampled in windows; {IMAGE_FRAMES}: an image (a PNG, "
                            "no sound)")
    shape.add_argument("--seconds", type=float,
                       help="instead of --frames: the length in seconds (the smallest valid frame count that long)")
    shape.add_argument("--steps", type=int, help=f"sampling steps, {MIN_STEPS}..{MAX_STEPS} (default: {DEFAULT_STEPS})")
    shape.add_argument("--seed", type=int, help="0..2^63-1; the same seed renders the same video (default: 0)")
    shape.add_argument("--sampler", choices=SAMPLERS, help="(default: res_multistep)")
    shape.add_argument("--scheduler", choices=SCHEDULERS, help="(default: simple)")
    shape.add_argument("--quality", choices=QUALITIES,
                       help="exact: every DiT step computed; fast: step caching, steps whose first block changed "
                            "little reuse the last full step's other blocks (faster, not the same video) "
                            "(default: exact)")
    shape.add_argument("--ref-image-size", choices=[m for m in REF_IMAGE_SIZES if m],
                       help="--ref images: max scales them down only, to a 2048 px short edge; match down only, to "
                            "the render's pixel area (fewer vision tokens and latent rows, faster) (default: the "
                            "model's own, a 2048 px short edge up or down; docs/references.md)")
    shape.add_argument("--video-shift", type=float, help="0 or 0.1..100; 0 = the model's default, 12 (default: 0)")
    shape.add_argument("--audio-shift", type=float, help="0 or 0.1..100; 0 = the model's default, 3 (default: 0)")
    long = r.add_argument_group("long video (default: the product's pick, docs/long_video.md)")
    long.add_argument("--window-frames", type=int, default=0,
                      help=f"frames per window, 17n+5 up to {MAX_WINDOW_FRAMES} (default: one window up to "
                           f"{MAX_WINDOW_FRAMES} frames with one prompt, else 175)")
    long.add_argument("--window-overlap", type=int, default=0,
                      help="frames two windows share, 17m+5 (default: 22 continuation, 39 fused)")
    long.add_argument("--window-mode", default="", choices=("", *WINDOW_MODES),
                      help="continuation: each window on the previous one's tail (default); fused: overlapping windows "
                           "averaged at every step")
    long.add_argument("--window-fuse", default="", choices=("", *WINDOW_FUSES),
                      help="fused windows' weights (default: pyramid)")
    out = r.add_argument_group("output")
    out.add_argument("-o", "--output",
                     help="output MP4 (default: out.mp4; none with --detach); a folder (a trailing / or an existing directory) gets "
                          "000.mp4, 001.mp4, ... in prompt order, as does any -o with several prompts")
    out.add_argument("--overwrite", action="store_true", help="replace output files that exist (default: refuse)")
    out.add_argument("--crf", type=int,
                     help=f"H.264 quality 1..{MAX_CRF}, lower is better (default: {DEFAULT_CRF}; an image graph's: 1)")
    out.add_argument("--upscale", metavar="WxH",
                     help=f"MP4 size, e.g. 1920x1080, every frame scaled in the mux (libswscale Lanczos): even sides, "
                          f"at most {MAX_OUTPUT_SIDE} per side and 3840x2160 pixels, within "
                          f"{MAX_ASPECT_CHANGE * 100:.0f}%% of the render's aspect (default: the render size)")
    job = r.add_argument_group("job")
    job.add_argument("--detach", action="store_true", help="submit the job(s), print the ids and return")
    job.add_argument("--label", default="", help="free text shown by `jobs list` and the web page")
    job.add_argument("--idempotency-key", default="", help="a retried render with the same key returns the same job")
    local = r.add_argument_group("local stack (started only when no service is configured)")
    local.add_argument("--models-dir", default=os.environ.get("H3_MODELS_DIR", ""),
                       help="real checkpoints for the local stack (default: H3_MODELS_DIR, else the tiny embedded "
                            "model; `models check DIR` checks a folder); with a service configured, refused unless "
                            "its stages serve this folder")
    local.add_argument("--devices", default="", help="devices for the local stack, e.g. cuda:0 (default: CPU); "
                                                      "refused with a service configured (it keeps its own)")
    add_endpoint_args(r.add_argument_group("where the services are"), render=True)
    r.set_defaults(fn=cmd_render)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=self_command(), description="h3-stages client")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_render_parser(sub)
    _add_extend_parser(sub)
    j = sub.add_parser("jobs", help="the render service's jobs: list | get | watch | fetch | cancel")
    j.add_argument("action", choices=("list", "get", "watch", "fetch", "cancel"))
    j.add_argument("job_id", nargs="?", help="job id (all actions but list)")
    j.add_argument("-o", "--output", help="fetch: where to write the MP4 (default: JOB_ID.mp4)")
    j.add_argument("--overwrite", action="store_true", help="fetch: replace the -o file if it exists (default: refuse)")
    j.add_argument("--wait", action="store_true",
                   help="fetch: wait for a queued or running job to end first, then write its MP4 (default: a job "
                        "that has not succeeded yet is an error)")
    j.add_argument("--from", dest="from_index", type=int, default=0, help="watch: first event index (default: 0)")
    j.add_argument("--state", action="append", choices=("queued", "running", "succeeded", "failed", "cancelled"),
                   help="list: only jobs in this state (repeatable; default: all)")
    j.add_argument("--limit", type=int, default=50, help="list: newest N jobs (default: 50)")
    add_endpoint_args(j.add_argument_group("where the service is"), render=True, stages=False)
    j.set_defaults(fn=cmd_jobs)
    s = sub.add_parser("status", help="health, residency, devices, kernels of each configured stage (any subset; "
                                      "each replica of one listed with several) and the render service")
    add_endpoint_args(s.add_argument_group("where the services are"), render=True)
    s.set_defaults(fn=cmd_status)
    from client.doctor import add_parser as add_doctor
    from client.models_cli import add_parser as add_models

    add_models(sub)
    add_doctor(sub)
    try:
        from client.loadtest import add_parser as add_loadtest
    except ImportError:
        add_loadtest = None
    if add_loadtest is not None:
        add_loadtest(sub, add_endpoint_args)
    args = ap.parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # a reader that left shows here, not as an error at interpreter exit
        return rc
    except BrokenPipeError:  # `... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
