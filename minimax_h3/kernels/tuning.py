"""Per-device launch parameters of the Triton kernels (block sizes, warps), from tuning.json beside this file.

The table is keyed by GPU architecture (`registry.arch_key`: "sm_90" for H100 / H200, ...); each entry holds, per
kernel, the launch parameters its benchmark found fastest on the device it names. A device whose architecture has
no entry gets the nearest listed one (by compute capability; the CPU, where Triton only interprets, the lowest).
Re-tuning for a new device means running the kernel's benchmark there and adding its architecture's entry.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .registry import arch_key

TABLE = Path(__file__).with_name("tuning.json")
META_KEYS = ("benchmark",)  # an entry's notes, not launch parameters


@functools.cache
def _table() -> dict[str, dict]:
    return {k: v for k, v in json.loads(TABLE.read_text()).items() if k.startswith("sm_")}


def _capability(arch: str) -> int:
    return int(arch[3:]) if arch.startswith("sm_") else 0


@functools.cache
def arch_entry(arch: str) -> dict:
    """The table entry for `arch` ("sm_90", "cpu", ...): its own, else the nearest listed architecture's."""
    table = _table()
    if arch in table:
        return table[arch]
    cc = _capability(arch)
    return table[min(table, key=lambda a: (abs(_capability(a) - cc), _capability(a)))]


def launch_params(kernel: str, device: torch.device | str) -> dict[str, int]:
    """The launch parameters of `kernel` (a tuning.json key, e.g. "swiglu_fp8_rows") on `device`."""
    entry = arch_entry(arch_key(device))
    if kernel not in entry:
        raise KeyError(f"{TABLE.name} has no {kernel!r} entry for {entry.get('measured_on', 'this architecture')}; "
                       f"kernels listed: {sorted(k for k in entry if k != 'measured_on')}")
    return {k: v for k, v in entry[kernel].items() if k not in META_KEYS}
