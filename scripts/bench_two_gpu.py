#!/usr/bin/env python
"""Two-GPU run: DiT TP2 + decoder sharded over the same 2 GPUs, exclusive residency, full-size random weights.

    python scripts/bench_two_gpu.py --models-dir /tmp/h3models --out $OUT [--cap-gb 22]

1. Writes full-size random weights in the real ComfyUI layouts (DiT int8_convrot, video VAE fp16, audio VAE
   fp32), so the real loaders and per-rank slicing run.
2. Starts the DiT (torchrun, 2 ranks) and the decoder (torchrun, 2 ranks) on cuda:0,cuda:1 in exclusive mode
   with a per-process CUDA cap, samples per-GPU memory every 0.5 s (nvidia-smi, per process -> stage).
3. Renders 832x480x124, 8 steps (text states random [38, 5120]: the encoder stage is not part of this run),
   writes the MP4, then measures DiT s/step TP2 vs TP1 at 832x480x124 and 1344x768x124, the all-reduce
   share of a step, and prints/writes a JSON summary.
"""

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import grpc
import torch

from client.embedded import EmbeddedStack, StackConfig
from client.pipeline import decode_raw, sample
from client.stubs import Endpoints, StageClients
from stagekit.render_params import RenderSpec

TEXT_LEN, TEXT_DIM = 38, 5120


def write_weights(models: Path, tiny: bool) -> None:
    from decoder_svc.audio_vae import AudioVAEConfig, write_tiny_audio_vae
    from decoder_svc.video_vae import VideoVAEConfig, write_tiny_video_vae
    from dit_svc.config import DiTConfig
    from dit_svc.tiny_checkpoint import write_random_int8_convrot_checkpoint

    models.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    dit = models / "minimax_h3_random_int8_convrot.safetensors"
    if not dit.exists():
        dcfg = DiTConfig.tiny(text_dim=TEXT_DIM) if tiny else DiTConfig.full()
        write_random_int8_convrot_checkpoint(dcfg, dit, device="cpu" if tiny else "cuda", quantize=False)
    vae = models / "minimax_h3_video_vae_random_fp16.safetensors"
    if not vae.exists():
        write_tiny_video_vae(str(vae), VideoVAEConfig.tiny() if tiny else VideoVAEConfig.full(), 0)
    avae = models / "minimax_h3_audio_vae_random_fp32.safetensors"
    if not avae.exists():
        acfg = AudioVAEConfig.tiny() if tiny else AudioVAEConfig.full()
        write_tiny_audio_vae(avae, acfg, 0)
    print(f"weights written in {time.monotonic() - t0:.1f} s: " +
          ", ".join(f"{p.name} {p.stat().st_size / 2**30:.1f} GiB" for p in sorted(models.iterdir())), flush=True)


