"""Step caching for `quality = "fast"` renders: First Block Cache over the DiT's block stack.

A denoising step's output changes little from one step to the next over much of a schedule. First Block Cache
(the method diffusers ships as `apply_first_block_cache`; docs/kernels.md, "Step caching") measures that change
cheaply: every step runs block 0 and compares its residual (block 0's output minus its input) with the residual of
the last step that ran every block, as a relative L1 distance,

    d = sum |r - r_prev| / sum |r_prev|   (= mean / mean over every row and channel of this sequence).

If d <= threshold, the remaining blocks are skipped and their residual from that last full step is added to block
0's output instead; otherwise they run and their residual (the output of the last block minus that of block 0) is
kept for later steps. H3 is single-stream: text, video and audio rows share one residual stream `x` [S, hidden], so
one residual covers both token streams, as it does in diffusers' H3 transformer, whose blocks return that one tensor.

The cache changes what a model evaluation computes, never when it is called: the sampler makes one call per step
on its own schedule, whatever was skipped (minimax_h3/dit/sampling.py).

Parallel ranks decide together. Under sequence parallelism each rank holds its share of the rows: the two sums are
all-reduced over the SP group. Under tensor parallelism every rank holds the whole (replicated) residual stream and
would compute the same d; rank 0 of the TP group broadcasts its decision anyway, so that no rounding difference
between ranks can ever send them down different paths (one would run collectives the others never join).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

# The skip threshold of `quality = "fast"`: the FirstBlockCache threshold NVIDIA's Sol-Engine runs H3 with.
FAST_THRESHOLD = 0.08


@dataclass
class FirstBlockCache:
    """The cache of one sampling run (one job): made fresh per run, dropped after it. `threshold`: the largest
    relative L1 change of block 0's residual that still skips the remaining blocks."""

    threshold: float = FAST_THRESHOLD
    tp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    head_residual: torch.Tensor | None = field(default=None, repr=False)  # block 0's, at the last full step
    tail_residual: torch.Tensor | None = field(default=None, repr=False)  # blocks 1.. of the last full step
    skipped: list[bool] = field(default_factory=list)  # per model evaluation: whether blocks 1.. were skipped
    distances: list[float] = field(default_factory=list)  # per evaluation after the first: d

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise ValueError(f"the step cache's threshold must be >= 0, got {self.threshold}")

    @property
    def cached_steps(self) -> int:
        return sum(self.skipped)

    def run(self, blocks: Iterable[nn.Module], x: torch.Tensor,
            call: Callable[[Iterable[nn.Module], torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block stack on the residual stream x (fp32 [rows, hidden]; blocks update it in place): block 0, then
        the rest or their cached residual. `call(blocks, x)` runs some blocks in order and returns x complete. An
        iterator of blocks that is a generator (minimax_h3/dit/streaming.py) is closed when the rest are skipped."""
        it = iter(blocks)
        x_in = x.clone()
        x = call((next(it),), x)
        r = x_in.neg_().add_(x)  # block 0's residual, in x_in's storage
        if self.head_residual is not None and self._similar(r):
            close = getattr(it, "close", None)
            if close is not None:
                close()
            self.skipped.append(True)
            return x.add_(self.tail_residual)
        self.head_residual = r
        head_out = x.clone()
        x = call(it, x)
        self.tail_residual = head_out.neg_().add_(x)
        self.skipped.append(False)
        return x

    def _similar(self, r: torch.Tensor) -> bool:
        """Whether r is within the threshold of the last full step's block-0 residual, decided alike on every rank
        (module docstring)."""
        prev = self.head_residual
        sums = torch.stack([(r - prev).abs().sum(), prev.abs().sum()]).double()
        if self.sp_group is not None:
            dist.all_reduce(sums, group=self.sp_group)  # every SP rank: the sums over all rows
        d = sums[0] / sums[1]
        skip = (d <= self.threshold).to(torch.int32).reshape(1)
        if self.tp_group is not None:
            dist.broadcast(skip, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        self.distances.append(float(d))
        return bool(skip.item())
