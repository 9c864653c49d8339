#!/usr/bin/env python
"""The DiT service against its own engine: s/step through gRPC vs the bare forward, and compile warm-up on a first
and a second start (persistent torch.compile cache).

    python benchmarks/bench_dit_service.py --models-dir /tmp/h3svc --out $OUT --layers 16 \\
        --compile-blocks                # one H200, the stage's own kernels and row chunks, a few minutes
    python benchmarks/bench_dit_service.py --weights W --out $OUT ...               # an existing checkpoint W
    python benchmarks/bench_dit_service.py --tiny --out /tmp/svc                    # CPU dry run (embedded model)

1. Writes a random checkpoint in the real int8-ConvRot layout with `--layers` blocks (full width; the service
   reads the block count from the file) unless it exists or `--weights` names one.
2. Bench: builds `dit_svc.engine.DiTEngine` in this process with the given kernels / compile / chunk settings
   (the service's own load path) and times the bare forward per shape: median of `--iters` after one warm-up
   (CUDA-synchronised wall time, one step = one DiT evaluation). Its compile cache is a folder of its own.
3. Service, first start: starts the DiT stage process with the same settings and a fresh compile cache, and runs a
   `--steps`-step Sample per shape through the gRPC stubs. From the step events: the first step (compiles for a
   new shape) and the median of the others (the service's s/step), plus SampleDone's ms_per_step.
4. Service, second start: stops it, starts it again on the same compile cache, and repeats 3.
Reports per shape: bench s/step, service s/step (both starts), their ratio (target <= 1.05), and the warm-up
(first step minus a steady step) of each start. Writes <out>/dit_service.json after every phase; a phase or shape
that fails is recorded under "failures" (with its error) and the rest still runs (exit 1 then).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.embedded import EmbeddedStack, StackConfig  # noqa: E402
from dit_svc.engine import DiTEngine, DiTEngineConfig  # noqa: E402
from minimax_h3.contract import RenderSpec  # noqa: E402
from minimax_h3.dit.config import DiTConfig  # noqa: E402
from minimax_h3.dit.layout import build_layout  # noqa: E402
from minimax_h3.kernels.registry import AUTO, default_attention_candidates, default_linear_candidates  # noqa: E402
from minimax_h3.services import Endpoints, StageClients  # noqa: E402
from render_svc.stage_calls import sample  # noqa: E402
from stagekit.checkpoints import WeightSource  # noqa: E402
from stagekit.dist import RankGroup, RankInfo  # noqa: E402

TEXT_LEN = 38  # t2va prompt length of the reference shapes (S = 14,882 at 832x480x124)
T_VIDEO, T_AUDIO = 0.4, 0.55


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stage_args(args, weights: str) -> list[str]:
    out = ["--chunk-rows", str(args.chunk_rows), "--compile-cache", "true"]
    if weights:
        out += ["--weights", weights]
    if not args.tiny:
        out += ["--linear-kernel", args.linear_kernel, "--attention-kernel", args.attention_kernel]
    if args.compile_blocks:
        out += ["--compile-blocks", "true"]
    return out


def bench_engine(args, weights: str, device: str, shapes, out: Path) -> dict:
    """Bare forward s/step through this process's DiTEngine (the service's load path, no gRPC, no sampler)."""
    cfg = DiTEngineConfig(weights=weights, models_dir="", cache_dir=out / "bench-cache", device=device,
                          compute_dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32,
                          linear_kernel="auto" if args.tiny else args.linear_kernel,
                          attention_kernel="auto" if args.tiny else args.attention_kernel,
                          compile_blocks=args.compile_blocks, chunk_rows=args.chunk_rows,
                          compile_cache_dir=out / "bench-cache" / "compile")
    engine = DiTEngine(cfg, RankGroup(RankInfo(0, 1, 0), "gloo", 120.0))
    res: dict = {"kernels": engine.kernel_rows()}
    t0 = time.monotonic()
    engine.load(WeightSource(engine.weight_files()))
    res["load_s"] = time.monotonic() - t0
    mcfg = engine.model_cfg
    for w, h, f in shapes:
        lay = build_layout(mcfg, TEXT_LEN, f, h, w).to(device)
        g = torch.Generator(device=device).manual_seed(1)
        video = torch.randn(lay.num_video_rows, mcfg.video_patch_dim, generator=g, device=device)
        audio = torch.randn(lay.num_audio_rows, mcfg.audio_in_channels, generator=g, device=device)
        text = torch.randn(lay.text_len, mcfg.text_dim, generator=g, device=device).to(cfg.compute_dtype)
        tv, ta = (torch.tensor(t, device=device) for t in (T_VIDEO, T_AUDIO))
        with torch.inference_mode():
            t0 = time.perf_counter()
            engine.model(video, audio, text, tv, ta, lay)
            sync(device)
            first = time.perf_counter() - t0
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                engine.model(video, audio, text, tv, ta, lay)
                sync(device)
                times.append(time.perf_counter() - t0)
        key = f"{w}x{h}x{f}"
        res[key] = {"S": lay.seq_len, "s_per_step": statistics.median(times), "first_s": first}
        log(f"bench {key}: {res[key]}")
    engine.unload()
    del engine
    gc.collect()
    return res


def service_run(args, weights: str, devices: str, shapes, out: Path, start: int) -> dict:
    """One start of the DiT stage process: start-up time, then per shape a Sample and its step times."""
    stack = EmbeddedStack(StackConfig(ranks={"dit": 1}, devices=devices, run_dir=str(out / f"run{start}"),
                                      cache_dir=str(out / "service-cache"), start_timeout_s=900,
                                      extra_args={"dit": stage_args(args, weights)}))
    res: dict = {}
    t0 = time.monotonic()
    stack.start_stage("dit")
    try:
        stack.wait_ready("dit")
        res["startup_s"] = time.monotonic() - t0
        ep = f"127.0.0.1:{stack.ports['dit']}"
        text = torch.randn(TEXT_LEN, args.text_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with StageClients(Endpoints(encoder=ep, dit=ep, decoder=ep)) as c:
            for w, h, f in shapes:
                try:
                    res[f"{w}x{h}x{f}"] = _sample_once(c, args, text, w, h, f, start)
                except Exception as e:  # recorded; the next shape still runs
                    res[f"{w}x{h}x{f}"] = {"error": f"{type(e).__name__}: {e}"}
                    log(f"service start {start} {w}x{h}x{f} FAILED: {type(e).__name__}: {e}")
    finally:
        stack.stop()
    return res


def _sample_once(c, args, text, w: int, h: int, f: int, start: int) -> dict:
    """One `--steps`-step Sample through the stubs; step times from its progress events."""
    events = []
    spec = RenderSpec(prompt="bench", width=w, height=h, frames=f, steps=args.steps, seed=1)
    t1 = time.monotonic()
    _, _, r = sample(c, spec, text, on_progress=events.append)
    steps = [e.step_ms / 1e3 for e in events if e.stage == "dit" and e.step > 0]
    steady = statistics.median(steps[1:]) if len(steps) > 1 else float("nan")
    row = {"wall_s": time.monotonic() - t1, "load_s": r.timing.load_s, "step_s": steps,
           "first_step_s": steps[0] if steps else float("nan"), "s_per_step": steady,
           "warmup_s": steps[0] - steady if steps else float("nan"), "done_ms_per_step": r.extra["ms_per_step"]}
    log(f"service start {start} {w}x{h}x{f}: {json.dumps({k: v for k, v in row.items() if k != 'step_s'})}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for results, run logs and the compile caches")
    ap.add_argument("--weights", default="", help="an existing DiT checkpoint (instead of --models-dir / --layers)")
    ap.add_argument("--models-dir", default="/tmp/h3svc", help="where the random checkpoint is written / found")
    ap.add_argument("--layers", type=int, default=16, help="DiT blocks of the random checkpoint (50 = full size)")
    ap.add_argument("--shapes", default="832x480x124", help="WxHxF list")
    ap.add_argument("--steps", type=int, default=4, help="sampler steps per service Sample (>= 2)")
    ap.add_argument("--iters", type=int, default=3, help="timed bare forwards per shape (median)")
    ap.add_argument("--linear-kernel", default=AUTO, choices=(AUTO, *default_linear_candidates()),
                    help="default: the stage's own (the start-up probe picks)")
    ap.add_argument("--attention-kernel", default=AUTO, choices=(AUTO, *default_attention_candidates()),
                    help="default: the stage's own (the start-up probe picks)")
    ap.add_argument("--compile-blocks", action="store_true")
    ap.add_argument("--chunk-rows", type=int, default=0,
                    help="rows per chunk; 0 (the stage's default) = tuned per GPU architecture")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run with the embedded tiny model")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        device, devices, weights = "cpu", "virt0", args.weights  # '': the embedded tiny model
        shapes = [(256, 256, 22)]
        args.text_dim = DiTConfig.tiny().text_dim
    else:
        if not torch.cuda.is_available():
            print("bench_dit_service.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
            return 2
        device, devices = "cuda:0", "cuda:0"
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        cfg = DiTConfig.full(num_layers=args.layers)
        args.text_dim = cfg.text_dim
        default_path = Path(args.models_dir) / f"minimax_h3_random_{args.layers}l_int8_convrot.safetensors"
        weights_path = Path(args.weights) if args.weights else default_path
        if args.weights and not weights_path.is_file():
            print(f"--weights {args.weights}: no such file", file=sys.stderr)
            return 2
        if not weights_path.exists():
            from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint

            weights_path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            partial = weights_path.with_name(weights_path.name + ".partial")  # never a half-written file in place
            write_random_int8_convrot_checkpoint(cfg, partial, device="cuda", quantize=False)
            partial.replace(weights_path)
            log(f"wrote {weights_path} ({weights_path.stat().st_size / 2**30:.1f} GiB) in "
                f"{time.monotonic() - t0:.0f} s")
        weights = str(weights_path)
    result: dict = {"settings": {k: v for k, v in vars(args).items()}, "shapes": {}, "failures": []}
    if device.startswith("cuda"):
        result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__

    def save():
        (out / "dit_service.json").write_text(json.dumps(result, indent=1, default=str))

    def phase(name, fn, *fargs) -> dict:
        """fn(*fargs) into result[name]; a phase that raises is recorded and the next one still runs."""
        try:
            result[name] = fn(*fargs)
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name} FAILED: {type(e).__name__}: {e}")
        for key, row in result[name].items():
            if isinstance(row, dict) and "error" in row:
                result["failures"].append(f"{name} {key}: {row['error'][:300]}")
        if "error" in result[name]:
            result["failures"].append(f"{name}: {result[name]['error'][:300]}")
        save()
        return result[name]

    phase("bench", bench_engine, args, weights, device, shapes, out)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    for start in (1, 2):
        phase(f"service_start{start}", service_run, args, weights, devices, shapes, out, start)
    for w, h, f in shapes:
        key = f"{w}x{h}x{f}"
        b, s1, s2 = (result[n].get(key, {}) for n in ("bench", "service_start1", "service_start2"))
        bs = b.get("s_per_step")
        result["shapes"][key] = {
            "S": b.get("S"), "bench_s_per_step": bs,
            "service_s_per_step": [s1.get("s_per_step"), s2.get("s_per_step")],
            "service_over_bench": [x.get("s_per_step") / bs if bs and x.get("s_per_step") else None for x in (s1, s2)],
            "service_done_ms_per_step": [s1.get("done_ms_per_step"), s2.get("done_ms_per_step")],
            "warmup_first_start_s": s1.get("warmup_s"), "warmup_second_start_s": s2.get("warmup_s"),
            "startup_s": [result[n].get("startup_s") for n in ("service_start1", "service_start2")]}
    save()

    def f(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    print("\n| shape | S | bench s/step | service s/step (start 1 / 2) | service / bench | warm-up start 1 | "
          "warm-up start 2 |")
    print("|---|---|---|---|---|---|---|")
    for key, r in result["shapes"].items():
        print(f"| {key} | {r['S']} | {f(r['bench_s_per_step'])} | {f(r['service_s_per_step'][0])} / "
              f"{f(r['service_s_per_step'][1])} | {f(r['service_over_bench'][0])} / {f(r['service_over_bench'][1])} "
              f"| {f(r['warmup_first_start_s'], '.1f')} s | {f(r['warmup_second_start_s'], '.1f')} s |")
    if result["failures"]:
        print("FAILURES:\n  " + "\n  ".join(result["failures"]), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
