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
  fast     832x480x124, 8 steps, `--quality exact` then `--quality fast` (step caching): wall time, the DiT's
           compute, the steps cached (the CLI's summary line), the 22 GiB rule.
  long     960x544x362 (the 15 s clip), 20 steps, --upscale 1920x1080: 1920x1080, 24 fps, 362 frames, AAC 32 kHz
           stereo, audio and video durations equal.
  swaps    the stage swaps of a render queue, two stacks in one run: stages that read their files each turn (the
           host "short of memory", MemAvailable injected) render 832x480x124 twice, then stages that keep their files
           in host memory (stagekit/host_copy.py) render it three times. Per load: bytes, load_s, the worker's
           start-up; per render: the swap share; every MP4 byte-identical; the host->device rates behind them.
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
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
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
    "c832fast": ("832x480x124 fast", (832, 480, 124), (256, 256, 22), 8, ["--quality", "fast"], None),
    "c1344": ("1344x768x124", (1344, 768, 124), (288, 256, 22), 8, [], None),
    "b": ("960x544x362", (960, 544, 362), (256, 256, 39), 20, ["--upscale", "1920x1080"], (1920, 1080)),
}
# Rough seconds on one H200 held to 22 GiB, Turing numerics (int8 + cuDNN fp16 attention: 1.2 s/step at 960x544x73,
# 12 s/step at 960x544x362 resident), swaps and decode included.
EST_RENDER = {"a": 75, "c832": 45, "c832fast": 40, "c1344": 90, "b": 380, "parity": 45}
EST = {"weights": 150, "stack": 45, "dit": 240, "h2d": 20}
# The swaps part: (stack mode, renders of 832x480x124 in it). "files": MemAvailable injected below the reserve.
SWAP_MODES = (("files", 2), ("copies", 3))
SWAP_RENDERS = tuple(f"render:{mode}{i}" for mode, n in SWAP_MODES for i in range(1, n + 1))
ITEMS = ("weights", "dit", "stack:int8", *(f"render:{key}" for key in RENDERS), "parity",
         *(f"stack:{mode}" for mode, _ in SWAP_MODES), *SWAP_RENDERS, "h2d")  # --only / --skip names
# PCIe 3.0 x16 (a 2080 Ti): 15.75 GB/s raw; ~12.5 GB/s is what pinned host->device copies reach in practice.
PCIE3_GBPS = 12.5
GROW_TO_GIB = 48
TINY_STEPS = 2


