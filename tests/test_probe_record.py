"""The start-up kernel probe's outcome, remembered per machine (minimax_h3.kernels.registry.select_kernels_remembered):
measured once, read back by a later start with the same fingerprint, measured again when anything in it changes or
the record cannot be read."""

import json

import torch

from minimax_h3.kernels.registry import (KernelConfig, KernelSelection, ProbeResult, select_kernels,
                                         select_kernels_remembered)


class Counting:
    """select_kernels on the CPU with the fallbacks forced (no race to time), counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, device, cfg) -> KernelSelection:
        self.calls += 1
        return select_kernels(device, cfg)


def test_a_probe_is_measured_once_per_machine_and_measured_again_when_its_key_changes(tmp_path):
    cfg = KernelConfig(linear_kernel="fp32", attention_kernel="math", compute_dtype=torch.float32,
                       linear_shapes=((8, 64, 32),), attention_shape=(1, 2, 16, 8), probe_iters=1)
    select = Counting()
    first = select_kernels_remembered("cpu", cfg, tmp_path, select)
    (record,) = tmp_path.glob("kernel_probe_*.json")
    again = select_kernels_remembered("cpu", cfg, tmp_path, select)
    assert select.calls == 1, "the second start read the record"
    assert (again.linear, again.attention, again.arch) == (first.linear, first.attention, first.arch)
    assert [c.kernel for c in again.choices] == [c.kernel for c in first.choices]
    assert all(f"remembered in {record}" in c.reason and c.reason.startswith(f.reason)
               for c, f in zip(again.choices, first.choices))
    assert all(isinstance(r, ProbeResult) for rs in again.probes.values() for r in rs)
    assert again.make_linear(torch.randn(4, 8)).weight.shape == (4, 8), "a record's selection serves like a probed one"

    other = KernelConfig(linear_kernel="bf16", attention_kernel="math", compute_dtype=torch.float32,
                         linear_shapes=((8, 64, 32),), attention_shape=(1, 2, 16, 8), probe_iters=1)
    assert select_kernels_remembered("cpu", other, tmp_path, select).linear == "bf16"
    assert select.calls == 2 and len(list(tmp_path.glob("kernel_probe_*.json"))) == 2

    record.write_text("{not json")
    select_kernels_remembered("cpu", cfg, tmp_path, select)
    assert select.calls == 3 and json.loads(record.read_text())["linear"] == "fp32", "an unreadable record is replaced"
    assert not list(tmp_path.glob(".kernel_probe_*")), "no temp file left"
    select_kernels_remembered("cpu", cfg, None, select)
    assert select.calls == 4, "no cache directory: measured"
