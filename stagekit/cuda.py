"""The CUDA facts a stage process needs without initialising CUDA itself: a device's index, and each visible GPU's
UUID and memory, read once in a short-lived child (stagekit/child.py)."""

from __future__ import annotations

import functools

from stagekit.child import run_in_child
from stagekit.errors import Unavailable


def _cuda_properties() -> dict[int, tuple[str, int]]:
    import torch

    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {i: ("GPU-" + str(p.uuid), p.total_memory) for i, p in enumerate(props)}


@functools.cache
def _visible() -> dict[int, tuple[str, int]]:
    """Every visible device's facts, read once per process."""
    return run_in_child(_cuda_properties)


def cuda_index(device: str) -> int:
    """"cuda:1" -> 1; "cuda" -> 0."""
    return int(device.split(":")[1]) if ":" in device else 0


def cuda_properties(indices: list[int]) -> dict[int, tuple[str, int]]:
    """{index: (GPU UUID as "GPU-...", total bytes)} of this process's CUDA devices, read in a child (once per
    process, all visible devices), so the stage process never initialises CUDA."""
    if not indices:
        return {}
    visible = _visible()
    missing = sorted(set(indices) - set(visible))
    if missing:
        raise Unavailable(f"CUDA devices {missing} are not visible to this process ({len(visible)} are: "
                          "check --devices and CUDA_VISIBLE_DEVICES)")
    return {i: visible[i] for i in indices}