class OneCard(two.Bench):
    """The two-card driver's machinery (weights, up.sh, CLI renders, NVML trace, verdicts) on one device."""

    json_prefix = "one_card"

    def __init__(self, args):
        super().__init__(args)
        self.devices = "virt0" if self.tiny else "cuda:0"
        self.swap_mode = ""  # the swaps part: "files" or "copies", for the stack being started
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

    def env(self, profile: str | None = None) -> dict:
        env = super().env(profile)
        if self.swap_mode == "files":  # a host too short of memory to keep a copy: today's path
            from stagekit.host_copy import MEM_AVAILABLE_ENV

            env[MEM_AVAILABLE_ENV] = "0"
        return env

    def swap_render(self, mode: str, i: int) -> dict:
        """832x480x124, 8 steps, seed 1 (the prompt cached after the first): the render and every load in it."""
        t0 = time.time()
        r = self.render("c832", repeat=f"-{mode}{i}")
        t1 = time.time()
        loads = []
        for ev in self.events():
            if ev.get("event") == "loaded" and t0 <= ev["t"] <= t1:
                start = ev.get("worker_start_s", 0.0)
                bytes_ = ev.get("bytes", 0)
                loads.append({"stage": ev.get("stage"), "bytes": bytes_, "load_s": round(ev["load_s"], 3),
                              "worker_start_s": round(start, 3), "worker_start": ev.get("worker_start"),
                              "host_copy_gib": round(ev.get("host_copy_bytes", 0) / GIB, 2),
                              "phases": ev.get("load_phases", {}),
                              "weights_gbps": round(bytes_ / max(1e-6, ev["load_s"] - start) / 1e9, 2)})
        r["loads"] = loads
        r["host"] = host_meminfo()
        return r

    def run_swaps(self) -> None:
        if not self.tiny:  # GPU rates, while the card is free
            self.item("h2d", EST["h2d"], self.run_h2d, needs_stack=False)
        for mode, n in SWAP_MODES:
            self.swap_mode = mode
            if mode == "copies" and not self.tiny:
                self.results["host_before_copies"] = grow_host_memory(GROW_TO_GIB)
            self.item(f"stack:{mode}", EST["stack"], lambda mode=mode: self.do_stack("int8"), needs_stack=False)
            for i in range(1, n + 1):
                self.item(f"render:{mode}{i}", EST_RENDER["c832"] + (20 if i == 1 else 0),
                          lambda mode=mode, i=i: self.swap_render(mode, i))
        self.do_down()

    def run_h2d(self) -> dict:
        self.sampler.phase = "free:h2d"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--h2d"]
        rc, out, err = self.run_cmd(cmd, timeout_s=max(30.0, self.left_s()), name="h2d", env=self.env("int8"))
        if rc != 0:
            raise RuntimeError(f"host->device rates failed (rc {rc}): {err}")
        return json.loads(out.strip().splitlines()[-1])

    def weights_item(self, est_s: float) -> None:
        """The weights item: the part's files (`weight_files`, else all) written, unless --models-dir has them."""
        need = any(not (self.models / two.FILES[n]).exists() for n in (self.weight_files or two.FILES))
        self.item("weights", est_s if need else 5, self.do_weights, needs_stack=False)

    def run_part(self) -> None:
        if self.part == "dit":
            self.weight_files = {"dit"}
        self.weights_item(EST["weights"])
        if self.part == "swaps":
            self.run_swaps()
            return
        if self.part == "dit":
            self.item("dit", EST["dit"], self.run_dit, needs_stack=False)
            return
        self.item("stack:int8", EST["stack"], lambda: self.do_stack("int8"), needs_stack=False)
        keys = {"renders": ["a", "c832", "c1344"], "fast": ["c832", "c832fast"]}.get(self.part, ["b"])
        for key in keys:
            self.item(f"render:{key}", EST_RENDER[key], lambda key=key: self.render(key))
        if self.part == "renders":
            self.item("parity", EST_RENDER["parity"], self.parity)

    def idle_neighbours(self) -> dict:
        """The verdict that stages not holding the card stayed at <= IDLE_NEIGHBOUR_GIB at every sample."""
        samples = list(self.sampler.samples)
        if not samples:
            return {}
        return {"idle_neighbours_le_0.1gib": memtrace.check_idle_neighbours(
            samples, int(IDLE_NEIGHBOUR_GIB * GIB), rule_phase=two.held_to_cap)}

    def verdicts(self) -> dict:
        v = super().verdicts()
        v.pop("host_memory_1920_le_64gib", None)
        v.pop("tp_ranks_bitwise_equal_all_renders", None)  # one rank
        items = self.results["items"]
        v.update(self.idle_neighbours())
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
        if self.part == "swaps":
            v.update(swap_verdicts(items))
        if self.part == "fast":
            v["fast_vs_exact"] = fast_verdict(items)
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


def fast_verdict(items: dict) -> dict:
    """`--quality fast` against `exact` on the same render: the DiT's compute of each and the steps cached (the
    CLI's summary line `dit: ..., cached_steps=N`)."""
    runs = {"exact": items.get("render:c832", {}), "fast": items.get("render:c832fast", {})}
    dit = {k: r.get("timing", {}).get("stages", {}).get("dit", {}).get("compute_s") for k, r in runs.items()}
    cached = {k: int(m.group(1)) if (m := re.search(r"cached_steps=(\d+)", r.get("cli", ""))) else None
              for k, r in runs.items()}
    ratio = dit["fast"] / dit["exact"] if dit["exact"] and dit["fast"] else None
    return {"dit_compute_s": dit, "fast_over_exact": ratio and round(ratio, 3), "cached_steps": cached,
            "ok": all("error" not in r for r in runs.values()) and cached["exact"] == 0}


def host_meminfo() -> dict:
    """The host's MemAvailable and shared memory (the stages' host copies live there), GiB."""
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            k, v = line.split(":", 1)
            if k in ("MemAvailable", "Shmem", "MemTotal"):
                out[k] = round(int(v.split()[0]) * 1024 / GIB, 2)
    return out


def grow_host_memory(target_gib: float) -> dict:
    """A VM whose memory starts small and grows as it is used (the GPU hosts here: MemTotal reads ~31 GiB at boot
    of a 128 GiB machine) under-reports MemAvailable until something has used the memory: touch up to `target_gib`
    in a child (freed when it exits) so the stages decide from what the machine has. Returns meminfo before/after."""
    before = host_meminfo()
    if before.get("MemAvailable", 0) < target_gib:
        code = ("import numpy as np\nblocks=[]\n"
                f"for _ in range({int(target_gib)}):\n    blocks.append(np.ones(1 << 30, np.uint8))\n")
        subprocess.run([sys.executable, "-c", code], check=False, timeout=240)
    return {"before": before, "after": host_meminfo(), "target_gib": target_gib}