class MemorySampler(threading.Thread):
    """nvidia-smi every 0.5 s: per GPU, which stage processes hold how much memory."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop_evt = period, [], threading.Event()
        self.gpu_of = {}
        if not torch.cuda.is_available():
            self.stop_evt.set()
            return
        uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip().splitlines()
        self.gpu_of = {u.split(",")[1].strip(): int(u.split(",")[0]) for u in uuids}

    @staticmethod
    def stage_of(pid: str) -> str:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return "?"
        for s in ("dit_svc", "decoder_svc", "encoder_svc"):
            if s in cmd:
                return s.split("_")[0]
        return "other"

    def run(self):
        while not self.stop_evt.is_set():
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            rec = {"t": time.time(), "gpus": {}}
            for line in out.strip().splitlines():
                pid, uuid, mib = (x.strip() for x in line.split(","))
                gpu = self.gpu_of.get(uuid, -1)
                rec["gpus"].setdefault(gpu, []).append((self.stage_of(pid), int(mib)))
            self.samples.append(rec)
            time.sleep(self.period)

    def summary(self):
        worst = 0
        peak = {}
        for rec in self.samples:
            for gpu, procs in rec["gpus"].items():
                stages = {s for s, mib in procs if s in ("dit", "decoder", "encoder") and mib > 0}
                worst = max(worst, len(stages))
                for s, mib in procs:
                    peak[(gpu, s)] = max(peak.get((gpu, s), 0), mib)
        return {"max_stages_resident_per_gpu": worst, "samples": len(self.samples),
                "peak_mib": {f"gpu{g}:{s}": v for (g, s), v in sorted(peak.items())}}


def step_stats(events) -> float:
    ms = [e.step_ms for e in events if e.stage == "dit" and e.step_ms > 0]
    return statistics.median(ms[1:] if len(ms) > 1 else ms) / 1000 if ms else float("nan")


def time_dit(ep: str, spec: RenderSpec, text: torch.Tensor) -> float | str:
    """Median s/step, or the error a caller would have seen (e.g. RESOURCE_EXHAUSTED under the memory cap)."""
    events = []
    try:
        with StageClients(Endpoints(encoder=ep, dit=ep, decoder=ep)) as c:
            sample(c, spec, text, on_progress=events.append)
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()[:120]}"
    return step_stats(events)


def allreduce_share(s_rows: int, reps: int = 20) -> float:
    """Seconds of the 100 fp32 [S, 5376] all-reduces of one TP2 step (2 per block x 50 blocks)."""
    code = f"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r)
x = torch.randn({s_rows}, 5376, device="cuda")
for _ in range(3): dist.all_reduce(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range({reps}): dist.all_reduce(x)
torch.cuda.synchronize()
if r == 0: print((time.perf_counter() - t) / {reps} * 100)
dist.destroy_process_group()
"""
    script = Path(f"/tmp/allreduce_{s_rows}.py")
    script.write_text(code)
    out = subprocess.run(["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(out.stderr[-2000:])
        return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", default="/tmp/h3models")
    ap.add_argument("--out", default=".")
    ap.add_argument("--cap-gb", type=float, default=22.0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run of this script with tiny weights")
    ap.add_argument("--skip-big", action="store_true", help="time only 832x480x124")
    args = ap.parse_args()
    devices = "virt0,virt1" if args.tiny else "cuda:0,cuda:1"
    out = Path(args.out)
    models = Path(args.models_dir)
    write_weights(models, args.tiny)
    result = {}
    text = torch.randn(TEXT_LEN, TEXT_DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cap = [] if args.tiny else ["--gpu-memory-cap-gb", str(args.cap_gb)]
    sampler = MemorySampler()
    sampler.start()
    stack = EmbeddedStack(StackConfig(ranks={"dit": 2, "decoder": 2}, models_dir=str(models), devices=devices,
                                      run_dir=str(out / "run2"), start_timeout_s=600,
                                      extra_args={"dit": cap, "decoder": cap}))
    try:
        t0 = time.monotonic()
        for s in ("dit", "decoder"):
            stack.start_stage(s)
        for s in ("dit", "decoder"):
            stack.wait_ready(s)
        result["startup_s"] = time.monotonic() - t0
        ep = {s: f"127.0.0.1:{stack.ports[s]}" for s in ("dit", "decoder")}
        spec = RenderSpec(prompt="random", width=832, height=480, frames=124, steps=args.steps, seed=1)
        if args.tiny:
            spec = RenderSpec(prompt="random", width=256, height=256, frames=22, steps=2, seed=1)
        events = []
        with StageClients(Endpoints(encoder=ep["dit"], dit=ep["dit"], decoder=ep["decoder"])) as c:
            v, a, r_dit = sample(c, spec, text, on_progress=events.append)
            # RAW: PyAV does not fit in the device's carry limit beside comfy-kitchen; the frames are checked here.
            frames, wav, r_dec = decode_raw(c, spec, v, a)
            result["frames_shape"], result["audio_shape"] = list(frames.shape), list(wav.shape)
        result["render"] = {
            "dit_wall_s": r_dit.wall_s, "dit_load_s": r_dit.timing.load_s, "dit_lease_wait_s": r_dit.timing.lease_wait_s,
            "dit_s_per_step_tp2": step_stats(events), "decoder_wall_s": r_dec.wall_s,
            "decoder_load_s": r_dec.timing.load_s, "decoder_lease_wait_s": r_dec.timing.lease_wait_s,
            "decoder_compute_s": r_dec.timing.compute_s, "latents_finite": bool(torch.isfinite(v).all())}
        print("render:", json.dumps(result["render"]), flush=True)
        big = RenderSpec(prompt="random", width=1344, height=768, frames=124, steps=3, seed=1)
        small = RenderSpec(prompt="random", width=832, height=480, frames=124, steps=3, seed=1)
        if args.tiny:
            big = small = RenderSpec(prompt="random", width=256, height=256, frames=22, steps=2, seed=1)
        result["tp2"] = {"832x480x124": time_dit(ep["dit"], small, text)}
        if not args.skip_big:
            result["tp2"]["1344x768x124"] = time_dit(ep["dit"], big, text)
        print("tp2 s/step:", result["tp2"], flush=True)
        stack.stop()
        sampler.stop_evt.set()
        result["memory"] = sampler.summary()
        one = EmbeddedStack(StackConfig(ranks={"dit": 1}, models_dir=str(models), devices=devices.split(",")[0],
                                        run_dir=str(out / "run1"), start_timeout_s=600))
        one.start_stage("dit")
        one.wait_ready("dit")
        ep1 = f"127.0.0.1:{one.ports['dit']}"
        result["tp1"] = {"832x480x124": time_dit(ep1, small, text)}
        if not args.skip_big:
            result["tp1"]["1344x768x124"] = time_dit(ep1, big, text)
        one.stop()
        print("tp1 s/step:", result["tp1"], flush=True)
        result["scaling_efficiency"] = {k: result["tp1"][k] / (2 * result["tp2"][k]) for k in result["tp1"]
                                        if isinstance(result["tp1"][k], float) and isinstance(result["tp2"].get(k), float)}
        if not args.tiny:
            result["allreduce_s_per_step"] = {"832x480x124": allreduce_share(14882),
                                              "1344x768x124": allreduce_share(37748)}
    finally:
        stack.stop()
        sampler.stop_evt.set()
    result.setdefault("memory", sampler.summary())
    print(json.dumps(result, indent=2))
    (out / "two_gpu.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
