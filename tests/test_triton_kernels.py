"""stagekit/triton_kernels.py: a GPU kernel that fails falls back to its reference on that device, once, loudly."""

import logging

import pytest
import torch

from stagekit.triton_kernels import KernelFallback


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
