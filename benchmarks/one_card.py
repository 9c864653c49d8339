#!/usr/bin/env python
"""One 22 GB card, end to end, on one H200 held to 22 GiB: the single-2080 Ti setup (docs/one_card.md).

All four services on one GPU, started and driven the way a user does it (`scripts/up.sh --devices cuda:0
--gpu-memory-cap-gb 22 --residency exclusive`, `python -m client render`), full-size random weights in the users'
files, Turing numerics (int8 linears, fp16), an NVML trace of every process on the card. One invocation per part;
each stays inside --budget-s (default 540 s) so a 10-minute device command returns data, and weights written by the
first part are reused by the next while the machine stays warm:

    python3 benchmarks/one_card.py --part renders --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/one_card.py --part long    --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/one_card.py --part dit     --models-dir /tmp/h3models --out $OUT
    .venv/bin/python benchmarks/one_card.py --part renders --tiny --models-dir /tmp/h3tiny --out /tmp/h3out  # CPU

Parts:
  renders  960x544x73, 20 steps, res_multistep/simple, --upscale 1920x1080; 832x480x124 and 1344x768x124, 8 steps;
           the 832x480x124 render again with the same seed (same final latents, same MP4 bytes).
  long     960x544x362 (the 15 s clip), 20 steps, --upscale 1920x1080: 1920x1080, 24 fps, 362 frames, AAC 32 kHz
           stereo, audio and video durations equal.
  dit      the DiT engine alone (built by dit_svc.engine, the service's own assembly), one process: s/step with every
           block resident (no cap) vs with the one-card placement (22 GiB cap) at 960x544x362 and 960x544x73,
           bitwise-equal final latents, peak memory, bytes streamed per step and the host->device rate; then one TP2
           rank at 1920x1088x362 (S = 219,524; collectives elided) with the same placement under 19.5 GiB.
Exit code 1 when an item failed (named on stderr and in the JSON). Outputs in --out: one_card_<part>.json,
trace_<part>.jsonl.gz, memtrace_<part>.png, bench_<part>.log, stage_logs_<part>.tar.gz. The render parts' checks:
the trace's sum per GPU <= 22 GiB at every sample, one stage holding weights at a time, and every stage that does not
hold the lease at <= 0.1 GiB of the card.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_two_gpu as two  # noqa: E402  (the shared driver: weights, stack, renders, trace)
from benchmarks import memtrace  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

GIB = 2**30
IDLE_NEIGHBOUR_GIB = 0.1
# (key, full size, tiny size, steps, extra CLI flags)
RENDERS = {
    "a": ("960x544x73", (960, 544, 73), (256, 256, 22), 20, ["--upscale", "1920x1080"], (1920, 1080)),
    "c832": ("832x480x124", (832, 480, 124), (256, 256, 22), 8, [], None),
    "c1344": ("1344x768x124", (1344, 768, 124), (288, 256, 22), 8, [], None),
    "b": ("960x544x362", (960, 544, 362), (256, 256, 39), 20, ["--upscale", "1920x1080"], (1920, 1080)),
}
# Rough seconds on one H200 held to 22 GiB, Turing numerics (int8 + cuDNN fp16 attention: 1.2 s/step at 960x544x73,
# 12 s/step at 960x544x362 resident), swaps and decode included.
EST_RENDER = {"a": 75, "c832": 45, "c1344": 90, "b": 380, "parity": 45}
EST = {"weights": 150, "stack": 45, "dit": 240}
ITEMS = ("weights", "dit", "stack:int8", *(f"render:{key}" for key in RENDERS), "parity")  # --only / --skip names
TINY_STEPS = 2


class OneCard(two.Bench):
    """The two-card driver's machinery (weights, up.sh, CLI renders, NVML trace, verdicts) on one device."""

    json_prefix = "one_card"

    def __init__(self, args):
        super().__init__(args)
        self.devices = "virt0" if self.tiny else "cuda:0"
        self.ranks = 1
        self.results["devices"] = self.devices
        self.results.pop("steps", None)

    def size(self, label: str) -> tuple[int, int, int]:
        _, full, tiny, *_ = next(r for r in RENDERS.values() if r[0] == label)
        return tiny if self.tiny else full

    def render(self, key: str, repeat: str = "") -> dict:
        label, full, tiny, steps, extra, upscaled = RENDERS[key]
        w, h, f = tiny if self.tiny else full
        extra = list(extra)
        if self.tiny and upscaled:
            extra, upscaled = ["--upscale", f"{2 * w}x{2 * h}"], (2 * w, 2 * h)
        steps = TINY_STEPS if self.tiny else steps
        r = self.do_render(key + repeat, label, ["--steps", str(steps), "--sampler", "res_multistep",
                                                 "--scheduler", "simple", *extra])
        r["steps"] = steps
        mp4 = self.work / "mp4" / f"{self.part}-{key}{repeat}.mp4"
        if mp4.exists():
            ow, oh = upscaled or (w, h)
            r["mp4"] = check_mp4(mp4, f, ow, oh)
        r["stream"] = self.dit_placement(r)
        return r

    def dit_placement(self, render: dict) -> list[str]:
        """The DiT's placement lines for the render, from its log (what `client status` and the events show)."""
        text = self._tail(self.run / "dit.log", 200_000)
        return [ln.split("] ", 1)[-1][-160:] for ln in text.splitlines() if "planned peak" in ln][-2:]

    def parity(self) -> dict:
        first = self.results["items"].get("render:c832", {})
        again = self.render("c832", repeat="-again")
        lat1, lat2 = first.get("latents", {}).get("jobs", []), again.get("latents", {}).get("jobs", [])
        return {"mp4_identical": bool(first.get("mp4_sha256")) and first.get("mp4_sha256") == again.get("mp4_sha256"),
                "latents_identical": bool(lat1 and lat2) and lat1[-1]["video"] == lat2[-1]["video"]
                and lat1[-1]["audio"] == lat2[-1]["audio"], "again": again}

    def run_dit(self) -> dict:
        self.sampler.phase = "free:dit-engine"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--dit-engine", "--models-dir", str(self.models),
               "--cap-gb", str(self.args.cap_gb)]
        if self.tiny:
            cmd.append("--tiny")
        rc, out, err = self.run_cmd(cmd, timeout_s=max(60.0, self.left_s()), name="dit-engine",
                                    env=self.env("int8"))
        if rc != 0:
            raise RuntimeError(f"DiT engine bench failed (rc {rc}): {err}")
        return json.loads(out.strip().splitlines()[-1])

    def run_part(self) -> None:
        if self.part == "dit":
            self.weight_files = {"dit"}
        need_weights = any(not (self.models / two.FILES[n]).exists() for n in (self.weight_files or two.FILES))
        self.item("weights", EST["weights"] if need_weights else 5, self.do_weights, needs_stack=False)
        if self.part == "dit":
            self.item("dit", EST["dit"], self.run_dit, needs_stack=False)
            return
        self.item("stack:int8", EST["stack"], lambda: self.do_stack("int8"), needs_stack=False)
        keys = ["a", "c832", "c1344"] if self.part == "renders" else ["b"]
        for key in keys:
            self.item(f"render:{key}", EST_RENDER[key], lambda key=key: self.render(key))
        if self.part == "renders":
            self.item("parity", EST_RENDER["parity"], self.parity)

    def verdicts(self) -> dict:
        v = super().verdicts()
        v.pop("host_memory_1920_le_64gib", None)
        v.pop("tp_ranks_bitwise_equal_all_renders", None)  # one rank
        items = self.results["items"]
        samples = list(self.sampler.samples)
        if samples:
            v["idle_neighbours_le_0.1gib"] = memtrace.check_idle_neighbours(
                samples, int(IDLE_NEIGHBOUR_GIB * GIB), rule_phase=two.held_to_cap)
        b = items.get("render:b")
        if b and b.get("memory", {}).get("host_rss_peak_gib") is not None:
            rss = b["memory"]["host_rss_peak_gib"]
            v["host_rss_15s_clip_le_48gib"] = {"rss_gib": rss, "ok": rss <= 48}
        if b and b.get("mp4"):
            m = b["mp4"]
            v["clip_15s"] = {k: m.get(k) for k in ("width", "height", "frames", "fps", "sample_rate", "channels",
                                                    "video_s", "audio_s", "durations_equal", "ok")}
        if "parity" in items and "error" not in items["parity"]:
            p = items["parity"]
            v["seed_parity"] = {"mp4_identical": p["mp4_identical"], "latents_identical": p["latents_identical"]}
        d = items.get("dit")
        if d and "error" not in d:
            v["streaming_step_le_1.10x_resident"] = {k: r.get("streamed_over_resident") for k, r in
                                                     d.get("shapes", {}).items()}
            v["streamed_equals_resident_bitwise"] = all(r.get("bitwise_equal") for r in d.get("shapes", {}).values())
            tp2 = d.get("tp2_rank", {})
            if tp2.get("peak_reserved_gib") is not None:
                v["tp2_rank_1920x1088x362_le_19.5gib"] = {"reserved_gib": tp2["peak_reserved_gib"],
                                                          "ok": tp2["peak_reserved_gib"] <= 19.5}
        return v

    def save(self) -> None:
        path = self.out / f"{self.json_prefix}_{self.part}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str, ensure_ascii=False))
        tmp.replace(path)


