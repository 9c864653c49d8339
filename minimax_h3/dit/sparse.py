"""VSA block-sparse attention for one DiT job: a render's `SparseAttention` (ComfyUI's BlockSparseAttention values,
minimax_h3.contract) applied to its packed sequence and sigma schedule (docs/kernels.md, "Block-sparse attention
(VSA)").

As ComfyUI's node decides it, a block's attention runs VSA unless the call is outside the node's window: the
sequence is shorter than `min_tokens` (the whole packed sequence, every step alike), the step's video sigma is above
shift(1 - start_percent) or below shift(1 - end_percent) (ComfyUI's `percent_to_sigma` on the render's video shift),
or the block is one of `dense_blocks`. The text refiner's attention is always dense (it is not one of the blocks).
The rows' tiles (minimax_h3/kernels/vsa.py) follow ComfyUI's segment table of the packed layout: the text, each
keyframe, each reference's sound and frames, the target audio, then the target video's cubes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from minimax_h3.contract import AUDIO_CHANNELS, SparseAttention
from minimax_h3.kernels.vsa import VsaAttention, vsa_tiles

from .layout import PackedLayout
from .sampling import shift_sigma


def percent_to_sigma(percent: float, shift: float) -> float:
    """ComfyUI's flow `percent_to_sigma`: 1 at 0 %, 0 at 100 %, else the shifted sigma of base point 1 - percent."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return shift_sigma(1.0 - percent, shift)


def prefix_segments(layout: PackedLayout, patch: Sequence[int]) -> list[int]:
    """Rows of each packed segment before the target video, in order: the text, each keyframe, each reference's
    sound (a soundtrack before its video's frames) and frames, the target audio."""
    _, ph, pw = patch
    sizes = [layout.text_len]
    sizes += [layout.rows_per_frame] * len(layout.keyframes)
    for r in layout.references:
        if r.has_audio:
            sizes.append(AUDIO_CHANNELS * r.audio_latents)
        if r.kind != "audio":
            sizes.append(r.latent_frames * (r.latent_height // ph) * (r.latent_width // pw))
    sizes.append(layout.audio[1] - layout.audio[0])
    if sum(sizes) != layout.video[0]:
        raise ValueError(f"the segments {sizes} do not end where the target video starts ({layout.video[0]})")
    return sizes


@dataclass(frozen=True)
class VsaStep:
    """VSA of one model evaluation: the attention every block runs but `dense_blocks`."""

    attention: VsaAttention
    dense_blocks: frozenset[int]

    def for_block(self, index: int) -> VsaAttention | None:
        return None if index in self.dense_blocks else self.attention


@dataclass(frozen=True)
class VsaRun:
    """VSA over one sampling run: `steps[i]` whether model evaluation i is in the window."""

    step: VsaStep
    steps: tuple[bool, ...]

    def at(self, i: int) -> VsaStep | None:
        return self.step if self.steps[i] else None

    @property
    def sparse_steps(self) -> int:
        return sum(self.steps)


def plan_vsa(sp: SparseAttention | None, layout: PackedLayout, patch: Sequence[int], sigmas: Sequence[float],
             video_shift: float, kernel: str, device: torch.device | str) -> VsaRun | None:
    """The VSA of a job whose model evaluations run at the video `sigmas` (one per evaluation); None when it runs
    none (no sparse attention asked, or the sequence is shorter than min_tokens)."""
    if sp is None or layout.seq_len < sp.min_tokens:
        return None
    hi, lo = percent_to_sigma(sp.start_percent, video_shift), percent_to_sigma(sp.end_percent, video_shift)
    steps = tuple(lo <= s <= hi for s in sigmas)
    _, ph, pw = patch
    shp = layout.shape
    tiles = vsa_tiles(prefix_segments(layout, patch), (shp.latent_frames, shp.latent_height // ph,
                                                        shp.latent_width // pw), device)
    return VsaRun(VsaStep(VsaAttention(tiles, sp.keep_percent / 100.0, kernel), frozenset(sp.dense_blocks)), steps)