def swap_verdicts(items: dict) -> dict:
    """The swaps part against its goals: the DiT's loads from the host copy (2nd and later renders of the copies stack)
    >= 10 GB/s of weights over load_s less the worker's start-up, that start-up <= 3 s, the render's swap share
    <= 0.25, every MP4 byte-identical to the files stack's; and what the same bytes take on PCIe 3.0 x16."""
    v: dict = {}
    renders = {k.split(":")[1]: r for k, r in items.items() if k in SWAP_RENDERS and "error" not in r}
    shas = {k: r.get("mp4_sha256") for k, r in renders.items()}
    v["mp4_identical_files_vs_copies"] = {"sha256": shas, "ok": len(shas) == len(SWAP_RENDERS)
                                          and len(set(shas.values())) == 1 and None not in shas.values()}
    later = [r for k, r in renders.items() if k.startswith("copies") and k != "copies1"]
    dit = [ld for r in later for ld in r.get("loads", []) if ld["stage"] == "dit"]
    if dit:
        v["dit_later_loads_ge_10gbps"] = {"gbps": [ld["weights_gbps"] for ld in dit],
                                          "ok": min(ld["weights_gbps"] for ld in dit) >= 10}
        v["dit_turn_startup_le_3s"] = {"s": [ld["worker_start_s"] for ld in dit],
                                       "ok": max(ld["worker_start_s"] for ld in dit) <= 3}
        b = statistics.median(ld["bytes"] for ld in dit)
        start = statistics.median(ld["worker_start_s"] for ld in dit)
        v["pcie3_x16_prediction"] = {
            "assumption_gbps": PCIE3_GBPS, "dit_weights_gib": round(b / GIB, 2),
            "dit_copy_s": round(b / PCIE3_GBPS / 1e9, 2), "dit_load_s_with_startup": round(b / PCIE3_GBPS / 1e9
                                                                                          + start, 2)}
    shares = {k: r.get("timing", {}).get("swap_share") for k, r in renders.items()}
    v["swap_share"] = shares
    later_shares = [shares[k] for k in shares if k.startswith("copies") and k != "copies1"]
    v["swap_share_le_0.25_copies"] = {"values": later_shares, "ok": bool(later_shares) and all(
        s is not None and s <= 0.25 for s in later_shares)}
    return v


def own_card_gib() -> float | None:
    """GPU memory NVML attributes to this process (0 without a CUDA context); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        return round(sum(p.usedGpuMemory or 0 for p in procs if p.pid == os.getpid()) / GIB, 3)
    except Exception:  # noqa: BLE001 - a reading, not a requirement
        return None


def h2d_rates() -> dict:
    """Host->device rates on this machine, 2 GiB each: pageable memory, pinned memory, a memfd mapping moved by
    `to_device` (pinned staging, 8 threads as the DiT loader runs it), and cudaHostRegister of that mapping (its
    cost, then the copy)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from dit_svc.engine import DiTEngine
    from stagekit.host_copy import Staging

    out: dict = {}
    # What a DiT worker on standby does (its kernel library's import) must leave it without a context on the card.
    t0 = time.perf_counter()
    DiTEngine.prepare_process()
    out["standby_import_s"] = round(time.perf_counter() - t0, 2)
    out["standby_card_gib"] = own_card_gib()
    dev = torch.device("cuda:0")
    n = 2 * GIB
    out["bytes"] = n

    def rate(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return round(n / (time.perf_counter() - t0) / 1e9, 2)

    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pageable = torch.ones(n, dtype=torch.uint8)
    out["pageable_gbps"] = rate(lambda: dst.copy_(pageable))
    del pageable
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    out["pinned_gbps"] = rate(lambda: dst.copy_(pinned, non_blocking=True))
    del pinned
    fd = os.memfd_create("h3-h2d")
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n)
    view = torch.frombuffer(mm, dtype=torch.uint8)
    view.fill_(1)
    parts = view.chunk(64)
    staging = Staging()
    with ThreadPoolExecutor(8) as pool:
        out["memfd_staged_8_threads_gbps"] = rate(lambda: list(pool.map(lambda p: staging.to_device(p, dev), parts)))
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(view.data_ptr(), n, 0)
    out["host_register_s_per_gib"] = round((time.perf_counter() - t0) / (n / GIB), 3)
    out["host_register_error"] = int(err)
    if int(err) == 0:
        out["memfd_registered_gbps"] = rate(lambda: dst.copy_(view, non_blocking=True))
        cudart.cudaHostUnregister(view.data_ptr())
    del view, parts
    mm.close()
    os.close(fd)
    out["device"] = torch.cuda.get_device_name(dev)
    return out


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


@dataclass(frozen=True)
class TimedRun:
    """One engine job run outside a service (`timed_run`): its outputs, its context (step times), its wall seconds,
    and the device's peak memory over it (`peak_alloc_gib`, `peak_reserved_gib`; empty on the CPU)."""

    result: dict
    ctx: _Ctx
    wall_s: float
    peaks: dict


