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
    # torchrun's rendezvous (TCPStore address, launch id, restart count); unused for a single rank.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_id: str = "run"
    restart_count: int = 0
    agent_store: bool = False  # torchrun's agent hosts the store; workers only connect
    # torchrun's node (one agent, one host) of this rank, and how many ranks that node runs (`--nnodes`,
    # `--nproc-per-node`): each node's local rank 0 takes its own host's device lease and memory budget.
    node_rank: int = 0
    local_world_size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_node_lead(self) -> bool:
        """The first rank of its node: it holds its host's device lease and memory budget."""
        return self.local_rank == 0


def rank_info_from_env(environ: dict[str, str] | None = None) -> RankInfo:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous; a plain `python -m` run is rank 0 of 1."""
    env = os.environ if environ is None else environ
    return RankInfo(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 0)),
                    run_id=env.get("TORCHELASTIC_RUN_ID", "run"),
                    restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                    agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                    node_rank=int(env.get("GROUP_RANK", 0)),
                    local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))))


def attempt_store(info: RankInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of this launch attempt.

    Under torchrun the workers of one node share the agent's TCPStore across restarts and init_process_group's keys
    do not change between attempts, so a restarted group can read the dead group's gloo addresses and fail in
    connectFullMesh. On one node a prefix per (run id, restart count) gives every attempt fresh keys. Across nodes
    the restart counts differ (torchrun counts a failure on the node that failed, not a membership change on the
    others), so a multi-node group runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (`multi_node_store_error`):
    rank 0 then hosts a fresh store of its own for each attempt, at the port the rendezvous gave every node.
    """
    base = dist.TCPStore(info.master_addr, info.master_port, world_size=info.world_size,
                         is_master=info.is_leader and not info.agent_store, timeout=timeout)
    attempt = f"attempt{info.restart_count}" if info.agent_store else "own-store"
    return dist.PrefixStore(f"h3/{info.run_id}/{attempt}", base)


def multi_node_store_error(info: RankInfo) -> str:
    """Why this rank cannot form its group ("" when it can): a group on several nodes over the agents' shared store
    could not tell one attempt's keys from a dead one's after a restart."""
    if info.world_size > info.local_world_size and info.agent_store:
        return ("a rank group on several nodes (torchrun --nnodes) needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                "torchrun's environment on every node, so that each attempt of the group meets in a store of its own "
                "(docs/scale_out.md)")
    return ""


class RankGroup:
    """The process groups of one stage. `compute` is None for a single rank."""

    def __init__(self, info: RankInfo, backend: str, collective_timeout_s: float):
        self.info = info
        self.collective_timeout = datetime.timedelta(seconds=collective_timeout_s)  # also for subgroups of compute
        self.compute = None
        self.control = None
        if info.world_size > 1:
            if why := multi_node_store_error(info):
                raise SystemExit(why)
            timeout = self.collective_timeout
            dist.init_process_group(backend=backend, timeout=timeout, store=attempt_store(info, timeout),
                                    rank=info.rank, world_size=info.world_size)
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
        # Filled on the device (no host-to-device copy, which would wait for the queued GPU work); the one wait per
        # call is reading the agreed flag back.
        device = "cuda" if dist.get_backend(self.compute) == "nccl" else "cpu"
        t = torch.full((1,), 1 if local else 0, dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.compute)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank contributes `obj`; rank 0 gets the list, the others None."""
        if self.control is None:
            return [obj]
        out = [None] * self.world_size if self.info.is_leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank passes a tensor of the same shape and dtype on its compute device and gets every rank's (rank
        order), over the compute group: NCCL device to device on GPUs, on the communicator the model's collectives
        already use (point-to-point sends would open another one, ~1.5 GiB more resident per GPU), gloo on CPU."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.compute)
        return parts

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
