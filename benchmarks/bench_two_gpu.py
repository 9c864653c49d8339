#!/usr/bin/env python
"""Two 22 GB cards, end to end, on two H200s: the product path at the seeds' resolutions under the
22 GiB-per-GPU rule, started and driven the way a user does it, with a memory trace that proves the turn-taking.

One invocation per part; each stays inside --budget-s (default 530 s) so a 10-minute device command returns data.
Weights live in --models-dir and are reused while the machine stays warm (a fresh machine writes them first):

    python3 benchmarks/bench_two_gpu.py --part rule  --models-dir /tmp/h3models --out $OUT
    python3 benchmarks/bench_two_gpu.py --part scale --models-dir /tmp/h3models --out $OUT
    .venv/bin/python benchmarks/bench_two_gpu.py --part rule --tiny --models-dir /tmp/h3tiny --out /tmp/h3out  # CPU

Parts (items in this order; every result is written to the JSON as soon as it exists; an item that would not finish
inside the budget is skipped and listed, with a ready `--only` value to run it later):
  rule   full-size random weights in the users' files; `scripts/up.sh ... --gpu-memory-cap-gb 22 --residency
         exclusive` with Turing numerics (DiT --linear-kernel int8 --dtype float16, fp16 encoder and decoder; the
         fp32 residual stream is the model's own); 8-step renders 832x480, 1920x1088, 1600x896, 1344x768 (x124)
         through `python -m client render`, each MP4 checked with PyAV; decode 1 rank vs 2 ranks at 1344x768x124;
         the 832x480 render repeated with the same seed (byte-identical MP4, TP ranks' final-latent hashes equal).
  scale  the same stack with `auto` kernels: 832x480 render, DiT TP2 vs TP1 s/step at 832x480x124 and 1344x768x124
         (TP1 on one H200 with no cap: one rank's 19.5 GiB of weights would not fit a 22 GB card), the all-reduce share
         of a TP2 step (NCCL microbench at the same shapes), fl2va (first + last frame) and --lora renders, then the
         other three resolutions.
All the while an NVML sampler (0.25 s) records each process's memory on each GPU (benchmarks/memtrace.py). Every
phase of the users' path (start-up, idle, renders, stage-level runs) is held to the cap; writing the weights and the
`free:` phases (TP1, the NCCL microbench) are not; every phase is held to "one stage holds weights per GPU". Outputs
in --out: two_gpu_<part>.json, trace_<part>.jsonl.gz, memtrace_<part>.png, bench_<part>.log,
stage_logs_<part>.tar.gz.

--tiny runs every code path on the CPU: tiny weights in the same file formats, virtual devices virt0/virt1, the
same up.sh / CLI / loadtest commands at small sizes, and GPU memory synthesised from the stages' event log (no NVML).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import memtrace  # noqa: E402  (light: no torch)
from stagekit.procs import stop_group  # noqa: E402

GIB = 2**30
PROMPT = "A red fox trots through fresh snow at dawn; wind hisses through the pines and a crow calls twice."
SEED = 1
# (label, full size, tiny size); labels name the items in both modes so --only works the same.
MATRIX = [("832x480x124", (832, 480, 124), (256, 256, 22)),
          ("1920x1088x124", (1920, 1088, 124), (384, 256, 22)),
          ("1600x896x124", (1600, 896, 124), (320, 256, 22)),
          ("1344x768x124", (1344, 768, 124), (288, 256, 22))]
SIZES = {label: (full, tiny) for label, full, tiny in MATRIX}
SCALING_SHAPES = ("832x480x124", "1344x768x124")
DECODE_SHAPE = "1344x768x124"
# Rough seconds per item on 2 x H200 (TP2, swaps included; DiT s/step from benchmarks/bench_tp.py: 1.25 / 4.35 at
# 832x480 / 1344x768, int8), scaled by what the renders so far show.
EST_RENDER = {"832x480x124": 35, "1920x1088x124": 150, "1600x896x124": 90, "1344x768x124": 55}
EST = {"weights": 150, "stack": 60, "decode-1v2": 45, "parity": 30, "tp2-steps": 45, "tp1-steps": 75,
       "allreduce": 25, "fl2va": 50, "lora": 35}
FINISH_RESERVE_S = 35
STAGES = ("encoder", "dit", "decoder")


def held_to_cap(phase: str) -> bool:
    """Every phase of the users' path is held to the cap: start-up, idle, renders, stage-level runs. Not: writing
    the weights (no user does that on the card) and the `free:` phases (TP1 on one H200, the NCCL microbench)."""
    return not phase.startswith(("setup", "free"))

# NVLink multicast stays off on the shared hosts (workplace rule): set for every process we start.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Stage settings per kernel profile (env H3_<STAGE>_<FIELD>, which scripts/up.sh passes through to the stages).
# Turing numerics: int8 linears and fp16 compute everywhere (the fp32 residual stream is the model's own). Attention
# stays on the measured pick (cuDNN on Hopper, fp16 like sm_75's kernels): sm_75's own kernels (PyTorch's efficient
# SDPA, comfy-kitchen int8) would change the speed, not the memory, and efficient SDPA is ~3.7x slower than cuDNN
# on an H200 (a 1920x1088x124 render would not fit a 10-minute device command).
TURING = {"H3_DIT_LINEAR_KERNEL": "int8", "H3_DIT_DTYPE": "float16", "H3_DECODER_DTYPE": "float16",
          "H3_ENCODER_DTYPE": "float16"}
PROFILES = {"int8": TURING, "auto": {}}
# The 22 GB card's text encoder: nvfp4 weights kept on the device, densified per layer (minimax_h3/text/conditioner.py).
ENCODER_ENV = {"H3_ENCODER_MODE": "compact"}
FILES = {"dit": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
         "te": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
         "video_vae": "minimax_h3_video_vae_fp16.safetensors",
         "audio_vae": "minimax_h3_audio_vae_fp32.safetensors",
         "lora": "loras/h3_random_lora.safetensors"}
LORA_RANK = {True: 4, False: 32}
TE_NVFP4_E2M1_STD = 2.926  # std of a uniformly random E2M1 code: sqrt(mean of the 16 values squared)
INT8_UNIFORM_STD = 73.3
HASH_LINE = re.compile(r"final latents rank=(\d+) (\d+x\d+x\d+) seed=(\d+) video_sha256=(\w+) audio_sha256=(\w+)")


# ================================================================================================================
# Weights: full-size random files in the layouts users have (tiny ones with --tiny)
# ================================================================================================================


def _gen(seed: int, key: str, device):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    return g


def te_random_plan(cfg, device, seed: int = 0):
    """(plan, makers) of a random Qwen3-VL text encoder in the ComfyUI nvfp4_awq layout (minimax_h3/text/checkpoint.py):
    E2M1 codes uniform, unit block scales, a global scale giving weight std 1/sqrt(in); int8 tensor-wise embedding;
    bf16 norms and vision tower. `makers` are (key, callable) in plan order: one tensor at a time, drawn on
    `device` (write with `write_safetensors_streaming(path, plan, ((k, make()) for k, make in makers))`)."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from minimax_h3.kernels.int8 import encode_comfy_quant
    from minimax_h3.kernels.nvfp4 import BLOCK_SIZE
    from minimax_h3.text.checkpoint import expected_shapes

    plan: list[tuple[str, tuple[int, ...], str]] = []
    makers: list[Callable] = []

    def add(key, shape, dtype, make):
        plan.append((key, tuple(shape), dtype))
        makers.append((key, make))

    nvfp4_doc = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    for name, shape in expected_shapes(cfg).items():
        base = "model." + name[: -len(".weight")]
        if name.startswith("embed_tokens"):
            cq = encode_comfy_quant(None)
            add(f"{base}.weight", shape, "I8", lambda k=f"{base}.weight", s=shape: torch.randint(
                -127, 128, s, generator=_gen(seed, k, device), device=device, dtype=torch.int8))
            add(f"{base}.weight_scale", (), "F32", lambda: torch.tensor(1.0 / INT8_UNIFORM_STD))
            add(f"{base}.comfy_quant", cq.shape, "U8", lambda cq=cq: cq)
        elif len(shape) == 2:
            rows, cols = shape
            add(f"{base}.weight", (rows, cols // 2), "U8", lambda k=f"{base}.weight", s=(rows, cols // 2): torch.randint(
                0, 256, s, generator=_gen(seed, k, device), device=device, dtype=torch.uint8))
            add(f"{base}.weight_scale", (rows, cols // BLOCK_SIZE), "F8_E4M3",
                lambda s=(rows, cols // BLOCK_SIZE): torch.ones(s, device=device).to(torch.float8_e4m3fn))
            add(f"{base}.weight_scale_2", (1,), "F32",
                lambda c=cols: torch.tensor([1.0 / (TE_NVFP4_E2M1_STD * math.sqrt(c))]))
            add(f"{base}.pre_quant_scale", (cols,), "BF16", lambda c=cols: torch.ones(c, dtype=torch.bfloat16))
            add(f"{base}.comfy_quant", nvfp4_doc.shape, "U8", lambda: nvfp4_doc)
        else:
            add(f"{base}.weight", shape, "BF16", lambda k=f"{base}.weight", s=shape: (1.0 + 0.1 * torch.randn(
                s, generator=_gen(seed, k, device), device=device)).to(torch.bfloat16))
    with torch.device("meta"):
        vshapes = {k: tuple(v.shape) for k, v in Qwen3VLVisionModel(cfg.vision.hf_config()).state_dict().items()}
    for name in sorted(vshapes):
        s = vshapes[name]

        def make(name=name, s=s):
            r = torch.randn(s, generator=_gen(seed, "visual." + name, device), device=device)
            if name.endswith(".bias"):
                r = 0.05 * r
            elif len(s) == 1:
                r = 1.0 + 0.1 * r
            elif name.startswith("pos_embed"):
                r = 0.5 * r
            else:
                r = r / math.sqrt(math.prod(s[1:]))
            return r.to(torch.bfloat16)

        add("visual." + name, s, "BF16", make)
    return plan, makers


def write_lora(path: Path, dit_cfg, rank: int, device, seed: int = 0) -> None:
    """A random LoRA on every block linear (ComfyUI dialect: diffusion_model.<name>.lora_A/lora_B + alpha)."""
    import torch
    from safetensors.torch import save_file

    inner, hid, ffn = dit_cfg.attn_inner, dit_cfg.hidden, dit_cfg.ffn
    shapes = {"attn.qkv_proj": (3 * inner, hid), "attn.out_proj": (hid, inner), "mlp.fc1": (2 * ffn, hid),
              "mlp.fc2": (hid, ffn)}
    sd = {}
    for i in range(dit_cfg.num_layers):
        for lin, (n_out, n_in) in shapes.items():
            key = f"diffusion_model.blocks.{i}.{lin}"
            a = torch.randn(rank, n_in, generator=_gen(seed, key + "A", device), device=device) / math.sqrt(n_in)
            b = 0.02 * torch.randn(n_out, rank, generator=_gen(seed, key + "B", device), device=device)
            sd[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            sd[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
            sd[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(sd, str(path))


def write_weights(models: Path, tiny: bool, names: set[str] | None = None) -> dict:
    """Write whatever of the five files (or of `names`) is missing (each to a hidden temp name, then renamed).
    Returns sizes/times."""
    import torch

    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint, write_safetensors_streaming, write_tiny_checkpoint
    from minimax_h3.text.config import ConditionerConfig
    from minimax_h3.text.tiny import build_tiny_tokenizer, write_tiny_model
    from minimax_h3.vae.audio import AudioVAEConfig, write_tiny_audio_vae
    from minimax_h3.vae.video import VideoVAEConfig, write_tiny_video_vae

    models.mkdir(parents=True, exist_ok=True)
    (models / "loras").mkdir(exist_ok=True)
    manifest = models / "bench_weights.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("tiny") != tiny:
        raise SystemExit(f"{models} holds {'tiny' if not tiny else 'full-size'} weights; use another --models-dir")
    device = "cpu" if tiny else "cuda"
    dit_cfg = DiTConfig.tiny() if tiny else DiTConfig.full()
    times: dict[str, float] = {}

    def produce(name: str, write: Callable[[Path], None]) -> None:
        target = models / FILES[name]
        if target.exists() or (names is not None and name not in names):
            return
        t0 = time.monotonic()
        tmp = target.with_name(f".{target.name}.tmp")
        write(tmp)
        tmp.replace(target)
        times[name] = round(time.monotonic() - t0, 1)

    def te(tmp: Path) -> None:
        if tiny:  # the tiny nvfp4_awq file (quantised for real) plus its tokenizer, renamed below
            written = write_tiny_model(models, variant="nvfp4_awq")
            written.replace(tmp)
            return
        build_tiny_tokenizer().save(str(models / "tokenizer.json"))
        plan, makers = te_random_plan(ConditionerConfig.full(), device)
        write_safetensors_streaming(tmp, plan, ((k, make()) for k, make in makers))

    def vaes() -> None:  # CPU work, beside the GPU writers
        produce("video_vae", lambda p: write_tiny_video_vae(
            str(p), VideoVAEConfig.tiny() if tiny else VideoVAEConfig.full(), 0))
        produce("audio_vae", lambda p: write_tiny_audio_vae(p, AudioVAEConfig.tiny() if tiny else AudioVAEConfig.full(), 0))

    def te_and_lora() -> None:
        produce("te", te)
        produce("lora", lambda p: write_lora(p, dit_cfg, LORA_RANK[tiny], device))

    t_all = time.monotonic()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    # Three writers at once (torch ops and file writes release the GIL): VAEs on the CPU, the text encoder and the
    # LoRA, and the DiT drawn on the GPU.
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in (vaes, te_and_lora)]
    for t in threads:
        t.start()
    try:
        if tiny:
            produce("dit", lambda p: write_tiny_checkpoint(dit_cfg, p, "int8_convrot_pruned"))
        else:
            produce("dit", lambda p: write_random_int8_convrot_checkpoint(dit_cfg, p, device=device, quantize=False,
                                                                          pruned=True))
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    manifest.write_text(json.dumps({"tiny": tiny}))
    sizes = {n: round((models / f).stat().st_size / GIB, 3) for n, f in FILES.items() if (models / f).exists()}
    return {"seconds": round(time.monotonic() - t_all, 1), "written_s": times, "gib": sizes}


# ================================================================================================================
# Checks of what the CLI produced
# ================================================================================================================


def check_mp4(path: Path, frames: int, width: int, height: int) -> dict:
    """PyAV: H.264 video of the expected size and frame count (every frame decoded), AAC 32 kHz stereo audio."""
    import av

    from minimax_h3.contract import AUDIO_CHANNELS, AUDIO_SAMPLE_RATE

    out: dict = {"bytes": path.stat().st_size}
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        out.update(video_codec=v.codec_context.name, width=v.codec_context.width, height=v.codec_context.height)
        out["frames"] = sum(1 for _ in c.decode(v))
    with av.open(str(path)) as c:
        if c.streams.audio:
            a = c.streams.audio[0].codec_context
            out.update(audio_codec=a.name, sample_rate=a.sample_rate,
                       channels=getattr(a, "channels", None) or a.layout.nb_channels)
        out["duration_s"] = round(c.duration / 1e6, 3) if c.duration else None
    out["ok"] = (out["video_codec"] == "h264" and (out["width"], out["height"]) == (width, height)
                 and out["frames"] == frames and out.get("audio_codec") == "aac"
                 and out.get("sample_rate") == AUDIO_SAMPLE_RATE and out.get("channels") == AUDIO_CHANNELS)
    return out


def cli_tail(text: str, lines: int = 14) -> str:
    """The CLI's last lines without its progress bars."""
    keep = [ln.rstrip() for ln in text.splitlines() if ln.strip() and "━" not in ln]
    return "\n".join(keep[-lines:])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def latent_hashes(log_text: str) -> dict:
    """The DiT's per-rank final-latent hash lines (dit_svc/engine.py) -> jobs in order, ranks agreeing or not."""
    per_rank: dict[int, list[tuple[str, str, str]]] = {}
    for m in HASH_LINE.finditer(log_text):
        per_rank.setdefault(int(m.group(1)), []).append((m.group(2), m.group(4), m.group(5)))
    jobs = []
    for i in range(max((len(v) for v in per_rank.values()), default=0)):
        row = {r: v[i] for r, v in per_rank.items() if i < len(v)}
        jobs.append({"size": next(iter(row.values()))[0], "video": {r: x[1][:16] for r, x in row.items()},
                     "audio": {r: x[2][:16] for r, x in row.items()},
                     "ranks_equal": len(row) == len(per_rank) and len({x[1:] for x in row.values()}) == 1})
    return {"ranks": sorted(per_rank), "jobs": jobs,
            "ranks_equal": bool(jobs) and len(per_rank) > 1 and all(j["ranks_equal"] for j in jobs)}


def stage_timing(events: list[dict], t0: float, t1: float) -> dict:
    """Per stage within [t0, t1] from the stages' event log: lease wait, load, unload, compute (job_start ..
    job_done), and the render's swap overhead (loads + unloads + lease waits) against compute."""
    per: dict[str, dict] = {}
    started: dict[str, float] = {}
    for ev in sorted(events, key=lambda e: e["t"]):
        if not t0 <= ev["t"] <= t1 or "stage" not in ev:
            continue
        st = per.setdefault(ev.get("stage", "?"), {"lease_wait_s": 0.0, "load_s": 0.0, "unload_s": 0.0,
                                                   "compute_s": 0.0, "loads": 0, "jobs": 0, "load_gbps": []})
        kind = ev.get("event")
        if kind == "load_start":
            st["lease_wait_s"] += ev.get("waited_s", 0.0)
        elif kind == "loaded":
            st["load_s"] += ev.get("load_s", 0.0)
            st["loads"] += 1
            if ev.get("bytes") and ev.get("load_s"):
                st["load_gbps"].append(round(ev["bytes"] / ev["load_s"] / 1e9, 2))
        elif kind == "unloaded":
            st["unload_s"] += ev.get("unload_s", 0.0)
        elif kind == "job_start":
            started[ev.get("holder", "")] = ev["t"]
        elif kind == "job_done" and ev.get("holder", "") in started:
            st["compute_s"] += ev["t"] - started.pop(ev.get("holder", ""))
            st["jobs"] += 1
    for st in per.values():
        for k in ("lease_wait_s", "load_s", "unload_s", "compute_s"):
            st[k] = round(st[k], 3)
    swap = sum(s["load_s"] + s["unload_s"] for s in per.values())
    wait = sum(s["lease_wait_s"] for s in per.values())
    compute = sum(s["compute_s"] for s in per.values())
    return {"stages": per, "swap_s": round(swap, 2), "lease_wait_s": round(wait, 2), "compute_s": round(compute, 2),
            "swap_share": round(swap / (swap + compute), 3) if swap + compute > 0 else None}


def step_seconds(loadtest_json: dict) -> dict:
    """s/step of a DiT loadtest run: median over the requests' steps after the first (warm-up) step."""
    steps = [ms for r in loadtest_json.get("requests", []) if r.get("code") == "OK" for ms in r.get("step_ms", [])[1:]]
    timing = [s["timing"] for r in loadtest_json.get("requests", []) for s in r.get("stages", [])]
    return {"s_per_step": round(statistics.median(steps) / 1000, 4) if steps else None, "steps_timed": len(steps),
            "load_s": [round(t.get("load_s", 0.0), 2) for t in timing],
            "errors": loadtest_json.get("summary", {}).get("errors")}


def decode_seconds(loadtest_json: dict) -> dict:
    comp = [s["timing"].get("compute_s", 0.0) for r in loadtest_json.get("requests", []) if r.get("code") == "OK"
            for s in r.get("stages", [])]
    return {"compute_s": [round(c, 3) for c in comp], "best_s": round(min(comp), 3) if comp else None,
            "errors": loadtest_json.get("summary", {}).get("errors")}


# ================================================================================================================
# CPU dry run: GPU memory synthesised from the stages' event log
# ================================================================================================================


class EventsGpu:
    """For --tiny: each stage leader that appeared in the event log 'holds' a fake context on its devices, plus
    fake weights while resident (load_start .. unloaded). Exercises the sampler, checker and plot on a CPU."""

    CONTEXT = GIB // 2
    WEIGHTS = {"encoder": int(13.5 * GIB), "dit": 10 * GIB, "decoder": int(4.7 * GIB)}

    def __init__(self, lease_dir: Path):
        self.lease_dir = lease_dir

    def __call__(self) -> memtrace.GpuReading:
        from stagekit.lease import read_events

        state: dict[int, tuple[str, list[str], bool]] = {}
        try:
            events = read_events(self.lease_dir)
        except (OSError, ValueError):
            events = []
        for ev in events:
            pid, kind = ev.get("pid"), ev.get("event")
            if pid is None or not ev.get("devices"):
                continue
            resident = state.get(pid, ("", [], False))[2]
            if kind == "load_start":
                resident = True
            elif kind == "unloaded":
                resident = False
            state[pid] = (ev.get("stage", "?"), list(ev["devices"]), resident)
        procs: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        for pid, (stage, devices, resident) in state.items():
            if not memtrace.read_cmdline(pid):
                continue  # exited
            weights = self.WEIGHTS.get(stage, GIB) * (2 if len(devices) == 1 and stage == "dit" else 1)
            for d in devices:
                idx = int(d[-1]) if d[-1].isdigit() else 0
                procs.setdefault(idx, []).append((pid, self.CONTEXT + (weights if resident else 0)))
        return procs, {g: sum(b for _, b in lst) + self.CONTEXT for g, lst in procs.items()}


# ================================================================================================================
# The run
# ================================================================================================================


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port_file: Path | None = None


class Bench:
    def __init__(self, args):
        self.args = args
        self.tiny = args.tiny
        self.part = args.part
        self.t_start = time.monotonic()
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.models = Path(args.models_dir).resolve()
        self.work = Path(args.work_dir or f"/tmp/h3bench{'-tiny' if self.tiny else ''}").resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self._stop_leftovers()
        self.run = self.work / "run"  # the CLI, started in the work dir, finds run/endpoints.env as a user's does
        shutil.rmtree(self.run, ignore_errors=True)
        (self.run / "leases").mkdir(parents=True)
        (self.work / "mp4").mkdir(exist_ok=True)
        self.logfile = open(self.out / f"bench_{self.part}.log", "a")
        self.devices = "virt0,virt1" if self.tiny else "cuda:0,cuda:1"
        self.ranks = 2  # DiT and decoder ranks
        self.weight_files: set[str] = set()  # what do_weights writes (empty: all of FILES)
        self.steps = args.steps or (2 if self.tiny else 8)
        self.cap = int(args.cap_gb * GIB)
        self.budget = args.budget_s or (3600.0 if self.tiny else 530.0)
        self.speed = 1.0  # measured / estimated seconds, from the renders so far
        self._ratios: list[float] = []
        self.stack_up = False
        self.profile = ""
        self.extra: dict[str, Proc] = {}
        self.baseline: dict[str, dict[int, int]] = {}
        self.only = set(filter(None, args.only.split(","))) if args.only else None
        self.skip = set(filter(None, args.skip.split(","))) if args.skip else set()
        self.results: dict = {"part": self.part, "tiny": self.tiny, "started_unix": time.time(),
                              "budget_s": self.budget, "cap_gib": args.cap_gb, "devices": self.devices,
                              "steps": self.steps, "prompt": PROMPT, "seed": SEED, "items": {}, "skipped": [],
                              "notes": []}
        if self.tiny:
            self.results["notes"].append("CPU dry run: tiny weights, virtual devices; GPU memory in the trace is "
                                         "synthesised from the stages' event log, not measured")
        self.trace_path = self.out / f"trace_{self.part}.jsonl"
        self.trace_path.unlink(missing_ok=True)
        if self.tiny:
            read = EventsGpu(self.run / "leases")
        else:
            try:
                read = memtrace.nvml_reader()
            except Exception as e:  # noqa: BLE001 - the run still renders; the trace check then fails, saying why
                self.results["notes"].append(f"NVML unavailable ({type(e).__name__}: {e}): no GPU memory trace")
                read = lambda: ({}, {})  # noqa: E731
        markers = (str(self.work), str(self.models))
        me = os.getpid()
        self.sampler = memtrace.MemorySampler(read, period_s=args.period_s, host_every=4,
                                              host_pids=lambda: [me, *memtrace.our_pids(markers)],
                                              sink=self.trace_path)
        self.sampler.phase = "setup"
        self.sampler.start()

    # ---- bookkeeping ----------------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t_start:7.1f}s] {msg}"
        print(line, flush=True)
        self.logfile.write(line + "\n")
        self.logfile.flush()

    def save(self) -> None:
        path = self.out / f"two_gpu_{self.part}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str, ensure_ascii=False))
        tmp.replace(path)

    def left_s(self) -> float:
        return self.budget - (time.monotonic() - self.t_start) - FINISH_RESERVE_S

    def item(self, name: str, est_s: float, fn: Callable[[], dict], needs_stack: bool = True) -> dict | None:
        always = name == "weights" or name.startswith("stack:")  # what the other items stand on
        if (self.only is not None and name not in self.only and not always) or name in self.skip:
            return None
        est = est_s * (1.0 if self.tiny else self.speed)
        why = ""
        if needs_stack and not self.stack_up:
            why = "the stack is not up"
        elif est > self.left_s():
            why = f"needs ~{est:.0f} s, {self.left_s():.0f} s left in the budget"
        if why:
            self.results["skipped"].append({"item": name, "why": why})
            self.log(f"SKIP {name}: {why}")
            self.save()
            return None
        self.log(f"--- {name} (est {est:.0f} s)")
        t0 = time.monotonic()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - one item's failure is recorded; the others still run
            r = {"error": f"{type(e).__name__}: {e}"}
            self.log(traceback.format_exc())
        r["item_s"] = round(time.monotonic() - t0, 1)
        self.results["items"][name] = r
        self.log(f"=== {name}: {json.dumps(r, default=str, ensure_ascii=False)[:1500]}")
        self.save()
        return r

    def size(self, label: str) -> tuple[int, int, int]:
        full, tiny = SIZES[label]
        return tiny if self.tiny else full

    # ---- processes ------------------------------------------------------------------------------------------------
    def env(self, profile: str | None = None) -> dict:
        env = {**os.environ, **NCCL_SAFE, **ENCODER_ENV, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "protos"), env.get("PYTHONPATH")]))
        for k, v in PROFILES.get(profile or self.profile, {}).items():
            if self.tiny and "KERNEL" in k:
                continue  # CPU has only the fallback kernels (dit_svc refuses kernel flags there)
            env[k] = "float32" if self.tiny and k.endswith("_DTYPE") else v
        if self.tiny:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def run_cmd(self, cmd: list[str], timeout_s: float, name: str, env: dict | None = None,
                cwd: Path | None = None) -> tuple[int, str, str]:
        """Run to completion (own process group, killed at the timeout). Returns (rc, stdout, stderr tail)."""
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        out_p, err_p = logs / f"{name}.out", logs / f"{name}.err"
        with open(out_p, "w") as out, open(err_p, "w") as err:
            p = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env or self.env(),
                                 cwd=str(cwd or ROOT), start_new_session=True)
            try:
                rc = p.wait(timeout=max(5.0, timeout_s))
            except subprocess.TimeoutExpired:
                stop_group(p, 20.0)
                rc = 124
        stderr = err_p.read_text(errors="replace")
        return rc, out_p.read_text(errors="replace"), stderr[-3000:]

    def _stop_leftovers(self) -> None:
        """A part killed at its time limit leaves its stages (own sessions) running on a warm machine: stop them."""
        run = self.work / "run"
        for pidf in run.glob("*.pid"):
            if pidf.stem not in STAGES:  # an extra stage process of ours (decoder_1rank, dit_tp1)
                try:
                    os.killpg(int(pidf.read_text()), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass
        if any(run.glob("*.pid")):
            subprocess.run(["bash", str(ROOT / "scripts/down.sh"), "--run-dir", str(run), "--grace", "10"],
                           cwd=ROOT, capture_output=True, timeout=120)

    def endpoints(self) -> dict[str, str]:
        out = {}
        for line in (self.run / "endpoints.env").read_text().splitlines():
            if line.startswith("H3_") and "=" in line:
                k, v = line.split("=", 1)
                out[k[3:].lower()] = v.strip()
        return out

    def events(self) -> list[dict]:
        from stagekit.lease import read_events

        return read_events(self.run / "leases")

    def measure_idle(self, label: str, roles: set[str] | None = None, seconds: float = 1.5) -> dict:
        """Footprint of `roles` (default: every process) while they hold nothing (phase idle:<label>) -> the hold
        rule's baseline. Only just-started processes qualify: a stage that already served a job may be resident."""
        self.sampler.phase = f"idle:{label}"
        t0 = time.time()
        time.sleep(seconds)
        base = memtrace.idle_baseline(s for s in list(self.sampler.samples) if s.t >= t0)
        base = {r: d for r, d in base.items() if roles is None or r in roles}
        for role, per_gpu in base.items():
            for g, b in per_gpu.items():
                self.baseline.setdefault(role, {})[g] = max(self.baseline.get(role, {}).get(g, 0), b)
        return {r: {g: round(b / GIB, 3) for g, b in d.items()} for r, d in base.items()}

    def start_stage_proc(self, name: str, module: str, devices: str, cap: bool) -> Proc:
        """One extra stage process (a 1-rank decoder, a TP1 DiT) beside the stack, sharing its lease dir."""
        port_file = self.run / f"{name}.port"
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
               "--lease-dir", str(self.run / "leases"), "--residency", "exclusive", "--models-dir", str(self.models),
               "--devices", devices]
        if cap:
            cmd += ["--gpu-memory-cap-gb", str(self.args.cap_gb)]
        log = open(self.run / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), cwd=str(ROOT),
                             start_new_session=True)
        (self.run / f"{name}.pid").write_text(str(p.pid))
        proc = Proc(name, p, port_file)
        self.extra[name] = proc
        self._wait_serving(proc, timeout_s=300)
        return proc

    def _wait_serving(self, proc: Proc, timeout_s: float) -> None:
        from minimax_h3.services import SERVICE_NAMES
        from stagekit.channels import health_of, open_channel

        stage = memtrace.stage_of(proc.name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: "
                                   + self._tail(self.run / f"{proc.name}.log"))
            if proc.port_file.exists():
                ch = open_channel(f"127.0.0.1:{proc.port_file.read_text().strip()}")
                try:
                    if health_of(ch, SERVICE_NAMES[stage]) == "SERVING":
                        return
                finally:
                    ch.close()
            time.sleep(0.2)
        raise TimeoutError(f"{proc.name} not SERVING after {timeout_s} s")

    def stop_proc(self, name: str) -> None:
        proc = self.extra.pop(name, None)
        if proc is not None and proc.popen.poll() is None:
            stop_group(proc.popen, 20.0)
        (self.run / f"{name}.pid").unlink(missing_ok=True)

    @staticmethod
    def _tail(path: Path, n: int = 3000) -> str:
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---- items ----------------------------------------------------------------------------------------------------
    def do_weights(self) -> dict:
        self.sampler.phase = "setup:weights"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--write-weights", "--models-dir", str(self.models),
               *(["--weights-files", ",".join(sorted(self.weight_files))] if self.weight_files else [])]
        if self.tiny:
            cmd.append("--tiny")
        rc, out, err = self.run_cmd(cmd, timeout_s=max(60.0, self.left_s()), name="weights")
        if rc != 0:
            raise RuntimeError(f"weight writer failed (rc {rc}): {err}")
        return json.loads(out.strip().splitlines()[-1])

    def do_stack(self, profile: str) -> dict:
        if self.stack_up:
            self.do_down()
        self.profile = profile
        self.sampler.phase = f"start:{profile}"  # held to the cap too (held_to_cap)
        env = self.env(profile)
        models = ["--models-dir", self.models]
        if self.tiny:
            # The encoder reads a --models-dir file as the full Qwen3-VL-32B (its dims are not inferred from the
            # header), so the dry run gives the models dir to the DiT and decoder only and the encoder runs its
            # embedded tiny model.
            models = []
            env.update(H3_DIT_MODELS_DIR=str(self.models), H3_DECODER_MODELS_DIR=str(self.models),
                       H3_ENCODER_CACHE_DIR=str(self.work / "cache"))
        cmd = ["bash", str(ROOT / "scripts/up.sh"), "--run-dir", self.run, *models,
               "--devices", self.devices, "--dit-ranks", str(self.ranks), "--decoder-ranks", str(self.ranks),
               "--gpu-memory-cap-gb", self.args.cap_gb, "--residency", "exclusive",
               "--encoder-port", "0", "--dit-port", "0", "--decoder-port", "0", "--render-port", "0",
               "--web-port", "-1"]
        t0 = time.monotonic()
        rc, out, err = self.run_cmd(cmd, timeout_s=min(620.0, max(60.0, self.left_s())), name=f"up-{profile}",
                                    env=env)
        r = {"rc": rc, "start_s": round(time.monotonic() - t0, 1), "profile": profile,
             "env": {k: v for k, v in env.items() if k.startswith("H3_")}}
        if rc != 0:
            r["stdout"], r["stderr"] = out[-1500:], err
            r["logs"] = {s: self._tail(self.run / f"{s}.log", 1500) for s in STAGES}
            raise RuntimeError(f"up.sh failed (rc {rc}): {json.dumps(r)[:6000]}")
        self.stack_up = True
        r["endpoints"] = self.endpoints()
        r["idle_gib"] = self.measure_idle(profile)
        rc, out, _ = self.run_cmd([sys.executable, "-m", "client", "status"], 60, f"status-{profile}", cwd=self.work)
        r["status"] = out[-3000:]
        return r

    def do_down(self) -> None:
        for name in list(self.extra):
            self.stop_proc(name)
        if any(self.run.glob("*.pid")):  # also after a failed or timed-out up.sh: its stages may be running
            self.run_cmd(["bash", str(ROOT / "scripts/down.sh"), "--run-dir", self.run, "--grace", "20"], 120,
                         "down", env=self.env())
        self.stack_up = False

    def do_render(self, key: str, label: str, extra: list[str] | None = None, seed: int = SEED) -> dict:
        w, h, f = self.size(label)
        phase = f"rule:{self.profile}:{key}"
        self.sampler.phase = phase
        mp4 = self.work / "mp4" / f"{self.part}-{key}.mp4"
        mp4.unlink(missing_ok=True)
        dit_log = self.run / "dit.log"
        offset = dit_log.stat().st_size if dit_log.exists() else 0
        cmd = [sys.executable, "-m", "client", "render", "--prompt", PROMPT, "-o", mp4, "--width", w, "--height", h,
               "--frames", f, "--steps", self.steps, "--seed", seed, *(extra or [])]
        t0 = time.time()
        timeout = max(60.0, min(self.left_s() + FINISH_RESERVE_S / 2, 4 * EST_RENDER.get(label, 100) * self.speed))
        # cwd = the work dir: the CLI reads run/endpoints.env there (scripts/up.sh wrote it), as a user's would.
        rc, out, err = self.run_cmd(cmd, timeout, f"render-{self.part}-{key}", cwd=self.work)
        t1 = time.time()
        r: dict = {"size": f"{w}x{h}x{f}", "steps": self.steps, "seed": seed, "rc": rc, "wall_s": round(t1 - t0, 2),
                   "cli": cli_tail(out + err)}
        if "embedded" in err.lower() and "stack" in err.lower():
            r["error"] = "the CLI fell back to an embedded stack: the configured stages were not reachable"
        if rc == 0 and mp4.exists():
            r["mp4"] = check_mp4(mp4, f, w, h)
            r["mp4_sha256"] = sha256_file(mp4)
        elif "error" not in r:
            r["error"] = f"render failed (rc {rc})"
        r["timing"] = stage_timing(self.events(), t0, t1)
        r["latents"] = latent_hashes(dit_log.read_text(errors="replace")[offset:] if dit_log.exists() else "")
        samples = [s for s in list(self.sampler.samples) if t0 <= s.t <= t1]
        phase_sum = memtrace.summarize(samples).get(phase, {})
        r["memory"] = {k: phase_sum.get(k) for k in ("gpu_peak_gib", "role_peak_gib", "host_rss_peak_gib",
                                                      "host_pss_peak_gib")}
        if key in EST_RENDER and rc == 0:
            self._ratios.append((t1 - t0) / EST_RENDER[key])
            self.speed = min(3.0, max(0.5, statistics.mean(self._ratios)))
        return r

    def loadtest(self, stage: str, label: str, name: str, endpoint: str | None = None, **kw) -> dict:
        w, h, f = self.size(label)
        ep = self.endpoints()
        if endpoint:
            ep[stage] = endpoint
        cmd = [sys.executable, "-m", "client", "loadtest", "--stage", stage, "--requests", kw.get("requests", 1),
               "--width", w, "--height", h, "--frames", f, "--json", "--json-requests", "--timeout", 900,
               "--endpoints-file", self.run / "endpoints.env",
               "--encoder", ep["encoder"], "--dit", ep["dit"], "--decoder", ep["decoder"]]
        if stage == "dit":
            cmd += ["--steps", kw.get("steps", 4), "--text-dim", 64 if self.tiny else 5120, "--text-len", 64]
        if stage == "decoder":
            cmd += ["--format", "raw"]
        rc, out, err = self.run_cmd(cmd, max(60.0, self.left_s()), f"loadtest-{self.part}-{name}", cwd=self.work)
        try:
            data = json.loads(out[out.index("{"):])
        except ValueError:
            raise RuntimeError(f"loadtest {name} gave no JSON (rc {rc}): {err[-1500:]}") from None
        return data

    def do_decode_1v2(self) -> dict:
        self.sampler.phase = f"rule:{self.profile}:decode-1v2"
        two = decode_seconds(self.loadtest("decoder", DECODE_SHAPE, "decode-2ranks", requests=2))
        self.start_stage_proc("decoder_1rank", "decoder_svc", self.devices.split(",")[0], cap=True)
        idle = self.measure_idle("decoder_1rank", {"decoder_1rank"}, 1.0)
        self.sampler.phase = f"rule:{self.profile}:decode-1v2"
        port = self.extra["decoder_1rank"].port_file.read_text().strip()
        one = decode_seconds(self.loadtest("decoder", DECODE_SHAPE, "decode-1rank", endpoint=f"127.0.0.1:{port}",
                                           requests=2))
        self.stop_proc("decoder_1rank")
        speedup = round(one["best_s"] / two["best_s"], 2) if one["best_s"] and two["best_s"] else None
        return {"size": "x".join(map(str, self.size(DECODE_SHAPE))), "format": "raw (decode + gather, no mux)",
                "two_ranks": two, "one_rank": one, "speedup": speedup, "one_rank_idle_gib": idle,
                "target": ">= 1.6"}

    def do_parity(self, first_key: str) -> dict:
        first = self.results["items"].get(f"render:{self.profile}:{first_key}")
        if not first:  # run with --only parity: render the first one here
            first = self.results["items"][f"render:{self.profile}:{first_key}"] = self.do_render(first_key, first_key)
        if "mp4_sha256" not in first:
            raise RuntimeError(f"the first {first_key} render did not produce an MP4 to compare with")
        again = self.do_render(f"{first_key}-repeat", first_key)
        jobs = first["latents"]["jobs"] + again["latents"]["jobs"]
        return {"repeat": again, "mp4_identical": again.get("mp4_sha256") == first["mp4_sha256"],
                "latents_identical": len(jobs) == 2 and jobs[0]["video"] == jobs[1]["video"]
                and jobs[0]["audio"] == jobs[1]["audio"],
                "tp_ranks_equal": first["latents"]["ranks_equal"] and again["latents"]["ranks_equal"]}

    def do_steps(self, tp: int) -> dict:
        out = {}
        endpoint = None
        if tp == 1:
            self.sampler.phase = "free:tp1-start"
            self.start_stage_proc("dit_tp1", "dit_svc", self.devices.split(",")[0], cap=False)
            out["idle_gib"] = self.measure_idle("dit_tp1", {"dit_tp1"}, 1.0)
            endpoint = f"127.0.0.1:{self.extra['dit_tp1'].port_file.read_text().strip()}"
        for label in SCALING_SHAPES:
            self.sampler.phase = f"free:tp1:{label}" if tp == 1 else f"rule:{self.profile}:tp2-steps:{label}"
            out[label] = step_seconds(self.loadtest("dit", label, f"tp{tp}-{label}", endpoint=endpoint,
                                                    steps=3 if self.tiny else 4))
        if tp == 1:
            self.stop_proc("dit_tp1")
            out["note"] = "TP1 runs on one H200 without the 22 GiB cap (19.5 GiB of weights on one rank)"
        return out

    def do_allreduce(self) -> dict:
        """The fp32 all-reduces of one TP2 step (2 per block: attention out_proj and fc2, over [rows, hidden]),
        timed with NCCL (gloo on the CPU) at the rows of each scaling shape (text 64 + video + audio rows)."""
        self.sampler.phase = "free:allreduce"
        from minimax_h3.dit.config import DiTConfig
        from minimax_h3.dit.layout import latent_shape

        cfg = DiTConfig.tiny() if self.tiny else DiTConfig.full()
        rows = {}
        for label in SCALING_SHAPES:
            w, h, f = self.size(label)
            s = latent_shape(cfg, f, h, w)
            _, ph, pw = cfg.patch
            rows[label] = 64 + s.latent_frames * (s.latent_height // ph) * (s.latent_width // pw) + 2 * s.audio_latents
        script = self.work / "allreduce.py"
        script.write_text(ALLREDUCE_SCRIPT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
               json.dumps(rows), cfg.hidden, 2 * cfg.num_layers, "gloo" if self.tiny else "nccl"]
        rc, out, err = self.run_cmd(cmd, max(60.0, self.left_s()), f"allreduce-{self.part}")
        if rc != 0:
            raise RuntimeError(f"allreduce microbench failed (rc {rc}): {err[-1500:]}")
        res = json.loads(out.strip().splitlines()[-1])
        tp2 = self.results["items"].get("tp2-steps", {})
        for label, d in res.items():
            sps = (tp2.get(label) or {}).get("s_per_step")
            d["share_of_tp2_step"] = round(d["per_step_s"] / sps, 3) if sps else None
        return res

    def keyframes(self, label: str) -> list[str]:
        """`--first-frame A.png --last-frame B.png` at the render size (two different gradients)."""
        from PIL import Image

        w, h, _ = self.size(label)
        args = []
        for i, name in enumerate(("first", "last")):
            p = self.work / f"{name}_{w}x{h}.png"
            img = Image.new("RGB", (w, h))
            img.putdata([((x * 255) // w, (y * 255) // h, 80 + 120 * i) for y in range(h) for x in range(w)])
            img.save(p)
            args += [f"--{name}-frame", str(p)]
        return args

    # ---- parts ----------------------------------------------------------------------------------------------------
    def run_part(self) -> None:
        need_weights = any(not (self.models / f).exists() for f in FILES.values())
        self.item("weights", EST["weights"] if need_weights else 5, self.do_weights, needs_stack=False)
        if self.part == "rule":
            self.item("stack:int8", EST["stack"], lambda: self.do_stack("int8"), needs_stack=False)
            for label, _, _ in MATRIX:
                self.item(f"render:int8:{label}", EST_RENDER[label] + (20 if label == MATRIX[0][0] else 0),
                          lambda label=label: self.do_render(label, label))
            self.item("decode-1v2", EST["decode-1v2"], self.do_decode_1v2)
            self.item("parity", EST["parity"], lambda: self.do_parity(MATRIX[0][0]))
        elif self.part == "scale":
            self.item("stack:auto", EST["stack"], lambda: self.do_stack("auto"), needs_stack=False)
            first = MATRIX[0][0]
            self.item(f"render:auto:{first}", EST_RENDER[first] + 20, lambda: self.do_render(first, first))
            self.item("tp2-steps", EST["tp2-steps"], lambda: self.do_steps(2))
            self.item("tp1-steps", EST["tp1-steps"], lambda: self.do_steps(1))
            self.item("allreduce", EST["allreduce"], self.do_allreduce, needs_stack=False)
            self.item("fl2va", EST["fl2va"], lambda: self.do_render(f"{first}-fl2va", first, self.keyframes(first)))
            self.item("lora", EST["lora"], lambda: self.do_render(
                f"{first}-lora", first, ["--lora", f"{Path(FILES['lora']).name}:0.8"]))
            for label, _, _ in MATRIX[1:]:
                self.item(f"render:auto:{label}", EST_RENDER[label], lambda label=label: self.do_render(label, label))
        else:
            raise SystemExit(f"--part {self.part!r}: use rule or scale")

    def finish(self) -> None:
        self.sampler.phase = "stop"
        try:
            self.do_down()
        except Exception as e:  # noqa: BLE001
            self.log(f"down failed: {e}")
        self.sampler.stop()
        samples = self.sampler.samples
        hold = memtrace.HoldRule(context_bytes=int(self.args.context_gib * GIB),
                                 margin_bytes=int(self.args.holder_margin_gib * GIB), baseline=self.baseline)
        check = memtrace.check_trace(samples, self.cap, hold, rule_phase=held_to_cap)
        events = self.events() if (self.run / "leases").exists() else []
        trace = check.to_json()
        trace["event_log_overlaps"] = memtrace.check_events(events)
        trace["baseline_gib"] = {r: {g: round(b / GIB, 3) for g, b in d.items()} for r, d in self.baseline.items()}
        trace["hold_rule"] = {"context_gib": self.args.context_gib, "margin_gib": self.args.holder_margin_gib}
        trace["sampler_errors"] = self.sampler.errors
        trace["period_s"] = self.args.period_s
        self.results["trace"] = trace
        self.results["phases"] = memtrace.summarize(samples)
        try:
            title = (f"part {self.part}: GPU memory per process (cap {self.args.cap_gb:g} GiB)"
                     + (" -- CPU dry run, synthetic memory" if self.tiny else ""))
            turns = [(iv["start"], iv["stage"]) for iv in memtrace.residency_intervals(events)]
            memtrace.plot_trace(samples, self.out / f"memtrace_{self.part}.png", self.cap, title, hold, turns,
                                rule_phase=held_to_cap)
        except ImportError as e:
            self.results["notes"].append(f"no plot: {e}")
        if self.trace_path.exists():
            memtrace.compress(self.trace_path)
        self._pack_logs()
        self.results["verdicts"] = self.verdicts()
        self.results["wall_s"] = round(time.monotonic() - self.t_start, 1)
        skipped = [s["item"] for s in self.results["skipped"]]
        if skipped:
            self.results["rerun_only"] = ",".join(skipped)
        self.save()
        self.log(f"verdicts: {json.dumps(self.results['verdicts'])}")
        if skipped:
            self.log(f"skipped; rerun with --part {self.part} --only {self.results['rerun_only']}")
        self.logfile.close()

    def _pack_logs(self) -> None:
        with tarfile.open(self.out / f"stage_logs_{self.part}.tar.gz", "w:gz") as tar:
            for p in sorted([*self.run.glob("*.log"), *(self.work / "logs").glob(f"*{self.part}*"),
                             *(self.work / "logs").glob("up-*"), *(self.work / "logs").glob("weights.*"),
                             self.run / "leases" / "events.jsonl"]):
                if p.is_file():
                    data = p.read_bytes()[-(3 << 20):]
                    info = tarfile.TarInfo(p.name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))

    def verdicts(self) -> dict:
        items = self.results["items"]
        renders = {k: v for k, v in items.items() if k.startswith("render:") and "-" not in k.split(":")[-1]}
        v: dict = {}
        if renders:
            v["renders_ok"] = {k: bool(r.get("mp4", {}).get("ok")) for k, r in renders.items()}
        trace = self.results.get("trace", {})
        v["trace_ok"] = bool(trace.get("ok"))  # under the cap, one holder per GPU, NVML attribution complete
        v["trace_under_cap"] = trace.get("over_cap_count") == 0 and trace.get("rule_samples", 0) > 0
        v["one_holder_per_gpu"] = trace.get("co_resident_count") == 0 and not trace.get("event_log_overlaps")
        if "decode-1v2" in items and items["decode-1v2"].get("speedup") is not None:
            v["decode_speedup_ge_1.6"] = items["decode-1v2"]["speedup"] >= 1.6
        tp1, tp2 = items.get("tp1-steps", {}), items.get("tp2-steps", {})
        for label, target in zip(SCALING_SHAPES, (1.5, 1.7)):
            a, b = (tp1.get(label) or {}).get("s_per_step"), (tp2.get(label) or {}).get("s_per_step")
            if a and b:
                v[f"tp_scaling_{label}"] = {"x": round(a / b, 2), "target": target, "ok": a / b >= target}
        gbps = [g for r in renders.values() for g in r.get("timing", {}).get("stages", {}).get("dit", {}).get(
            "load_gbps", [])]
        if gbps:
            v["dit_load_gbps_per_rank"] = {"values": gbps, "ok": min(gbps) >= 2.0}
        big = next((r for k, r in renders.items() if k.endswith("1920x1088x124")), None)
        if big and big.get("memory", {}).get("host_pss_peak_gib") is not None:
            m = big["memory"]
            v["host_memory_1920_le_64gib"] = {"pss_gib": m["host_pss_peak_gib"], "rss_gib": m["host_rss_peak_gib"],
                                              "ok": m["host_pss_peak_gib"] <= 64}
        for k in ("fl2va", "lora"):
            if k in items:
                v[f"{k}_ok"] = bool(items[k].get("mp4", {}).get("ok"))
        if "parity" in items and "error" not in items["parity"]:
            p = items["parity"]
            v["seed_parity"] = {"mp4_identical": p["mp4_identical"], "latents_identical": p["latents_identical"],
                                "tp_ranks_equal": p.get("tp_ranks_equal")}
        ranks = [r["latents"]["ranks_equal"] for r in renders.values() if r.get("latents", {}).get("jobs")]
        if ranks:
            v["tp_ranks_bitwise_equal_all_renders"] = all(ranks)
        return v


ALLREDUCE_SCRIPT = '''
import json, sys, time
import torch, torch.distributed as dist

rows, hidden, per_step, backend = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group(backend)
rank = dist.get_rank()
dev = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
if backend == "nccl":
    torch.cuda.set_device(dev)
sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
out = {}
for label, n in rows.items():
    x = torch.randn(n, hidden, device=dev)
    for _ in range(3):
        dist.all_reduce(x)
    sync()
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    sync()
    per = (time.perf_counter() - t) / reps
    out[label] = {"rows": n, "hidden": hidden, "dtype": "float32", "per_allreduce_s": round(per, 6),
                  "allreduces_per_step": per_step, "per_step_s": round(per * per_step, 4)}
    del x
if rank == 0:
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="rule", choices=("rule", "scale"))
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default="out/two_gpu")
    ap.add_argument("--work-dir", default="", help="run dirs, MP4s, logs (default /tmp/h3bench[-tiny])")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny weights, virtual devices")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no item that would end past this many seconds (default 530; 3600 with --tiny)")
    ap.add_argument("--cap-gb", type=float, default=22.0, help="per-GPU memory cap (GiB), all our processes together")
    ap.add_argument("--steps", type=int, default=0, help="sampling steps (default 8; 2 with --tiny)")
    ap.add_argument("--only", default="", help="comma-separated item names to run (the stack starts as needed)")
    ap.add_argument("--skip", default="", help="comma-separated item names to skip")
    ap.add_argument("--period-s", type=float, default=0.25, help="memory sampling period")
    ap.add_argument("--context-gib", type=float, default=0.5, help="a bare CUDA context, when none was measured")
    ap.add_argument("--holder-margin-gib", type=float, default=1.5,
                    help="a process holds weights when above its idle footprint by more than this")
    ap.add_argument("--write-weights", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--weights-files", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_weights:
        names = set(args.weights_files.split(",")) if args.weights_files else None
        print(json.dumps(write_weights(Path(args.models_dir), args.tiny, names)), flush=True)
        return 0
    for k, v in NCCL_SAFE.items():
        os.environ.setdefault(k, v)
    return run(Bench, args)


def run(bench_cls: type, args) -> int:
    """One part of a bench driver; a SIGTERM (a time limit) still stops the stages and writes the trace, plot and
    verdicts. Exit code 1 when an item failed (its `error` in the JSON), so a run whose items all failed never
    reads as a success; items skipped for the budget are not failures (the log names the --only that reruns
    them), and `ok: false` verdicts are measurements that missed a target, not failures of the run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = bench_cls(args)
    try:
        bench.run_part()
    finally:
        bench.finish()
    failed = {k: r["error"] for k, r in bench.results["items"].items() if "error" in r}
    for name, error in failed.items():
        lines = str(error).strip().splitlines() or [""]  # a child's traceback: its first and its last line
        print(f"FAILED {name}: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else ""), file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(bench.results['items'])} items failed (details in "
              f"{bench.out / f'bench_{bench.part}.log'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
