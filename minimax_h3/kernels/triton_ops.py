"""What the project's Triton kernels share (minimax_h3/kernels/qk_norm_rope.py, minimax_h3/kernels/fp8_rows.py, the quantiser of
minimax_h3/kernels/fp8_attention.py): the optional import, the CPU-interpreter check, and a GPU kernel's fallback.

- `triton` / `tl` / `libdevice` are None where Triton does not import (the CPU build of torch ships without it; a
  broken install counts as missing): every kernel then has its plain-torch reference.
- `interpreting(kernel)`: Triton's CPU interpreter (TRITON_INTERPRET=1 before the import) replaces @triton.jit
  functions by interpreted ones; the tests use it to check a kernel's indexing and masking without a GPU.
- `KernelFallback`: a kernel that fails to build or run on a GPU (an architecture Triton cannot target, a
  compiler bug) must not take the stage down while the exact same math exists in plain torch. The first failure
  on a device is logged once as a warning with the error, and from then on the reference serves that device.
  Out-of-memory is not a kernel fault and propagates; so does any failure while torch.compile traces.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, TypeVar

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # CUDA's libm (e.g. expf as torch's CUDA kernels call it)
except Exception:  # ImportError, or a broken install: the references serve
    triton = tl = libdevice = None

T = TypeVar("T")


def interpreting(kernel: object) -> bool:
    """Whether `kernel` (an @triton.jit function) runs in Triton's CPU interpreter."""
    return triton is not None and not isinstance(kernel, triton.runtime.JITFunction)


@functools.cache
def log_once(logger: logging.Logger, msg: str) -> None:
    logger.info(msg)


class KernelFallback:
    """One kernel's devices where it failed, and why (see the module docstring)."""

    def __init__(self, what: str, logger: logging.Logger):
        self.what, self.log = what, logger
        self._failed: dict[torch.device, str] = {}

    def reason(self, device: torch.device) -> str | None:
        """Why the kernel no longer runs on `device`, or None."""
        return self._failed.get(device)

    def dispatch(self, device: torch.device, unsupported: str | None, kernel: Callable[[], T],
                 reference: Callable[[], T]) -> T:
        """kernel() when `unsupported` (the caller's check of its arguments: why the kernel does not serve them)
        is None and the kernel has not failed on `device`; otherwise, or when it fails now, reference(). A GPU
        that falls back logs why, once per reason (not while torch.compile traces)."""
        reason = unsupported if unsupported is not None else self.reason(device)
        if reason is None:
            ok, result = self.run(device, kernel)
            if ok:
                return result
            reason = result
        if device.type == "cuda" and not torch.compiler.is_compiling():
            log_once(self.log, f"{self.what}: plain torch ({reason})")
        return reference()

    def run(self, device: torch.device, kernel: Callable[[], T]) -> tuple[bool, T | str]:
        """(True, kernel()) or, when it raised (not out-of-memory, not while compiling), (False, why): the caller
        then runs the reference, which rewrites every output."""
        try:
            return True, kernel()
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            if torch.compiler.is_compiling():
                raise
            why = self._failed[device] = f"the Triton kernel failed on {device}: {type(e).__name__}: {str(e)[:300]}"
            self.log.warning("%s: %s; running the plain-torch reference on that device from now on", self.what, why)
            return False, why
