#!/usr/bin/env python
"""One ref2va render through the product on one GPU: full-size random weights in the users' files, two image
references, 1344x768x124 (docs/references.md).

The models folder gets what is missing of: the ref2va DiT (`minimax_h3_ref2va_pruned_int8_convrot.safetensors`,
random int8 ConvRot, curve-form AdaLN), the Qwen3-VL text encoder (NVFP4), the video and audio VAEs. The stack starts
as a user starts it (`scripts/up.sh --devices cuda:0 --residency exclusive`), the render is the CLI's
(`python -m client render --ref a.png --ref b.png`), and the result is checked (H.264 1344x768, 124 frames, AAC
32 kHz stereo) with the stages' own timings from the render service:

    python3 benchmarks/ref2va_render.py --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/ref2va_render.py --tiny --models-dir /tmp/h3tiny --out /tmp/ref2va   # CPU dry run

Writes --out/ref2va_render.json (the MP4 check, wall time, per-stage timings, the CLI's output) and the stage logs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_two_gpu as two  # noqa: E402  (weights, MP4 check, stage timings, safe NCCL env)
from minimax_h3.contract import REF2VA  # noqa: E402

DIT_FILE = "minimax_h3_ref2va_pruned_int8_convrot.safetensors"
DIT_SEED = 1  # another draw than the fl2va file's: the partitions differ in weights
PROMPT = ("<Picture 1> and <Picture 2> dance in a sunlit courtyard while a brass band plays; the camera circles "
          "them slowly.")
FULL, TINY = (1344, 768, 124), (256, 256, 22)


def write_models(models: Path, tiny: bool) -> dict:
    """Whatever is missing of the text encoder, VAEs and the ref2va DiT (each written under a temp name)."""
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint, write_tiny_checkpoint

    t0 = time.monotonic()
    out = two.write_weights(models, tiny, {"te", "video_vae", "audio_vae"})
    target = models / DIT_FILE
    if not target.exists():
        tmp = target.with_name(f".{target.name}.tmp")
        if tiny:
            write_tiny_checkpoint(DiTConfig.tiny(), tmp, "int8_convrot_pruned", seed=DIT_SEED, partition=REF2VA)
        else:
            write_random_int8_convrot_checkpoint(DiTConfig.full(), tmp, seed=DIT_SEED, device="cuda", quantize=False,
                                                 pruned=True, partition=REF2VA)
        tmp.replace(target)
    out["dit_ref2va_gib"] = round(target.stat().st_size / 2**30, 3)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def reference_images(folder: Path) -> list[Path]:
    """Two synthetic subjects (PNG, 1024x1024 and 768x1152): smooth gradients with a disc, like a product shot."""
    import numpy as np
    from PIL import Image

    paths = []
    for i, (w, h) in enumerate(((1024, 1024), (768, 1152))):
        yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
        disc = ((xx - 0.5) ** 2 + (yy - 0.5) ** 2) < 0.08
        rgb = np.stack([xx, yy, 1 - xx], -1) * 200 + 30
        rgb[disc] = (220, 120 + 60 * i, 40)
        buf = io.BytesIO()
        Image.fromarray(rgb.astype(np.uint8)).save(buf, "PNG")
        paths.append(folder / f"subject{i + 1}.png")
        paths[-1].write_bytes(buf.getvalue())
    return paths


def run(cmd: list, env: dict, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default="out/ref2va")
    ap.add_argument("--work-dir", default="", help="run dir, references, MP4 (default /tmp/h3ref2va[-tiny])")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny weights, a virtual device")
    ap.add_argument("--steps", type=int, default=0, help="sampling steps (default 8; 2 with --tiny)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit still stops the stack (finally below)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models_dir).resolve()
    work = Path(args.work_dir or f"/tmp/h3ref2va{'-tiny' if args.tiny else ''}").resolve()
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    w, h, f = TINY if args.tiny else FULL
    steps = args.steps or (2 if args.tiny else 8)
    env = {**os.environ, **two.NCCL_SAFE, **two.ENCODER_ENV, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "protos"), os.environ.get("PYTHONPATH")]))}
    result: dict = {"size": f"{w}x{h}x{f}", "steps": steps, "seed": args.seed, "prompt": PROMPT, "tiny": args.tiny}
    result["weights"] = write_models(models, args.tiny)
    refs = reference_images(work)
    models_flag = ["--models-dir", models]
    if args.tiny:  # the tiny folder's text encoder is not the 32B layout: the encoder runs its embedded model
        models_flag = []
        env.update(H3_DIT_MODELS_DIR=str(models), H3_DECODER_MODELS_DIR=str(models), OMP_NUM_THREADS="2",
                   H3_ENCODER_CACHE_DIR=str(work / "cache"))
    up = ["bash", ROOT / "scripts/up.sh", "--run-dir", run_dir, *models_flag,
          "--devices", "virt0" if args.tiny else "cuda:0", "--residency", "exclusive", "--encoder-port", "0",
          "--dit-port", "0", "--decoder-port", "0", "--render-port", "0", "--web-port", "-1"]
    t0 = time.monotonic()
    r = run(up, env, work, 620)
    result["stack"] = {"rc": r.returncode, "start_s": round(time.monotonic() - t0, 1)}
    try:
        if r.returncode != 0:
            result["stack"]["stderr"] = r.stderr[-3000:]
            raise SystemExit(f"up.sh failed: {r.stderr[-2000:]}")
        mp4 = work / "ref2va.mp4"
        mp4.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "client", "render", "--prompt", PROMPT, "--ref", refs[0], "--ref", refs[1],
               "-o", mp4, "--width", w, "--height", h, "--frames", f, "--steps", steps, "--seed", args.seed]
        t1 = time.time()
        r = run(cmd, env, work, 3600)  # cwd = work: the CLI reads run/endpoints.env as a user's would
        t2 = time.time()
        result["render"] = {"rc": r.returncode, "wall_s": round(t2 - t1, 2), "cli": two.cli_tail(r.stdout + r.stderr,
                                                                                                  30)}
        if r.returncode == 0 and mp4.exists():
            result["render"]["mp4"] = two.check_mp4(mp4, f, w, h)
            shutil.copy(mp4, out / "ref2va.mp4")
        from stagekit.lease import read_events

        result["render"]["timing"] = two.stage_timing(read_events(run_dir / "leases"), t1, t2)
    finally:
        run(["bash", ROOT / "scripts/down.sh", "--run-dir", run_dir, "--grace", "20"], env, work, 120)
        for log in run_dir.glob("*.log"):
            shutil.copy(log, out / log.name)
        (out / "ref2va_render.json").write_text(json.dumps(result, indent=1))
    ok = result.get("render", {}).get("mp4", {}).get("ok", False)
    print(json.dumps({"ok": ok, **{k: result[k] for k in ("size", "steps")},
                      "wall_s": result.get("render", {}).get("wall_s")}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
