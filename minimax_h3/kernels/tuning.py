"""Per-device tuned values, from tuning.json beside this file.

What a benchmark decided for one GPU architecture is data here, not a constant in code: the Triton kernels' launch
parameters (block sizes, warps), the DiT's default row chunks, whether fp8 GEMMs accumulate fast, and which fused
fp8 row kernels also run inside compiled blocks. The table is keyed by architecture (`arch_key`: "sm_90" for H100 /
H200, ...); each entry holds, per name, the values its benchmark found best on the device the entry names, with the
benchmark's command. Its "default" names the entry that an architecture without one gets, and the CPU (where
Triton only interprets). Tuning a new device means running those benchmarks there and adding its architecture's
entry, with every name the default entry has.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

TABLE = Path(__file__).with_name("tuning.json")
DEFAULT = "default"
META_KEYS = ("benchmark", "measured_on")  # an entry's notes, not values (measured_on: where it differs from the
# architecture entry's device)
GPU_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


def arch_key(device: torch.device | str) -> str:
    """"cpu" or the nearest GPU_ARCHS entry at or below the device's compute capability (e.g. sm_90 for H100/H200)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    cc = major * 10 + minor
    best = "sm_75"
    for a in GPU_ARCHS:
        if int(a[3:]) <= cc:
            best = a
    return best


@functools.cache
def _table() -> dict:
    return json.loads(TABLE.read_text())


@functools.cache
def arch_entry(arch: str) -> dict:
    """The table entry for `arch` ("sm_90", "cpu", ...): its own, else the one "default" names."""
    table = _table()
    entry = table.get(arch)
    return entry if isinstance(entry, dict) else table[table[DEFAULT]]


def tuned(name: str, arch: str) -> dict:
    """The values of `name` (a tuning.json key, e.g. "swiglu_fp8_rows", "chunk_rows") for architecture `arch`."""
    entry = arch_entry(arch)
    if name not in entry:
        raise KeyError(f"{TABLE.name} has no {name!r} entry for {entry.get('measured_on', arch)}; "
                       f"names listed: {sorted(k for k in entry if k != 'measured_on')}")
    return {k: v for k, v in entry[name].items() if k not in META_KEYS}


def launch_params(kernel: str, device: torch.device | str) -> dict[str, int]:
    """The launch parameters of Triton kernel `kernel` on `device`."""
    return tuned(kernel, arch_key(device))


@dataclass(frozen=True)
class ChunkRows:
    """The DiT's default row chunk (minimax_h3/dit/model.py Block; docs/memory.md) per way of running its blocks."""

    eager: int  # eager blocks: bounds their fp32 norm / RoPE / modulation temporaries
    compiled_tp: int  # compiled blocks on several TP ranks: each chunk's all-reduce overlaps the next chunk's GEMMs
    compiled_one: int  # compiled blocks on one TP rank: nothing to overlap, no temporaries to bound

    def pick(self, compile_blocks: bool, tp_size: int) -> int:
        if not compile_blocks:
            return self.eager
        return self.compiled_one if tp_size == 1 else self.compiled_tp


def chunk_rows(arch: str) -> ChunkRows:
    return ChunkRows(**tuned("chunk_rows", arch))


def fp8_fast_accum(arch: str) -> bool:
    """Whether fp8 GEMMs use the tensor cores' fast (reduced-precision) accumulation on `arch` (torch._scaled_mm
    use_fast_accum): without it cuBLAS promotes the partial sums to fp32 every few K steps, slower and more exact."""
    return bool(tuned("fp8_fast_accum", arch)["enabled"])
