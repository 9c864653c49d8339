#!/usr/bin/env python
"""Text encoder throughput and memory per checkpoint format and residency mode.

    python benchmarks/bench_encoder.py                  # CPU: the tiny model, every variant x mode
    python benchmarks/bench_encoder.py --tokens 512 --json out.json

For each (variant, mode): load time, tokens/s for one prompt of --tokens tokens, and the weight bytes the
conditioner keeps on its device (`device_bytes`; in stream mode the weights stay on the host and each layer is
moved in only while it runs) plus the CUDA peak on a GPU. Outputs of all modes are compared with resident.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from minimax_h3.text.conditioner import Conditioner, ConditionerConfig
from minimax_h3.text.tiny import VARIANTS, write_tiny_model

MODES = ("resident", "stream", "compact")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "fp32"], choices=VARIANTS)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ConditionerConfig.tiny()
    ids = torch.randint(0, 256, (args.tokens,), generator=torch.Generator().manual_seed(0))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        print(f"{'variant':>13} {'mode':>9} {'load s':>7} {'tok/s':>10} {'device MiB':>11} {'peak MiB':>9} {'max |d|':>8}")
        for variant in args.variants:
            path = write_tiny_model(Path(d) / variant, variant=variant, with_visual=False)
            ref = None
            for mode in MODES:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                m = Conditioner.load(path, cfg, device=device, mode=mode)
                load_s = time.perf_counter() - t0
                m.encode_ids(ids)  # warm-up
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    out = m.encode_ids(ids).float().cpu()
                tok_s = args.tokens * args.repeats / (time.perf_counter() - t0)
                ref = out if ref is None else ref
                diff = float((out - ref).abs().max())
                peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
                dev_mib = m.device_bytes() / 2**20
                print(f"{variant:>13} {mode:>9} {load_s:>7.3f} {tok_s:>10.0f} {dev_mib:>11.2f} {peak:>9.1f} {diff:>8.1e}")
                rows.append(dict(variant=variant, mode=mode, load_s=load_s, tokens_per_s=tok_s,
                                 device_mib=dev_mib, peak_mib=peak, max_abs_diff_vs_resident=diff))
                m.close()
                del m
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, tokens=args.tokens, rows=rows), indent=2))


if __name__ == "__main__":
    main()