def check_mp4(path: Path, frames: int, width: int, height: int) -> dict:
    """two.check_mp4 plus frame rate and the audio and video durations (decoded samples / rate, frames / fps)."""
    import av

    out = two.check_mp4(path, frames, width, height)
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        out["fps"] = float(v.average_rate) if v.average_rate else None
        samples = sum(fr.samples for fr in c.decode(c.streams.audio[0])) if c.streams.audio else 0
    if out.get("fps") and out.get("sample_rate"):
        out["video_s"] = round(out["frames"] / out["fps"], 4)
        out["audio_s"] = round(samples / out["sample_rate"], 4)
        out["durations_equal"] = abs(out["video_s"] - out["audio_s"]) < 1.0 / out["fps"]
    out["ok"] = bool(out["ok"] and out.get("fps") == 24.0 and out.get("durations_equal"))
    return out


# =====================================================================================================================
# The DiT engine alone (--dit-engine, a subprocess of --part dit)
# =====================================================================================================================
class _Ctx:
    """A job context for the engine outside a service: records step times, never stops."""

    def __init__(self):
        self.step_ms: list[float] = []
        self.messages: list[str] = []

    def progress(self, step, total, phase="running", message="", step_ms=0.0):
        if step > 0:
            self.step_ms.append(step_ms)
        if message:
            self.messages.append(message)

    def should_stop(self) -> bool:
        return False


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def dit_engine_bench(models: Path, cap_gb: float, tiny: bool) -> dict:
    # As every stage process does before its first CUDA allocation (stagekit/stage.py): reserved tracks allocated.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from minimax_h3.contract import AUDIO_LATENTS, TEXT_STATES, VIDEO_LATENTS, RenderSpec
    from stagekit.dist import RankGroup, RankInfo

    cuda = torch.cuda.is_available() and not tiny
    dev = "cuda:0" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    kw = dict(linear_kernel="int8", attention_kernel="auto") if cuda else {}
    cfg = DiTEngineConfig(str(models / two.FILES["dit"]), "", models / "cache", dev, dtype, **kw)
    eng = DiTEngine(cfg, RankGroup(RankInfo(0, 1, 0), "gloo", 600))
    t0 = time.monotonic()
    eng.load()
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "load_s": round(time.monotonic() - t0, 2),
                 "kernels": eng.kernel_rows(), "weights_gib": round(eng.resident_bytes() / GIB, 3),
                 "block_gib": round(eng.stream.block_bytes / GIB, 4), "shapes": {}}
    text = torch.randn(512 if cuda else 8, eng.model_cfg.text_dim, generator=torch.Generator().manual_seed(0))
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else 0
    shapes = [(960, 544, 362), (960, 544, 73)] if cuda else [(256, 256, 39), (256, 256, 22)]
    steps = 3 if cuda else 2
    for w, h, f in shapes:
        spec = RenderSpec(prompt="x", width=w, height=h, frames=f, steps=steps, seed=1)
        row: dict = {}
        results = {}
        for mode in ("resident", "streamed"):
            if mode == "streamed":
                cap = int(cap_gb * GIB)
                if cuda:
                    eng.cfg.memory_cap_bytes, eng.cfg.memory_limit_bytes = cap, cap - GIB
                    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
                elif eng.model_cfg.num_layers > 2:  # CPU: a limit that streams all but one block
                    p = eng.plan(spec, text.shape[0], None)
                    eng.cfg.memory_limit_bytes = p.need_bytes - (eng.model_cfg.num_layers - 3) * eng.stream.block_bytes
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            copied0 = eng.stream.bytes_copied
            ctx = _Ctx()
            t0 = time.monotonic()
            res = eng.run(spec, {TEXT_STATES: text}, ctx)
            wall = time.monotonic() - t0
            p = eng.placement
            per_step = sorted(ctx.step_ms[1:] or ctx.step_ms)
            row[mode] = {"placement": p.describe(), "streamed_blocks": list(p.streamed),
                         "room_gib": round(p.room_bytes / GIB, 3), "planned_peak_gib": round(p.need_bytes / GIB, 3),
                         "step_s": round(statistics.median(per_step) / 1000, 4), "steps_ms": ctx.step_ms,
                         "wall_s": round(wall, 2), "streamed_gib_per_step": round(
                             (eng.stream.bytes_copied - copied0) / max(1, steps) / GIB, 3)}
            if cuda:
                row[mode].update(peak_alloc_gib=round(torch.cuda.max_memory_allocated(dev) / GIB, 3),
                                 peak_reserved_gib=round(torch.cuda.max_memory_reserved(dev) / GIB, 3))
            results[mode] = (_sha(res[VIDEO_LATENTS]), _sha(res[AUDIO_LATENTS]))
            eng.cfg.memory_cap_bytes = eng.cfg.memory_limit_bytes = 0
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
        row["bitwise_equal"] = results["resident"] == results["streamed"]
        row["latents_sha256"] = {k: v[0][:16] for k, v in results.items()}
        row["streamed_over_resident"] = round(row["streamed"]["step_s"] / row["resident"]["step_s"], 4)
        out["shapes"][f"{w}x{h}x{f}"] = row
        print(json.dumps({f"{w}x{h}x{f}": row})[:2000], file=sys.stderr, flush=True)
    if cuda:
        out["h2d"] = h2d_rate(eng.stream.block_bytes, dev)
        eng.unload()
        torch.cuda.empty_cache()
        out["tp2_rank"] = tp2_rank_memory(dev)
    return out


