"""minimax_h3/kernels/triton_ops.py: a GPU kernel that fails falls back to its reference on that device, once, loudly."""

import logging

import pytest
import torch

from minimax_h3.kernels.triton_ops import KernelFallback


def test_a_failing_kernel_is_recorded_per_device_and_logged(caplog):
    fb = KernelFallback("test kernel", logging.getLogger("test.triton_kernels"))
    cpu, other = torch.device("cpu"), torch.device("meta")
    assert fb.run(cpu, lambda: 7) == (True, 7) and fb.reason(cpu) is None

    def broken():
        raise RuntimeError("PTX target sm_75 is not supported")

    with caplog.at_level(logging.WARNING, logger="test.triton_kernels"):
        ok, why = fb.run(cpu, broken)
    assert not ok and "RuntimeError: PTX target sm_75 is not supported" in why
    assert fb.reason(cpu) == why and fb.reason(other) is None
    assert "test kernel" in caplog.text and "plain-torch reference" in caplog.text


def test_out_of_memory_is_not_a_kernel_fault():
    fb = KernelFallback("test kernel", logging.getLogger("test.triton_kernels"))

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        fb.run(torch.device("cpu"), oom)
    assert fb.reason(torch.device("cpu")) is None


def test_dispatch_runs_the_kernel_or_the_reference():
    """dispatch: the kernel where the arguments are served and it has not failed; the reference when the caller's
    check says no, when the kernel fails now, and from then on for that device."""
    fb = KernelFallback("test kernel", logging.getLogger("test.triton_kernels"))
    cpu = torch.device("cpu")
    calls = []

    def kernel():
        calls.append("kernel")
        return "kernel"

    assert fb.dispatch(cpu, None, kernel, lambda: "reference") == "kernel"
    assert fb.dispatch(cpu, "shape not served", kernel, lambda: "reference") == "reference"
    assert calls == ["kernel"]

    def broken():
        raise RuntimeError("no kernel image")

    assert fb.dispatch(cpu, None, broken, lambda: "reference") == "reference"
    assert fb.dispatch(cpu, None, kernel, lambda: "reference") == "reference"  # the device is off the kernel now
    assert calls == ["kernel"] and "no kernel image" in fb.reason(cpu)
