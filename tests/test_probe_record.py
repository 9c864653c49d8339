"""The start-up kernel probe's outcome, remembered per machine (minimax_h3.kernels.registry.select_kernels_remembered):
measured once, read back by a later start with the same fingerprint, measured again when anything in it changes or
the record cannot be read."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from minimax_h3.kernels import registry
from minimax_h3.kernels.registry import (PROBE_RECORD_MAX_BYTES, KernelConfig, KernelSelection, ProbeResult,
                                         probe_fingerprint, select_kernels, select_kernels_remembered)

CFG = KernelConfig(linear_kernel="fp32", attention_kernel="math", compute_dtype=torch.float32,
                   linear_shapes=((8, 64, 32),), attention_shape=(1, 2, 16, 8), probe_iters=1)


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


def remembered(tmp_path: Path) -> tuple[Counting, Path, dict]:
    """A record of CFG's probe, written by a first start: (the counting probe, the record, its contents)."""
    select = Counting()
    select_kernels_remembered("cpu", CFG, tmp_path, select)
    (record,) = tmp_path.glob("kernel_probe_*.json")
    return select, record, json.loads(record.read_text())


def edit(rec: dict, where: str, value) -> dict:
    """`rec` with the value at `where` ("linear", "choices.0.kernel", "probes.linear.0.ok") set to `value`."""
    rec = json.loads(json.dumps(rec))
    *path, last = where.split(".")
    node = rec
    for k in path:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[int(last) if isinstance(node, list) else last] = value
    return rec


@pytest.mark.parametrize("where, value", [
    ("linear", "no_such_kernel"),           # a kernel the registry does not have
    ("attention", 42),                      # not a kernel name at all
    ("linear", "bf16"),                     # a kernel of the registry, but not the one the probe of CFG chose
    ("attention", "int8"),                  # nor a candidate of this device's probe
    ("choices.0.kernel", "bf16"),           # its Status rows name another kernel than its selection
    ("probes.linear.0.ok", False),          # its own results rejected the kernel it names
    ("probes.linear.0.kernel", "bf16"),     # results of a kernel the probe did not run
    ("arch", "sm_90"),                      # measured on another architecture
    ("probes.attention", [{"kernel": "math", "ok": True, "ms": "fast"}]),  # a result that is not one
])
def test_a_record_the_registry_or_the_probe_contradicts_is_measured_again_and_replaced(tmp_path, where, value,
                                                                                       caplog):
    select, record, rec = remembered(tmp_path)
    record.write_text(json.dumps(edit(rec, where, value)))
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        sel = select_kernels_remembered("cpu", CFG, tmp_path, select)
    assert select.calls == 2 and (sel.linear, sel.attention) == ("fp32", "math")
    assert f"kernel probe record {record} not used" in caplog.text
    assert select_kernels_remembered("cpu", CFG, tmp_path, select) and select.calls == 2, \
        "the record was replaced by one the next start reads"


@pytest.mark.parametrize("what", ["empty directory", "symlink to /dev/zero", "fifo", "too long", "too long link"])
def test_what_is_not_a_small_regular_file_at_the_record_path_is_measured_again_and_replaced(tmp_path, what):
    """Read bounded (PROBE_RECORD_MAX_BYTES) and only from a regular file: a directory, a device or a FIFO in the
    record's place neither fails nor hangs the start, and the record written replaces it."""
    select, record, rec = remembered(tmp_path)
    record.unlink()
    if what == "empty directory":
        record.mkdir()
    elif what == "symlink to /dev/zero":
        record.symlink_to("/dev/zero")
    elif what == "fifo":
        os.mkfifo(record)
    else:  # a valid record padded past the bound, in place or behind a link
        target = tmp_path / "elsewhere.json" if what == "too long link" else record
        target.write_text(json.dumps(rec) + " " * PROBE_RECORD_MAX_BYTES)
        if target != record:
            record.symlink_to(target)
    sel = select_kernels_remembered("cpu", CFG, tmp_path, select)
    assert select.calls == 2 and (sel.linear, sel.attention) == ("fp32", "math")
    assert record.is_file() and not record.is_symlink() and json.loads(record.read_text())["linear"] == "fp32"
    assert select_kernels_remembered("cpu", CFG, tmp_path, select) and select.calls == 2, "the new record is read"


def test_a_record_path_that_cannot_be_replaced_leaves_the_start_measured(tmp_path, caplog):
    """A directory with something in it is not ours to remove: the start uses what it measured, says the record was
    not kept, and leaves the directory as it was."""
    select, record, _ = remembered(tmp_path)
    record.unlink()
    record.mkdir()
    (record / "keep").write_text("x")
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        sel = select_kernels_remembered("cpu", CFG, tmp_path, select)
    assert select.calls == 2 and sel.linear == "fp32" and (record / "keep").read_text() == "x"
    assert f"kernel probe record {record} not kept" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [record.name], "no temp file left"


def test_the_key_covers_every_kernel_module(tmp_path, monkeypatch):
    """A change to any module of minimax_h3/kernels (or its tuning table), not only the registry's, measures afresh."""
    copy = tmp_path / "kernels"
    shutil.copytree(Path(registry.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(registry, "KERNELS_DIR", copy)
    keys = [probe_fingerprint("cpu", CFG, ["fp32"], ["math"])["code"]]
    for name in ("int8.py", "fp8_attention.py", "layers.py", "tuning.json", "registry.py"):
        with open(copy / name, "a") as fh:
            fh.write("\n")
        keys.append(probe_fingerprint("cpu", CFG, ["fp32"], ["math"])["code"])
    assert len(set(keys)) == len(keys)
