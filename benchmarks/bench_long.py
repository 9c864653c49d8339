#!/usr/bin/env python
"""Long video on one 22 GB card (docs/long_video.md): renders past one window and an extension, on one H200 held to
22 GiB, full-size random weights in the users' files, Turing numerics, an NVML trace of every process on the card.
The machinery (weights, `scripts/up.sh`, CLI renders, trace and its checks) is benchmarks/one_card.py's. One
invocation per part, each inside --budget-s (540 s); the weights written by the first part are reused by the next:

    python3 benchmarks/bench_long.py --part dit    --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/bench_long.py --part 15s    --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/bench_long.py --part 60s    --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/bench_long.py --part extend --models-dir /tmp/h3models --out $OUT
    .venv/bin/python benchmarks/bench_long.py --part dit --tiny --models-dir /tmp/h3tiny --out /tmp/h3out  # CPU

Parts (4 sampling steps, res_multistep / simple, seed 1, 960x544 canvas, every MP4 --upscale 1920x1080):
  dit     the DiT engine alone (built as the service builds it), under the 22 GiB cap: 15 s (362 frames) in one window
          and in windows (the product's 175-frame continuation windows), then 60 s (1,450 frames) in the picked
          windows: DiT seconds per generated second, peak memory (the 60 s clip's against one window's).
  15s     the product path: `client render --frames 362` (one window), then `--window-frames 175` (windows).
  60s     `client render --frames 1450` (the product picks the windows): 1920x1080, 24 fps, AAC 32 kHz stereo, audio
          and video durations equal, the trace under the cap; its DiT seconds per generated second against the 15s
          part's one-window render (read from bench_long_15s.json in --out when that part ran before).
  extend  a 5 s job (124 frames), then `client extend JOB --seconds 10` (the stitched whole: 364 -> 379 frames).
Per render: wall time, each stage's compute (the stages' event log), DiT seconds per generated second, peak GPU memory
per stage and host RSS (the trace). Outputs in --out: bench_long_<part>.json, trace_<part>.jsonl.gz,
memtrace_<part>.png, bench_<part>.log, stage_logs_<part>.tar.gz. Exit code 1 when an item failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_two_gpu as two  # noqa: E402
from benchmarks import one_card  # noqa: E402
from minimax_h3.contract import FPS, snap_frames  # noqa: E402  (torch-free)

GIB = 2**30
STEPS = 4
UPSCALE = (1920, 1080)
EXTEND_SECONDS = 10
# (key: label, full size, tiny size, extra CLI flags)
RENDERS = {
    "single15": ("960x544x362", (960, 544, 362), (256, 256, 56), []),
    "win15": ("960x544x362 windows", (960, 544, 362), (256, 256, 56), ["--window-frames", "175"]),
    "win60": ("960x544x1450", (960, 544, 1450), (256, 256, 124), []),
    "src5": ("960x544x124", (960, 544, 124), (256, 256, 39), []),
}
TINY_WINDOW = ["--window-frames", "39", "--window-overlap", "22"]  # the tiny clips past one window
# Rough seconds on one H200 held to 22 GiB, 4 steps (DiT ~12.5 s a step at 960x544x362; decode + 1080p mux ~45 s per
# 15 s), swaps included.
EST_RENDER = {"single15": 150, "win15": 140, "win60": 380, "src5": 70, "extend": 130}
EST = {"weights": 150, "stack": 45, "dit": 300}
ITEMS = ("weights", "dit", "stack:int8", *(f"render:{k}" for k in RENDERS), "extend")
PARTS = {"15s": ("single15", "win15"), "60s": ("win60",), "extend": ("src5",)}


class LongBench(one_card.OneCard):
    json_prefix = "bench_long"

    def __init__(self, args):
        super().__init__(args)
        self.results["steps"] = self.steps = STEPS if not self.tiny else one_card.TINY_STEPS

    def size(self, label: str) -> tuple[int, int, int]:
        _, full, tiny, _ = next(r for r in RENDERS.values() if r[0] == label)
        return tiny if self.tiny else full

    def upscale(self, w: int, h: int) -> tuple[int, int]:
        return (2 * w, 2 * h) if self.tiny else UPSCALE

    def long_render(self, key: str) -> dict:
        label, _, _, extra = RENDERS[key]
        w, h, f = self.size(label)
        ow, oh = self.upscale(w, h)
        if self.tiny and key in ("win15", "win60"):
            extra = TINY_WINDOW
        r = self.do_render(key, label, ["--sampler", "res_multistep", "--scheduler", "simple", "--upscale",
                                        f"{ow}x{oh}", *extra])
        mp4 = self.work / "mp4" / f"{self.part}-{key}.mp4"
        if mp4.exists():
            r["mp4"] = one_card.check_mp4(mp4, f, ow, oh)
        return self.with_rates(r, f, f)

    def with_rates(self, r: dict, frames: int, generated: int) -> dict:
        """DiT seconds per generated second and peak GPU memory per stage, from the render's timing and trace."""
        dit = r.get("timing", {}).get("stages", {}).get("dit", {})
        if dit.get("compute_s"):
            r["dit_s_per_generated_s"] = round(dit["compute_s"] * FPS / generated, 3)
        r["frames"], r["generated_frames"] = frames, generated
        r["peak_gib_per_stage"] = (r.get("memory") or {}).get("role_peak_gib")
        r["windows"] = self.job_windows()
        return r

    def job_windows(self) -> str:
        """How the DiT sampled the newest job (`client jobs list` prints a render's windows under it)."""
        rc, out, _ = self.run_cmd([sys.executable, "-m", "client", "jobs", "list", "--limit", "1"], 60,
                                  f"jobs-{self.part}", cwd=self.work)
        lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("windows:")]
        return lines[0] if lines else "one window" if rc == 0 else ""

    def newest_job(self) -> str:
        rc, out, err = self.run_cmd([sys.executable, "-m", "client", "jobs", "list", "--limit", "1"], 60,
                                    f"jobs-{self.part}", cwd=self.work)
        if rc != 0 or not out.strip():
            raise RuntimeError(f"jobs list failed (rc {rc}): {err}")
        return out.split()[0]

    def extend(self) -> dict:
        """`client extend` of the 5 s job by 10 s: one MP4 of the stitched whole."""
        w, h, f = self.size(RENDERS["src5"][0])
        source = self.newest_job()
        ow, oh = self.upscale(w, h)
        seconds = 1 if self.tiny else EXTEND_SECONDS
        total = snap_frames(f + seconds * FPS)
        self.sampler.phase = phase = f"rule:{self.profile}:extend"
        mp4 = self.work / "mp4" / f"{self.part}-extend.mp4"
        mp4.unlink(missing_ok=True)
        t0 = time.time()
        rc, out, err = self.run_cmd([sys.executable, "-m", "client", "extend", source, "--seconds", str(seconds),
                                     "--prompt", "The fox stops at a frozen stream; ice cracks, the crow lands.",
                                     "-o", mp4], max(60.0, self.left_s()), f"extend-{self.part}", cwd=self.work)
        t1 = time.time()
        r: dict = {"source": source, "seconds_added": seconds, "rc": rc, "wall_s": round(t1 - t0, 2),
                   "cli": two.cli_tail(out + err)}
        if rc == 0 and mp4.exists():
            r["mp4"] = one_card.check_mp4(mp4, total, ow, oh)
        else:
            r["error"] = f"extend failed (rc {rc})"
        r["timing"] = two.stage_timing(self.events(), t0, t1)
        samples = [s for s in list(self.sampler.samples) if t0 <= s.t <= t1]
        phase_sum = two.memtrace.summarize(samples).get(phase, {})
        r["memory"] = {k: phase_sum.get(k) for k in ("gpu_peak_gib", "role_peak_gib", "host_rss_peak_gib")}
        return self.with_rates(r, total, total - f)

    def run_dit(self) -> dict:
        self.sampler.phase = "free:dit-engine"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--dit-engine", "--models-dir", str(self.models),
               "--cap-gb", str(self.args.cap_gb)]
        if self.tiny:
            cmd.append("--tiny")
        rc, out, err = self.run_cmd(cmd, timeout_s=max(60.0, self.left_s()), name="dit-engine", env=self.env("int8"))
        if rc != 0:
            raise RuntimeError(f"DiT engine bench failed (rc {rc}): {err}")
        return json.loads(out.strip().splitlines()[-1])

    def run_part(self) -> None:
        if self.part == "dit":
            self.weight_files = {"dit"}
        self.weights_item(EST["weights"])
        if self.part == "dit":
            self.item("dit", EST["dit"], self.run_dit, needs_stack=False)
            return
        self.item("stack:int8", EST["stack"], lambda: self.do_stack("int8"), needs_stack=False)
        for key in PARTS[self.part]:
            self.item(f"render:{key}", EST_RENDER[key], lambda key=key: self.long_render(key))
        if self.part == "extend":
            self.item("extend", EST_RENDER["extend"], self.extend)

    def verdicts(self) -> dict:
        v = two.Bench.verdicts(self)
        for k in ("host_memory_1920_le_64gib", "tp_ranks_bitwise_equal_all_renders", "dit_load_gbps_per_rank"):
            v.pop(k, None)
        if self.part != "dit":
            v.update(self.idle_neighbours())
        items = self.results["items"]
        rates = {k.split(":", 1)[-1]: r.get("dit_s_per_generated_s") for k, r in items.items()
                 if r.get("dit_s_per_generated_s") is not None}
        if rates:
            v["dit_s_per_generated_s"] = rates
        single = rates.get("single15")
        if single is None:  # the 15s part ran before, into the same --out
            prior = self.out / f"{self.json_prefix}_15s.json"
            if prior.exists():
                single = json.loads(prior.read_text())["items"].get("render:single15", {}).get("dit_s_per_generated_s")
        if single and rates.get("win60"):
            v["dit_s_per_generated_s_60s_le_1.0x_single15"] = {"x": round(rates["win60"] / single, 3),
                                                               "ok": rates["win60"] <= single}
        if single and rates.get("win15"):
            v["windows15_over_single15"] = round(rates["win15"] / single, 3)
        for key in ("win60", "extend"):
            key_item = items.get(f"render:{key}") or items.get(key)
            if key_item and key_item.get("mp4"):
                m = key_item["mp4"]
                v[f"{key}_mp4"] = {k: m.get(k) for k in ("width", "height", "frames", "fps", "sample_rate", "channels",
                                                        "video_s", "audio_s", "durations_equal", "ok")}
        d = items.get("dit")
        if d and "error" not in d:
            v["dit_engine"] = d.get("verdicts")
        trace = self.results.get("trace", {})
        if self.part == "dit" and not trace.get("rule_samples"):  # no stack ran: the engine's process is the card
            peak = max((trace.get("max_sum_any_phase_gib") or {}).values(), default=None)
            v.pop("trace_ok", None)
            v["trace_under_cap"] = {"max_gib": peak, "cap_gib": self.args.cap_gb,
                                    "ok": peak is not None and peak <= self.args.cap_gb}
        return v


