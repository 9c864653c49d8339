"""A persistent torch.compile cache, so a restarted stage reaches its first step without recompiling.

torch.compile keeps two on-disk caches under one directory: inductor's FX graph cache (generated code and
compiled Triton / C++ kernels of each graph) and the AOT-autograd cache (the traced forward before inductor). Both
key every entry by the graph itself (ops, input shapes and dtypes, so the chosen kernels and the shape are in the
key), inductor's config and the torch build. What they lack by default is persistence: the directory is a
per-user folder under the system temp dir. `enable_compile_cache` points both at a folder of the stage's cache
dir, one per torch version / CUDA version / GPU architecture, so caches of different builds never mix and old
ones can be deleted as a whole. Dynamo still traces Python on each start (seconds); the compile itself (tens of
seconds per shape for the DiT blocks) becomes a cache load
(docs/kernels.md, "No compile tax on restart").

torch reads the location from the TORCHINDUCTOR_CACHE_DIR environment variable at every cache access (it has no
config attribute for it), so that is what this sets; TRITON_CACHE_DIR, when the user set it, still wins for the
Triton kernels. Enabling costs nothing when nothing compiles: inductor's config (seconds to import) is not imported
here. Both caches are on by default; a user who forces one off in the environment (TORCHINDUCTOR_FX_GRAPH_CACHE=0,
TORCHINDUCTOR_AUTOGRAD_CACHE=0) keeps it off.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

INDUCTOR_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_key(device: torch.device | str) -> str:
    """e.g. "torch-2.11.0+cu130-cuda-13.0-sm_90" or "torch-2.13.0+cpu-cpu"."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"cuda-{torch.version.cuda}-sm_{major}{minor}"
    else:
        where = device.type
    return re.sub(r"[^A-Za-z0-9._+-]", "_", f"torch-{torch.__version__}-{where}")


def enable_compile_cache(root: Path, device: torch.device | str) -> Path:
    """Use `root/<cache_key(device)>` for torch.compile's FX-graph and AOT-autograd caches (created if needed);
    returns that directory. Call before the first compilation of the process."""
    path = Path(root).expanduser() / cache_key(device)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_DIR_ENV] = str(path)
    if "torch._inductor.utils" in sys.modules:  # something compiled before: drop lookups memoised elsewhere
        from torch._inductor import utils as inductor_utils

        if hasattr(inductor_utils, "clear_caches"):
            inductor_utils.clear_caches()
    return path
