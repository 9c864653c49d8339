"""Multi-rank tests in real processes: `run_ranks` starts the ranks (torch.multiprocessing), which meet through a
file rendezvous in a temporary folder (no port to pick, docs/testing.md) and hand their results back through it.

Ranks are forked from a forkserver that imported torch and the DiT model once per test process: each rank is a fresh
process with nothing of the test's state, without paying the seconds of imports a spawned interpreter would."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports anyway; the forkserver (started at the first run_ranks) imports it once.
mp.set_forkserver_preload(["tests.dit_ranks"])


def run_ranks(fn: Callable, world: int, *args, backend: str = "gloo") -> list:
    """Run `fn(rank, world, *args)` in `world` new processes, each a rank of one default process group (gloo on
    CPU; nccl puts rank r on cuda:r); returns their results in rank order. `fn` must be module-level (it is pickled
    by name)."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank_main, args=(world, d, backend, fn, args), nprocs=world, join=True,
                           start_method="forkserver")
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def _rank_main(rank: int, world: int, d: str, backend: str, fn: Callable, args: tuple) -> None:
    if backend == "nccl":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{d}/store", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(d, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