def timed_run(eng, spec, inputs: dict, dev, cuda: bool) -> TimedRun:
    """`eng.run(spec, inputs)` timed, the device's peak-memory counters reset first (cached blocks freed)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    ctx = _Ctx()
    t0 = time.monotonic()
    result = eng.run(spec, inputs, ctx)
    wall = time.monotonic() - t0
    peaks = ({"peak_alloc_gib": round(torch.cuda.max_memory_allocated(dev) / GIB, 3),
              "peak_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / GIB, 3)} if cuda else {})
    return TimedRun(result, ctx, wall, peaks)


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def loaded_dit_engine(models: Path, tiny: bool, dit_file: Path | None = None):
    """(engine, cuda, device, load seconds): the DiT stage's engine over `models`' DiT file (or `dit_file`), loaded on
    one card as a 22 GB Turing card runs it (int8 linears, fp16), or on the CPU (tiny)."""
    # As every stage process does before its first CUDA allocation (stagekit/stage.py): reserved tracks allocated.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from dit_svc.engine import DiTEngine, DiTEngineConfig
    from stagekit.checkpoints import WeightSource
    from stagekit.dist import RankGroup, RankInfo

    cuda = torch.cuda.is_available() and not tiny
    dev = "cuda:0" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    kw = dict(linear_kernel="int8", attention_kernel="auto") if cuda else {}
    cfg = DiTEngineConfig(str(dit_file or models / two.FILES["dit"]), "", models / "cache", dev, dtype, **kw)
    eng = DiTEngine(cfg, RankGroup(RankInfo(0, 1, 0), "gloo", 600))
    t0 = time.monotonic()
    eng.load(WeightSource(eng.weight_files()))
    return eng, cuda, dev, round(time.monotonic() - t0, 2)


def dit_engine_bench(models: Path, cap_gb: float, tiny: bool) -> dict:
    import torch

    from minimax_h3.contract import AUDIO_LATENTS, TEXT_STATES, VIDEO_LATENTS, RenderSpec

    eng, cuda, dev, load_s = loaded_dit_engine(models, tiny)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "load_s": load_s,
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
            copied0 = eng.stream.bytes_copied
            run = timed_run(eng, spec, {TEXT_STATES: text}, dev, cuda)
            res, ctx, wall = run.result, run.ctx, run.wall_s
            p = eng.placement
            per_step = sorted(ctx.step_ms[1:] or ctx.step_ms)
            row[mode] = {"placement": p.describe(), "streamed_blocks": list(p.streamed),
                         "room_gib": round(p.room_bytes / GIB, 3), "planned_peak_gib": round(p.need_bytes / GIB, 3),
                         "step_s": round(statistics.median(per_step) / 1000, 4), "steps_ms": ctx.step_ms,
                         "wall_s": round(wall, 2), "streamed_gib_per_step": round(
                             (eng.stream.bytes_copied - copied0) / max(1, steps) / GIB, 3)}
            row[mode].update(run.peaks)
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


def add_run_args(ap: argparse.ArgumentParser, items) -> None:
    """The run flags this bench shares with benchmarks/bench_long.py (`items`: what --only / --skip name)."""
    ap.add_argument("--work-dir", default="", help="run dirs, MP4s, logs (default /tmp/h3bench[-tiny])")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny weights, virtual devices")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no item that would end past this")
    ap.add_argument("--cap-gb", type=float, default=22.0, help="the card: all our processes on the GPU together")
    ap.add_argument("--period-s", type=float, default=0.25, help="memory sampling period")
    ap.add_argument("--context-gib", type=float, default=0.5, help="a bare CUDA context, when none was measured")
    ap.add_argument("--holder-margin-gib", type=float, default=1.5,
                    help="a process holds weights when above its idle footprint by more than this")
    ap.add_argument("--only", default="", type=comma_choices(items), help="comma-separated items to run")
    ap.add_argument("--skip", default="", type=comma_choices(items), help="comma-separated items to skip")
    ap.add_argument("--dit-engine", action="store_true", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="renders", choices=("renders", "long", "dit", "swaps", "fast"))
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default="out/one_card")
    add_run_args(ap, ITEMS)
    ap.add_argument("--h2d", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.h2d:
        print(json.dumps(h2d_rates()), flush=True)
        return 0
    if args.dit_engine:
        print(json.dumps(dit_engine_bench(Path(args.models_dir), args.cap_gb, args.tiny)), flush=True)
        return 0
    args.steps = 0
    return two.run(OneCard, args)


if __name__ == "__main__":
    sys.exit(main())
