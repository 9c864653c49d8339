"""Sequence parallelism (Ulysses) for the H3 DiT, alone or mixed with tensor parallelism.

Layout of `world = tp x sp` ranks: rank = sp_index * tp + tp_index, so the ranks of one TP group are neighbours
(TP moves the most bytes: two all-reduces of [rows, hidden] per block). Each SP group shares one TP shard.

What an SP rank does (docs/kernels.md, "Sequence parallelism"):
  * It holds its TP shard of the weights (all of them when tp = 1) and runs the DiT blocks on its own contiguous
    share of the packed rows (`SeqShards`: sizes differ by at most one row; no padding, so attention never sees a
    padding key). Embeddings, the token refiner (text only) and the AdaLN inputs are computed on every rank.
  * Attention needs every row: one all-to-all trades "my rows, all local heads" for "all rows, 1/sp of the local
    heads" (q, k and v in one message), attention runs on full rows of those heads, and a second all-to-all
    returns each rank its rows of every head. The all-to-alls are called in Block.forward (minimax_h3/dit/model.py);
    the functions here only lay out the send buffers and view the received ones.
  * After the last block the rows are all-gathered (in the model's forward), so the output heads, and so every
    rank's result, are bitwise identical.
Everything row-wise (norms, modulation, projections, MLP, gating) is unchanged; so is TP inside a rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import DiTConfig
from .tp import TPConfigError, validate_tp


@dataclass(frozen=True)
class SeqShards:
    """Contiguous row ranges of the packed sequence over the ranks of one SP group."""

    sizes: tuple[int, ...]  # rows of each SP rank, in rank order
    rank: int  # this rank's index in the SP group

    @classmethod
    def split(cls, total: int, rank: int, n: int) -> "SeqShards":
        base, extra = divmod(total, n)
        if base == 0:
            raise ValueError(f"{total} rows cannot be split over {n} sequence-parallel ranks")
        return cls(tuple(base + (i < extra) for i in range(n)), rank)

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def local(self) -> int:
        return self.sizes[self.rank]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def rows(self) -> slice:
        return slice(self.start, self.start + self.local)


def validate_parallel(cfg: DiTConfig, tp: int, sp: int) -> None:
    """TP must fit the config (validate_tp) and every SP rank needs whole heads of its TP shard."""
    validate_tp(cfg, tp)
    if not isinstance(sp, int) or sp < 1:
        raise TPConfigError(f"sequence-parallel degree must be a positive int, got {sp!r}")
    if (cfg.num_heads // tp) % sp:
        ok = [d for d in range(1, cfg.num_heads // tp + 1) if (cfg.num_heads // tp) % d == 0]
        raise TPConfigError(f"sequence-parallel degree {sp} does not divide the {cfg.num_heads // tp} heads of a "
                            f"TP{tp} shard; valid SP degrees at TP{tp}: {ok}")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's TP and SP groups (None where the degree is 1) and its place in each."""

    tp_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None
    tp_rank: int
    tp_size: int
    sp_rank: int
    sp_size: int


def make_groups(rank: int, world: int, sp: int, timeout: timedelta | None = None) -> ParallelGroups:
    """Split the default process group into TP groups of world / sp neighbouring ranks and SP groups across them.

    Every rank must call this (dist.new_group is collective over the default group), with the same arguments."""
    if sp < 1 or world % sp:
        raise TPConfigError(f"sequence-parallel degree {sp} does not divide the {world} ranks")
    tp = world // sp
    tp_group = sp_group = None
    if sp == 1 and tp > 1:
        tp_group = dist.group.WORLD
    elif tp == 1 and sp > 1:
        sp_group = dist.group.WORLD
    elif tp > 1 and sp > 1:
        for s in range(sp):
            g = dist.new_group([s * tp + t for t in range(tp)], timeout=timeout)
            if rank // tp == s:
                tp_group = g
        for t in range(tp):
            g = dist.new_group([s * tp + t for s in range(sp)], timeout=timeout)
            if rank % tp == t:
                sp_group = g
    return ParallelGroups(tp_group, sp_group, rank % tp, tp, rank // tp, sp)


# ---- Ulysses layouts ------------------------------------------------------------------------------------------------
def qkv_send(qkv: torch.Tensor, n: int) -> torch.Tensor:
    """qkv [3, 1, heads, rows, d] (this rank's rows, all local heads) -> flat send buffer: for each destination
    SP rank i (in order), its heads i*heads/n.. as [rows, 3, heads/n, d] (row-major, so received blocks stack)."""
    _, _, h, r, d = qkv.shape
    return qkv.view(3, n, h // n, r, d).permute(1, 3, 0, 2, 4).reshape(-1)


def qkv_splits(shards: SeqShards, heads_per_rank: int, d: int) -> tuple[list[int], list[int]]:
    """(send, receive) element counts per SP rank of the q/k/v all-to-all."""
    per_row = 3 * heads_per_rank * d
    return [shards.local * per_row] * shards.n, [s * per_row for s in shards.sizes]


def qkv_received(recv: torch.Tensor, shards: SeqShards, heads_per_rank: int, d: int) -> tuple[torch.Tensor, ...]:
    """The received flat buffer -> q, k, v [1, heads/n, S, d] views over all rows (rows ordered by rank = by
    position, since the shards are contiguous and in rank order)."""
    rows = recv.view(shards.total, 3, heads_per_rank, d)
    return tuple(rows[:, i].transpose(0, 1).unsqueeze(0) for i in range(3))


def o_send(o: torch.Tensor, shards: SeqShards) -> torch.Tensor:
    """Attention output [1, heads/n, S, d] -> flat send buffer: for each destination SP rank, its rows of these
    heads as [rows, heads/n, d]."""
    return o[0].transpose(0, 1).reshape(-1)


def o_splits(shards: SeqShards, heads_per_rank: int, d: int) -> tuple[list[int], list[int]]:
    """(send, receive) element counts per SP rank of the output all-to-all."""
    per_row = heads_per_rank * d
    return [s * per_row for s in shards.sizes], [shards.local * per_row] * shards.n


def o_received(recv: torch.Tensor, shards: SeqShards, heads_per_rank: int, d: int) -> torch.Tensor:
    """The received flat buffer (from each SP rank: my rows of its heads) -> [1, local heads, rows, d]."""
    n, r = shards.n, shards.local
    return recv.view(n, r, heads_per_rank, d).permute(0, 2, 1, 3).reshape(1, n * heads_per_rank, r, d)
