"""Block weight streaming: how much of the DiT stays on the device, decided per job.

A job's peak is the resident weights plus its activations (`DiTEngine.activation_bytes`). When both do not fit the
room the device has for this process (the card, the `--gpu-memory-cap-gb` cap and what other processes hold), some
of the transformer blocks move to pinned host memory and are copied back, one block ahead, into one of two device
slots on a side stream while the blocks before them compute (docs/one_card.md). Everything else (embeddings,
refiner, final layer, LoRA factors) stays resident.

- `plan_placement` is the decision: the fewest streamed blocks that fit, spread evenly over the depth so each copy
  has the most compute to hide behind. A job whose floor (non-block weights + two slots + activations) does not fit
  is refused with the numbers.
- `BlockStream` carries it out: each streamed block's tensors become views into its slot (slot = its rank among
  the streamed blocks, mod 2), so the block's modules and kernels never see a different tensor object; its bytes
  live in one pinned host buffer and travel as one copy. The same kernels run on the same bits: streamed and
  resident forwards are bitwise identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from stagekit.errors import ResourceExhausted

log = logging.getLogger("minimax_h3.dit.streaming")

GIB = 1 << 30
ALIGN = 256  # byte alignment of every tensor inside a block buffer (what the GEMM kernels expect of their operands)
SLOTS = 2    # device slots: the block computing and the one being copied


def fmt_gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class Placement:
    """Where the blocks of one job live. `streamed`: block indices copied in from host memory each forward."""

    num_blocks: int
    streamed: tuple[int, ...]
    block_bytes: int        # the largest block's bytes (one slot)
    room_bytes: int         # what the device had for this process when the job was planned
    need_bytes: int         # the job's planned peak: resident weights + slots + activations

    @property
    def streamed_bytes_per_step(self) -> int:
        return len(self.streamed) * self.block_bytes

    def describe(self) -> str:
        if not self.streamed:
            return f"all {self.num_blocks} blocks resident"
        return (f"streaming {len(self.streamed)} of {self.num_blocks} blocks, "
                f"{self.streamed_bytes_per_step / GIB:.1f} GiB a step")


def plan_placement(num_blocks: int, block_bytes: int, other_weight_bytes: int, activation_bytes: int,
                   room_bytes: int | None, what: str = "dit job") -> Placement:
    """The fewest streamed blocks for a job, or ResourceExhausted with the numbers.

    block_bytes: one block's weights (the largest); other_weight_bytes: everything that always stays resident;
    activation_bytes: the job's activation estimate; room_bytes: what this process may hold on the device (None =
    no limit: nothing streams).
    """
    full = other_weight_bytes + num_blocks * block_bytes + activation_bytes
    if room_bytes is None or full <= room_bytes:
        return Placement(num_blocks, (), block_bytes, room_bytes or 0, full)
    slots = min(SLOTS, num_blocks) * block_bytes
    floor = other_weight_bytes + slots + activation_bytes
    if floor > room_bytes or num_blocks <= SLOTS:
        raise ResourceExhausted(
            f"{what} needs an estimated {fmt_gib(min(floor, full))} per device even with every block streamed from "
            f"host memory (weights kept resident {fmt_gib(other_weight_bytes)} + {SLOTS} block slots "
            f"{fmt_gib(slots)} + activations {fmt_gib(activation_bytes)}) but the memory budget is "
            f"{fmt_gib(room_bytes)}; use a smaller resolution or frame count, or more ranks")
    resident = min(num_blocks, (room_bytes - floor) // block_bytes)
    n_streamed = num_blocks - resident
    # Spread evenly: streamed block j sits at floor((j + 0.5) * N / n); the copy of one streamed block then overlaps
    # the compute of every resident block before it.
    streamed = tuple(sorted({min(num_blocks - 1, int((j + 0.5) * num_blocks / n_streamed))
                             for j in range(n_streamed)}))
    need = other_weight_bytes + resident * block_bytes + SLOTS * block_bytes + activation_bytes
    return Placement(num_blocks, streamed, block_bytes, room_bytes, need)


def _block_tensors(block: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of a block, each once, in a fixed order."""
    seen, out = set(), []
    for t in (*block.parameters(), *block.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offs, pos = [], 0
    for t in tensors:
        offs.append(pos)
        pos += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offs, pos


def _view(buf: torch.Tensor, off: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    return buf[off: off + n].view(like.dtype).view(like.shape)


class BlockStream:
    """Moves a model's blocks between device residency and host streaming, and runs the copies during a forward.

    Built once per loaded model with the block tensors as loaded (LoRA wrappers added later keep the same base
    tensors, so they stream with the block while their own small factors stay resident). `apply(placement)` moves
    blocks to where a job wants them; `iterate(blocks)` is what the model's block loop walks.
    """

    def __init__(self, blocks: nn.ModuleList, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.tensors = [_block_tensors(b) for b in blocks]
        layouts = [_offsets(ts) for ts in self.tensors]
        self.offsets = [o for o, _ in layouts]
        self.sizes = [n for _, n in layouts]
        self.block_bytes = max(self.sizes) if self.sizes else 0
        self.host: dict[int, torch.Tensor] = {}     # streamed block -> its bytes in (pinned) host memory
        self.slot_of: dict[int, int] = {}           # streamed block -> slot index
        self.slots: list[torch.Tensor] = []
        self.order: tuple[int, ...] = ()            # streamed blocks in forward order
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready: list = []
        self._free: list = []
        self.bytes_copied = 0

    @property
    def streamed(self) -> tuple[int, ...]:
        return self.order

    # ---- placement -------------------------------------------------------------------------------------------------
    def apply(self, placement: Placement) -> None:
        """Move blocks so that exactly `placement.streamed` stream. Device bytes are freed before any are taken:
        blocks that start streaming go to host memory first, every streamed block then points at its host bytes
        (dropping the old slots), blocks that stop streaming come back, and the new slots are made last."""
        want = tuple(placement.streamed)
        if want == self.order:
            return
        with torch.inference_mode(False), torch.no_grad():
            for i in want:
                if i not in self.host:
                    self._to_host(i)
            for i in self.order:
                self._point(i, self.host[i])
            self.slots, self.slot_of, self.order = [], {}, ()
            for i in [i for i in self.host if i not in want]:
                host = self.host.pop(i)
                for t, off in zip(self.tensors[i], self.offsets[i]):
                    t.data = _view(host, off, t).to(self.device, copy=True)
            if want:
                self.slots = [torch.empty(self.block_bytes, dtype=torch.uint8, device=self.device)
                              for _ in range(SLOTS)]
            self.order = want
            self.slot_of = {i: j % SLOTS for j, i in enumerate(want)}
            for i in want:
                self._point(i, self.slots[self.slot_of[i]])
        if self.cuda:
            self._ready = [torch.cuda.Event() for _ in range(SLOTS)]
            self._free = [torch.cuda.Event() for _ in range(SLOTS)]
            torch.cuda.empty_cache()  # the moved-out blocks' device memory goes back to the card, not to our cache
        log.info("block placement: %d of %d blocks streamed (%s in host memory)", len(want), len(self.sizes),
                 fmt_gib(sum(self.sizes[i] for i in want)))

    def _point(self, i: int, buf: torch.Tensor) -> None:
        for t, off in zip(self.tensors[i], self.offsets[i]):
            t.data = _view(buf, off, t)

    def _to_host(self, i: int) -> None:
        host = torch.empty(self.sizes[i], dtype=torch.uint8, pin_memory=self.cuda)
        for t, off in zip(self.tensors[i], self.offsets[i]):
            _view(host, off, t).copy_(t.data)
        self._point(i, host)  # the device copy is freed here
        self.host[i] = host

    def release(self) -> None:
        """Forget every host buffer and slot (the model is being dropped)."""
        self.host.clear()
        self.slots = []
        self.order = ()

    # ---- the forward ------------------------------------------------------------------------------------------------
    def iterate(self, blocks: nn.ModuleList):
        """Yield the blocks in order, each streamed block's bytes in its slot before it computes, and the next
        streamed block's copy issued (on the side stream) as soon as its slot's previous user has finished."""
        if not self.order:
            yield from blocks
            return
        self._prefetch(0)
        for i, blk in enumerate(blocks):
            j = self.order.index(i) if i in self.slot_of else -1
            if j >= 0:
                self._wait(j)
                if j + 1 < len(self.order):
                    self._prefetch(j + 1)
            try:
                yield blk
            finally:  # also when the caller stops early (a cached step skips the rest: the generator is closed)
                if j >= 0 and self.cuda:
                    self._free[self.slot_of[i]].record()

    def _prefetch(self, j: int) -> None:
        i = self.order[j]
        s = self.slot_of[i]
        n = self.sizes[i]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self._free[s])  # the slot's previous block has finished computing
                self.slots[s][:n].copy_(self.host[i], non_blocking=True)
                self._ready[s].record(self.copy_stream)
        else:
            self.slots[s][:n].copy_(self.host[i])
        self.bytes_copied += n

    def _wait(self, j: int) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[self.slot_of[self.order[j]]])
