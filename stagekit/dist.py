"""Rank groups for multi-rank stages (torchrun-launched; NCCL on GPUs, gloo on CPU).

Rank 0 serves gRPC and drives the other ranks over a *control* group: it
broadcasts each command (load, unload, run a job) and every rank executes it.
The control group has a long timeout because followers sit in it while idle;
the *compute* group that the model's collectives use has the short,
configurable timeout, so a dead rank turns into an error within that time.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Followers wait in the control broadcast between jobs; torchrun tears the group
# down if rank 0 dies, so this only needs to outlast idle periods.
CONTROL_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def rank_info_from_env(environ: dict[str, str] | None = None) -> RankInfo:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python -m` run is rank 0 of 1."""
    env = os.environ if environ is None else environ
    return RankInfo(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


class RankGroup:
    """The process groups of one stage. `compute` is None for a single rank."""

    def __init__(self, info: RankInfo, backend: str, collective_timeout_s: float):
        self.info = info
        self.compute = None
        self.control = None
        if info.world_size > 1:
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
            self.compute = dist.group.WORLD
            # gloo for control: it carries pickled objects on the CPU whatever the compute backend.
            self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def broadcast_command(self, command: Any = None) -> Any:
        """Rank 0 passes `command`; every rank returns it."""
        if self.control is None:
            return command
        box = [command if self.info.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def any_flag(self, local: bool) -> bool:
        """True on every rank if any rank raised the flag (used for agreed cancellation)."""
        if self.compute is None:
            return local
        t = torch.tensor([1 if local else 0], dtype=torch.int32)
        if dist.get_backend(self.compute) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.compute)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank contributes `obj`; rank 0 gets the list, the others None."""
        if self.control is None:
            return [obj]
        out = [None] * self.world_size if self.info.is_leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
