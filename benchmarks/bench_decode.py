#!/usr/bin/env python
"""Decoder memory/speed: peak memory per rank and time for the sharded video decode (+ audio).

Each rank holds the full VAE decoder and decodes every N-th tile x chunk unit; this script plays one
rank at a time on the local device (units r, r+N, ...), which is exactly one rank's work and memory,
so "fits in 22 GiB per rank with 2 ranks" is measured without a second GPU.

    python benchmarks/bench_decode.py                       # CPU: tiny config, 832x480x124
    python benchmarks/bench_decode.py --full --ranks 2 --sizes 832x480x124 1920x1088x124 --json out.json   # GPU

Weights are random (fp16 on the GPU, as the ComfyUI file), built in memory.
"""

import argparse
import json
import time
from dataclasses import replace

import torch

from minimax_h3.contract import AUDIO_LATENTS, SAMPLE_OUTPUTS, VIDEO_LATENTS, RenderSpec, tensor_shapes
from minimax_h3.vae.audio import AudioVAE, AudioVAEConfig, random_init_
from minimax_h3.vae.tiling import StreamingAssembler, plan_decode
from minimax_h3.vae.video import VideoVAE, VideoVAEConfig, decode_unit

GIB = 2**30


def build_video(cfg: VideoVAEConfig, device: str, dtype: torch.dtype) -> VideoVAE:
    with torch.device("meta"):
        m = VideoVAE(cfg, parts="decoder")
    sd = {}
    g = torch.Generator().manual_seed(0)
    for k, p in m.state_dict().items():
        t = torch.randn(p.shape, generator=g) * (0.02 if p.ndim > 1 else 0.1)
        if k.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")):
            t = torch.ones(p.shape)
        sd[k] = t.to(dtype if p.ndim > 1 else torch.float32)
    m.load_state_dict(sd, assign=True)
    return m.to(device).eval()


def run_rank(model, lat, plan, rank, ranks, device, autocast):
    mine = plan[rank::ranks]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs = {}
    with torch.inference_mode():
        for u in mine:
            outs[u.index] = decode_unit(model, lat, u, autocast_dtype=autocast, validate=False).cpu()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else float("nan")
    return outs, secs, peak, len(mine)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="full-size VAE (GPU); default tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", nargs="+", default=["832x480x124"])
    ap.add_argument("--cap-gib", type=float, default=22.0, help="per-process memory cap on the GPU")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.full and device == "cpu":
        raise SystemExit("--full needs a GPU")
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
    vcfg = VideoVAEConfig.full() if args.full else VideoVAEConfig.tiny()
    wdtype = torch.float16 if device == "cuda" else torch.float32
    autocast = torch.float16 if device == "cuda" else None
    model = build_video(vcfg, device, wdtype)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    acfg = AudioVAEConfig.full() if args.full else AudioVAEConfig.tiny()
    acfg = replace(acfg, with_encoder=False)
    audio = random_init_(AudioVAE(acfg), 0).to(device).eval()
    results = []
    print(f"video VAE decoder weights {weights_gib:.2f} GiB ({wdtype}), device {device}, cap {args.cap_gib} GiB")
    print(f"{'size':>14} {'units':>6} {'rank':>4} {'secs':>7} {'peak GiB':>9} {'fits':>5}")
    for size in args.sizes:
        w, h, f = (int(x) for x in size.split("x"))
        spec = RenderSpec(width=w, height=h, frames=f)
        lat = torch.randn(tensor_shapes(SAMPLE_OUTPUTS, spec)[VIDEO_LATENTS])
        plan = plan_decode(vcfg, *lat.shape[1:])
        asm = StreamingAssembler(plan)
        per_rank = []
        for r in range(args.ranks):
            outs, secs, peak, n = run_rank(model, lat, plan, r, args.ranks, device, autocast)
            for idx, o in outs.items():
                asm.add(plan[idx], o)
            fits = "yes" if peak != peak or peak <= args.cap_gib else "NO"
            print(f"{size:>14} {n:>6} {r:>4} {secs:>7.2f} {peak:>9.2f} {fits:>5}")
            per_rank.append(dict(rank=r, units=n, seconds=secs, peak_gib=peak))
        frames = asm.finish()
        if not torch.isfinite(frames).all():
            raise SystemExit("non-finite pixels: the benchmark is broken")
        t0 = time.perf_counter()
        with torch.inference_mode():
            lat_a = torch.randn(tensor_shapes(SAMPLE_OUTPUTS, spec)[AUDIO_LATENTS])
            wav = audio.decode_rows(audio.batch_to_rows(lat_a.to(device)))
        if device == "cuda":
            torch.cuda.synchronize()
        audio_s = time.perf_counter() - t0
        print(f"{size:>14} audio decode {audio_s:.2f} s ({wav.shape[-1]} samples x 2 ch); frames {tuple(frames.shape)}")
        results.append(dict(size=size, units=len(plan), ranks=per_rank, audio_seconds=audio_s,
                            one_rank_seconds=sum(p["seconds"] for p in per_rank),
                            n_rank_seconds=max(p["seconds"] for p in per_rank)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device, weights_gib=weights_gib, results=results), fh, indent=2)


if __name__ == "__main__":
    main()