# =====================================================================================================================
# The DiT engine alone (--dit-engine, a subprocess of --part dit)
# =====================================================================================================================
def dit_engine_bench(models: Path, cap_gb: float, tiny: bool) -> dict:
    """15 s in one window vs in windows, then 60 s in windows, through the DiT engine under the cap (the one-card
    placement): DiT seconds per generated second, s/step (a window's, for windows), peak memory."""
    import torch

    from minimax_h3.contract import FPS, TEXT_STATES, RenderSpec, plan_windows

    eng, cuda, dev, load_s = one_card.loaded_dit_engine(models, tiny)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "load_s": load_s,
                 "steps": STEPS if cuda else one_card.TINY_STEPS, "shapes": {}}
    if cuda:
        cap = int(cap_gb * GIB)
        eng.cfg.memory_cap_bytes, eng.cfg.memory_limit_bytes = cap, cap - GIB
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    text = torch.randn(512 if cuda else 8, eng.model_cfg.text_dim, generator=torch.Generator().manual_seed(0))
    w, h = (960, 544) if cuda else (256, 256)
    runs = ([("15s one window", 362, {}), ("15s windows", 362, {"window_frames": 175}), ("60s windows", 1450, {})]
            if cuda else [("15s one window", 56, {}), ("15s windows", 56, {"window_frames": 39, "window_overlap": 22}),
                          ("60s windows", 124, {"window_frames": 39, "window_overlap": 22})])
    for name, frames, fields in runs:
        spec = RenderSpec(prompt="x", width=w, height=h, frames=frames, steps=out["steps"], seed=1, **fields)
        run = one_card.timed_run(eng, spec, {TEXT_STATES: text}, dev, cuda)
        ctx, wall = run.ctx, run.wall_s
        row = {"size": f"{w}x{h}x{frames}", "windows": plan_windows(spec).describe(),
               "placement": eng.placement.describe(), "sample_s": round(wall, 2),
               "dit_s_per_generated_s": round(wall / (frames / FPS), 3),
               "step_s_median": round(statistics.median(ctx.step_ms) / 1000, 3) if ctx.step_ms else None}
        row.update(run.peaks)
        out["shapes"][name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    s = out["shapes"]
    single, win15, win60 = (s[k]["dit_s_per_generated_s"] for k in ("15s one window", "15s windows", "60s windows"))
    out["verdicts"] = {"windows15_over_single15": round(win15 / single, 3),
                       "dit_s_per_generated_s_60s_le_1.0x_single15": {"x": round(win60 / single, 3),
                                                                      "ok": win60 <= single}}
    if cuda:
        out["verdicts"]["peak_60s_le_peak_15s_windows_plus_0.5gib"] = {
            "gib": (s["60s windows"]["peak_reserved_gib"], s["15s windows"]["peak_reserved_gib"]),
            "ok": s["60s windows"]["peak_reserved_gib"] <= s["15s windows"]["peak_reserved_gib"] + 0.5}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="dit", choices=("dit", *PARTS))
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default="docs/performance_data/long")
    one_card.add_run_args(ap, ITEMS)
    args = ap.parse_args(argv)
    if args.dit_engine:
        print(json.dumps(dit_engine_bench(Path(args.models_dir), args.cap_gb, args.tiny)), flush=True)
        return 0
    args.steps = STEPS
    return two.run(LongBench, args)


if __name__ == "__main__":
    sys.exit(main())