def h2d_rate(nbytes: int, dev) -> dict:
    """One block's pinned host->device copy on a side stream, alone (events; median of 5)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            a.record()
            slot.copy_(host, non_blocking=True)
            b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    t = statistics.median(times[1:])
    return {"block_bytes": nbytes, "copy_s": round(t, 5), "gb_per_s": round(nbytes / t / 1e9, 2)}


def tp2_rank_memory(dev, room_gib: float = 19.5) -> dict:
    """One TP2 rank (half the heads and ffn, collectives elided: benchmarks/bench_dit.py memory mode's rank) at
    1920x1088x362 with the engine's placement rule under `room_gib`: blocks up to the third streamed one run."""
    import torch
    import torch.nn as nn

    from benchmarks import bench_dit
    from dit_svc.engine import activation_bytes, resolve_chunk_rows
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.streaming import BlockStream, plan_placement
    from minimax_h3.kernels.registry import default_attention_candidates
    from minimax_h3.kernels.tuning import arch_key

    cfg = DiTConfig.full(adaln_form="curve")
    chunk_rows = resolve_chunk_rows(0, compile_blocks=False, tp_size=2, arch=arch_key(dev))  # the engine's, eager
    model = bench_dit.build_tp_rank(cfg, 2, dev, chunk_rows, seed=0)
    model.set_attention_fn(default_attention_candidates()["cudnn"].make_fn())
    torch.cuda.empty_cache()
    stream = BlockStream(model.blocks, dev)
    weights = torch.cuda.memory_allocated(dev)
    shape = (1920, 1088, 362)
    lay, video, audio, text = bench_dit.inputs_for(cfg, shape, dev)
    free, total = torch.cuda.mem_get_info(dev)
    outside = (total - free) - torch.cuda.memory_reserved(dev)
    act = activation_bytes(cfg, lay.seq_len, torch.bfloat16, chunk_rows, tp=2)
    other = weights - sum(stream.sizes)
    room = int(room_gib * GIB) - outside - (512 << 20)
    p = plan_placement(cfg.num_layers, stream.block_bytes, other, act, room, what="a TP2 rank at 1920x1088x362")
    stream.apply(p)
    model.block_stream = stream
    third = p.streamed[min(2, len(p.streamed) - 1)] if p.streamed else 2
    all_blocks = model.blocks
    model.blocks = nn.ModuleList(list(all_blocks)[: third + 1])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.monotonic()
    with torch.inference_mode():
        v, a = model(video, audio, text, bench_dit.T_VIDEO, bench_dit.T_AUDIO, lay)
    torch.cuda.synchronize()
    return {"S": lay.seq_len, "placement": p.describe(), "room_gib": round(room / GIB, 3),
            "context_and_others_gib": round(outside / GIB, 3), "planned_peak_gib": round(p.need_bytes / GIB, 3),
            "blocks_run": third + 1, "weights_gib": round(weights / GIB, 3),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated(dev) / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / GIB, 3),
            "finite": bool(torch.isfinite(v).all() and torch.isfinite(a).all()),
            "forward_s": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="renders", choices=("renders", "long", "dit"))
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default="out/one_card")
    ap.add_argument("--work-dir", default="", help="run dirs, MP4s, logs (default /tmp/h3bench[-tiny])")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny weights, virtual devices")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no item that would end past this")
    ap.add_argument("--cap-gb", type=float, default=22.0, help="the card: all our processes on the GPU together")
    ap.add_argument("--period-s", type=float, default=0.25, help="memory sampling period")
    ap.add_argument("--context-gib", type=float, default=0.5, help="a bare CUDA context, when none was measured")
    ap.add_argument("--holder-margin-gib", type=float, default=1.5,
                    help="a process holds weights when above its idle footprint by more than this")
    ap.add_argument("--only", default="", type=comma_choices(ITEMS), help="comma-separated items to run")
    ap.add_argument("--skip", default="", type=comma_choices(ITEMS), help="comma-separated items to skip")
    ap.add_argument("--dit-engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dit_engine:
        print(json.dumps(dit_engine_bench(Path(args.models_dir), args.cap_gb, args.tiny)), flush=True)
        return 0
    args.steps = 0
    return two.run(OneCard, args)


if __name__ == "__main__":
    sys.exit(main())
