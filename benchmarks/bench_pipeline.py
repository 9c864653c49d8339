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

On virtual devices each device is a share of the machine: the cores this process may use are split into disjoint
sets, one per virtual device, and each stage runs on its device's set (`--cpu-cores`: affinity, torch threads = the
set's size). Both modes run on the same stage processes, so they compare the same machine shares. The defaults are
the CPU bar's sizes: the tiny model at 384x384x39 (long enough that per-job overheads stay small beside the work),
prompts of 1000 bytes (1000 tokens of the tiny byte-level tokenizer, under the encoder's 1024-token limit, and
different per job: the encoder's prompt cache would hide its work), and the three stages' work per job matched
(`--steps 0`, `--encoder-layers 0`; the JSON's `balance`): (1) the DiT's seconds per step from jobs at 4 and 16 steps
after a warm-up at each, the median of three each, the step count where they match the decoder's; (2) the tiny
model's text encoder is a tiny-family file (width 64) the bench writes into its own cache with as many layers as
match the decoder's seconds (the encoder reads the depth from the file); (3) up to `--pre-runs` pipelined pre-runs
shaped as the measured run (`--jobs` jobs at once after a warm-up: a stage's seconds per job depend on which stages
compute beside it, and so on the job count) scale the steps and the layers by the decoder's seconds over the DiT's
and the encoder's (the geometric mean of every pre-run's implied counts); the first pre-run whose stages all reach
0.9 of the bottleneck's seconds ends them and the run uses its counts (`balance.verified`); every pre-run is in
`balance.pre_runs`.
`bar` in the output says, per criterion, whether the run met it.

    # CPU, tiny model, three virtual devices (every stage on its own cores; 3 cores or more: see core_sets):
    python benchmarks/bench_pipeline.py --compare-serial --json docs/performance_data/pipeline/cpu.json
    # one GPU, all stages resident (full-size random weights, written to --models-dir first if it has none):
    python benchmarks/bench_pipeline.py --devices cuda:0 --residency shared --models-dir /tmp/h3models \\
        --write-weights --width 832 --height 480 --frames 124 --steps 8 --jobs 4 --compare-serial --json $OUT/h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.embedded import EmbeddedStack, StackConfig  # noqa: E402
from client.render_client import render_request  # noqa: E402
from h3.v1 import render_pb2, render_pb2_grpc  # noqa: E402
from minimax_h3.contract import RenderSpec  # noqa: E402
from minimax_h3.services import STAGES  # noqa: E402
from stagekit.channels import open_channel  # noqa: E402

TERMINAL = (render_pb2.JOB_SUCCEEDED, render_pb2.JOB_FAILED, render_pb2.JOB_CANCELLED)
FILLER = ("rain on a tin roof, a bell far off, footsteps on wet gravel, a door creaks, wind in the pines, a dog barks "
          "twice, thunder rolls over the valley, ")
# The bar: CPU, pipelined wall <= 0.6 x serial and every stage's busy share >= 0.8 x the bottleneck's; one H200
# (shared residency, 832x480x124, 8 steps): four jobs no slower than 71 s, one job no slower than 16.4 s.
CPU_RATIO, CPU_SHARE = 0.6, 0.8
# A pre-run whose every stage does at least this share of the bottleneck's seconds ends the calibration: above the
# bar's CPU_SHARE by twice the spread of a stage's share between runs of eight at the same counts (about 0.05).
BALANCED = 0.9
GPU_SHAPE, GPU_JOBS, GPU_FOUR_S, GPU_ONE_S = (832, 480, 124), 4, 71.0, 16.4


def core_sets(cores: list[int], devices: list[str]) -> dict[str, list[int]]:
    """Disjoint core sets, one per distinct device, in order: `len(cores) // n` cores each (the rest stay free for
    the render service and this script). With fewer cores than devices each device gets one core, shared round-robin.

    >>> core_sets([0, 1, 2, 3, 4, 5, 6, 7], ["virt0", "virt1", "virt2"])
    {'virt0': [0, 1], 'virt1': [2, 3], 'virt2': [4, 5]}
    """
    names = list(dict.fromkeys(devices))
    per = len(cores) // len(names)
    if per == 0:
        return {d: [cores[i % len(cores)]] for i, d in enumerate(names)}
    return {d: cores[i * per:(i + 1) * per] for i, d in enumerate(names)}


def prompt_text(head: str, size: int) -> str:
    """`head` then the filler, cut to `size` bytes (ASCII); `size` 0: `head` and the filler's first clause."""
    if size <= 0:
        return f"{head}: rain on a tin roof, a bell, footsteps"
    body = f"{head}: " + FILLER * (size // len(FILLER) + 1)
    return body[:size]


def bar_setting(devices: list[str], shape: tuple[int, int, int]) -> str:
    """Which of the bar's settings a run measures: "cpu" (every stage on its own virtual device), "gpu" (CUDA at
    832x480x124), or "" (neither)."""
    if not any(d.startswith("cuda") for d in devices):
        return "cpu" if len(set(devices)) == len(STAGES) else ""
    return "gpu" if shape == GPU_SHAPE else ""


def bar_verdict(out: dict, setting: str, jobs: int) -> dict:
    """The bar's criteria of `setting` (see bar_setting), each with the value, the limit and ok; `ok` over all of
    them (false when the run measures none)."""
    bar: dict = {}
    if setting == "cpu":
        if "pipelined_over_serial" in out:
            r = out["pipelined_over_serial"]
            bar["pipelined_over_serial"] = {"value": r, "max": CPU_RATIO, "ok": r <= CPU_RATIO}
        for s, v in out["pipelined"]["busy_over_bottleneck"].items():
            bar[f"busy_over_bottleneck.{s}"] = {"value": v, "min": CPU_SHARE, "ok": v >= CPU_SHARE}
    elif setting == "gpu":
        p = out["pipelined"]
        if jobs == GPU_JOBS:
            bar["four_jobs_wall_s"] = {"value": p["wall_s"], "max": GPU_FOUR_S, "ok": p["wall_s"] <= GPU_FOUR_S}
        bar["one_job_s"] = {"value": p["one_job_s"], "max": GPU_ONE_S, "ok": p["one_job_s"] <= GPU_ONE_S}
    bar["ok"] = bool(bar) and all(c["ok"] for c in bar.values())
    return bar


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
    top = max(share.values())
    runs = [r for i in infos.values() for r in i.stages]
    return {"jobs": len(ids), "wall_s": round(wall, 2), "jobs_per_min": round(60 * len(ids) / wall, 2),
            "latency_max_s": round(max(ends.values()) - t0, 2),
            "busy_s": {s: round(b, 2) for s, b in busy.items()}, "busy_share": share,
            "busy_over_bottleneck": {s: round(v / top, 3) if top else 0.0 for s, v in share.items()},
            "bottleneck": max(share, key=share.get),
            "batches": len({r.batch for r in runs}), "max_waited_batches": max(r.waited_batches for r in runs)}


def median(xs: list[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    ys = sorted(xs)
    return (ys[(len(ys) - 1) // 2] + ys[len(ys) // 2]) / 2


def geometric_mean(xs: list[float]) -> float:
    """exp(mean(log x)) of positive values: the mean of ratios, which a run twice too slow and one twice too fast
    cancel in."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def balance_steps(stack: EmbeddedStack, stages, render_args: list[str], spec, probe: tuple[int, int],
                  repeats: int = 3) -> dict:
    """The step count at which the DiT's compute per job matches the decoder's, on these stages: one warm-up render
    at each of `probe`'s step counts, then `repeats` jobs at each (alternating), each stage's median seconds; the
    DiT's are a line in the steps (its per-step work plus the fixed rest), the decoder's do not depend on them.
    Clamped to [1, 1000]. The encoder's median seconds come along (its work does not depend on the steps)."""
    stack.stop_stage("render")
    stack.cfg.extra_args["render"] = render_args
    target = stack.start_render(stages)
    for n in probe:
        run_jobs(target, [spec(f"balance warm-up {n}", 0, n)], "balance-warm")
    runs: dict[int, list[dict]] = {n: [] for n in probe}
    for r in range(repeats):
        for n in probe:
            runs[n].append(run_jobs(target, [spec(f"balance {n} steps {r}", 0, n)], f"balance-{n}-")["busy_s"])
    dit = {n: median([b["dit"] for b in runs[n]]) for n in probe}
    per_step = max((dit[probe[1]] - dit[probe[0]]) / (probe[1] - probe[0]), 1e-6)
    rest = dit[probe[0]] - per_step * probe[0]
    every = [b for n in probe for b in runs[n]]
    decoder, encoder = median([b["decoder"] for b in every]), median([b["encoder"] for b in every])
    steps = min(1000, max(1, round((decoder - rest) / per_step)))
    out = {"steps": steps, "dit_s_per_step": round(per_step, 4), "dit_rest_s": round(rest, 3),
           "decoder_s": round(decoder, 3), "encoder_s": round(encoder, 3), "samples_per_probe": repeats}
    print("balance:", json.dumps(out), flush=True)
    return out


def encoder_file(cache: Path, layers: int) -> Path:
    """A tiny-family text encoder of `layers` layers (the embedded model's generator, its header declaring the
    depth; the encoder reads it from the file), written once into the bench's cache."""
    from minimax_h3.text.tiny import write_tiny_model

    return write_tiny_model(cache / f"text_encoder_L{layers}", num_layers=layers, used_layers=layers)


def use_encoder(stack: EmbeddedStack, cache: Path, layers: int):
    """Restart the encoder stage on a tiny encoder of `layers` layers; the stages' new endpoints."""
    stack.stop_stage("render")
    stack.stop_stage("encoder")
    args = stack.cfg.extra_args["encoder"]
    if "--weights" in args:
        del args[args.index("--weights"):args.index("--weights") + 2]
    args += ["--weights", str(encoder_file(cache, layers))]
    stack.start_stage("encoder")
    stack.wait_ready("encoder")
    return stack.endpoints()


def balance_pipelined(stack: EmbeddedStack, stages, render_args: list[str], spec, steps: int, cache: Path | None,
                      layers: int, jobs: int, rounds: int) -> dict:
    """Correct the step count (and, with a bench-written encoder, its layer count) from pre-runs shaped as the
    measured run: a fresh render service, one warm-up render, then `jobs` jobs at once, pipelined. A stage's
    seconds per job depend on which other stages compute beside it (cores, caches and memory bandwidth are shared),
    and that depends on the job count: in a run of three the encoder's first job runs alone and the decoder's last,
    so each runs about a quarter of its time alone against a tenth in a run of eight. So the pre-runs run the
    measured run's job count, and their ratio is the one the bar reads: each stage's compute seconds over all jobs.

    Up to `rounds` pre-runs. One whose stages all reach `BALANCED` of the bottleneck's seconds ends the
    calibration: the run uses the settings it verified. Otherwise each pre-run implies the counts that would have
    matched the decoder's seconds (per job, the DiT's seconds scale with its steps and the encoder's with its
    layers; the decoder's work is fixed): its steps x decoder / DiT seconds, its layers x decoder / encoder seconds.
    The next pre-run runs the geometric mean of every pre-run's implied counts so far (one run's noise moves the
    counts less the more runs there are). The last correction, when no pre-run was balanced, is applied unverified
    (`verified` false)."""
    history: list[dict] = []
    implied: dict[str, list[float]] = {"steps": [], "layers": []}
    verified = False
    for r in range(rounds):
        stack.stop_stage("render")
        stack.cfg.extra_args["render"] = render_args
        target = stack.start_render(stages)
        run_jobs(target, [spec(f"pre-run warm-up {r}", 0, steps)], "pre-warm")
        run = run_jobs(target, [spec(f"pre-run {r} take {i}", i, steps) for i in range(jobs)], f"pre-run {r}-")
        sec = {s: b / jobs for s, b in run["busy_s"].items()}
        history.append({"steps": steps, "encoder_layers": layers, "jobs": jobs, "wall_s": run["wall_s"],
                        "per_job_s": {s: round(v, 3) for s, v in sec.items()},
                        "over_decoder": {s: round(v / sec["decoder"], 3) for s, v in sec.items()},
                        "busy_over_bottleneck": run["busy_over_bottleneck"]})
        print("pre-run:", json.dumps(history[-1]), flush=True)
        if min(run["busy_over_bottleneck"].values()) >= BALANCED:
            verified = True
            break
        implied["steps"].append(steps * sec["decoder"] / sec["dit"])
        steps = min(1000, max(1, round(geometric_mean(implied["steps"]))))
        if cache is not None:
            implied["layers"].append(layers * sec["decoder"] / sec["encoder"])
            new = min(1024, max(1, round(geometric_mean(implied["layers"]))))
            if new != layers:
                layers = new
                stages = use_encoder(stack, cache, layers)
    print(f"calibrated: {steps} steps, {layers} encoder layers "
          f"({'as the last pre-run verified' if verified else 'corrected after the last pre-run, unverified'})",
          flush=True)
    return {"steps": steps, "encoder_layers": layers, "verified": verified, "pre_runs": history, "stages": stages}


def measure(stack: EmbeddedStack, stages, render_args: list[str], mode: str, args, spec) -> dict:
    """(Re)start the render service with `render_args`; one warm-up render, one job alone, then `--jobs` at once."""
    stack.stop_stage("render")
    stack.cfg.extra_args["render"] = render_args
    target = stack.start_render(stages)
    run_jobs(target, [spec(f"{mode} warm-up", 0)], f"{mode}-warm")
    one = run_jobs(target, [spec(f"{mode} alone", 0)], f"{mode}-one")
    many = run_jobs(target, [spec(f"{mode} take {i}", i) for i in range(args.jobs)], f"{mode}-")
    out = {"one_job_s": one["wall_s"], **many}
    print(f"{mode}: {args.jobs} jobs in {out['wall_s']} s ({out['jobs_per_min']} jobs/min), one alone "
          f"{out['one_job_s']} s; busy share {out['busy_share']}, over the bottleneck ({out['bottleneck']}) "
          f"{out['busy_over_bottleneck']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--height", type=int, default=384)
    ap.add_argument("--frames", type=int, default=39)
    ap.add_argument("--steps", type=int, default=0,
                    help="denoising steps; 0: balance, the count at which the DiT's work per job matches the decoder's "
                         "(measured on these stages first, see balance_steps)")
    ap.add_argument("--prompt-bytes", type=int, default=-1,
                    help="prompt length (ASCII bytes); -1: 1000 on virtual devices, a short prompt on GPUs")
    ap.add_argument("--encoder-layers", type=int, default=0,
                    help="tiny model only: the text encoder's layers (a tiny-family file the bench writes into its own "
                         "cache); 0: balance, the count at which its work per job matches the decoder's")
    ap.add_argument("--pre-runs", type=int, default=4,
                    help="with --steps 0: at most this many pipelined pre-runs of --jobs jobs that correct the step "
                         "(and layer) counts; the first balanced one ends them (see balance_pipelined)")
    ap.add_argument("--devices", default="virt0,virt1,virt2",
                    help="one device for all stages, or three: the encoder's, the DiT's, the decoder's")
    ap.add_argument("--residency", default="exclusive", choices=("exclusive", "shared"))
    ap.add_argument("--models-dir", default="", help="real (or full-size random) weights; default: the tiny model")
    ap.add_argument("--write-weights", action="store_true",
                    help="write full-size random weights into --models-dir first where it has none (GPU)")
    ap.add_argument("--weights-only", action="store_true", help="with --write-weights: write them, then exit")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--compare-serial", action="store_true", help="also run with --no-pipeline; the ratio")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--run-dir", default="", help="the stages' logs, ports and leases, kept (default: a temp dir, "
                                                   "removed at the end)")
    args = ap.parse_args()
    # A SIGTERM (`timeout`) unwinds through the `finally` below, which stops the stages: they run in sessions of
    # their own and would outlive this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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

    cpu = not any(d.startswith("cuda") for d in devices)
    prompt_bytes = args.prompt_bytes if args.prompt_bytes >= 0 else (1000 if cpu else 0)

    def spec(prompt: str, seed: int, steps: int = 0) -> RenderSpec:
        return RenderSpec(prompt=prompt_text(prompt, prompt_bytes), width=args.width,
                          height=args.height, frames=args.frames, steps=steps or args.steps, seed=seed)

    # 1. Each stage's devices; on virtual devices also its own cores (the same for both modes).
    stage_devs = {s: devices[i % len(devices)] for i, s in enumerate(STAGES)}
    stage_args = {s: ["--devices", d, "--idle-unload-s", "-1"] for s, d in stage_devs.items()}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    sets = core_sets(cores, list(stage_devs.values())) if cpu and cores else {}
    if prompt_bytes > 1024:  # the encoder's default limit; one byte is one token of the tiny tokenizer
        stage_args["encoder"] += ["--max-prompt-tokens", str(prompt_bytes)]
    for s, d in stage_devs.items():
        if d in sets:
            stage_args[s] += ["--cpu-cores", ",".join(map(str, sets[d]))]
    threads = str(min(map(len, sets.values()))) if sets else ""
    # The tiny model's text encoder is a file of the tiny family with as many layers as its work needs (the
    # embedded one has 2: 1-2 % of the DiT's or the decoder's work); the encoder reads the depth from the file.
    cache = None if args.models_dir else Path(tempfile.mkdtemp(prefix="h3-bench-models-"))
    layers = args.encoder_layers or 16
    if cache is not None:
        stage_args["encoder"] += ["--weights", str(encoder_file(cache, layers))]
    stack = EmbeddedStack(StackConfig(run_dir=args.run_dir, residency=args.residency, models_dir=args.models_dir,
                                      env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} if threads else {},
                                      extra_args=stage_args))
    try:
        stages = stack.start()
    except BaseException:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        raise
    out: dict = {"config": {**vars(args), "prompt_bytes": prompt_bytes,
                            "model": args.models_dir or "tiny model (embedded DiT and decoder; text encoder of the "
                                                        "tiny family, 64 wide, written by the bench)"},
                 "cpus": os.cpu_count(), "cores_usable": len(cores),
                 "stage_cpu_cores": {s: sets.get(d, []) for s, d in stage_devs.items()},
                 "load_average_before": os.getloadavg()}
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()}; stage cores {out['stage_cpu_cores']}; "
          f"prompt {prompt_bytes} bytes", flush=True)
    try:
        base = ["--max-batch", str(args.max_batch)]
        if args.steps == 0:
            out["balance"] = balance_steps(stack, stages, base, spec, (4, 16))
            if cache is not None and args.encoder_layers == 0:  # the encoder's seconds scale with its layers
                enc = out["balance"]
                layers = min(1024, max(1, round(layers * enc["decoder_s"] / max(enc["encoder_s"], 1e-3))))
                stages = use_encoder(stack, cache, layers)
            pre = balance_pipelined(stack, stages, base, spec, out["balance"]["steps"],
                                    cache if args.encoder_layers == 0 else None, layers, args.jobs, args.pre_runs)
            stages, layers = pre.pop("stages"), pre["encoder_layers"]
            out["balance"]["probe_steps"] = out["balance"].pop("steps")
            out["balance"].update(pre)
            args.steps = out["config"]["steps"] = pre["steps"]
        out["config"]["encoder_layers"] = layers if cache is not None else None
        out["pipelined"] = measure(stack, stages, base, "pipelined", args, spec)
        if args.compare_serial:
            out["serial"] = measure(stack, stages, [*base, "--no-pipeline"], "serial", args, spec)
            out["pipelined_over_serial"] = round(out["pipelined"]["wall_s"] / out["serial"]["wall_s"], 3)
            print("pipelined_over_serial", out["pipelined_over_serial"], flush=True)
    finally:
        stack.stop()
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    out["load_average_after"] = os.getloadavg()  # other processes' CPU use: stages overlap only on idle cores
    out["bar"] = bar_verdict(out, bar_setting(devices, (args.width, args.height, args.frames)), args.jobs)
    print("bar", json.dumps(out["bar"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
