"""ref2va reference conditioning for the DiT stage (docs/model.md §2.6-2.8, §3.3; docs/references.md).

A ref2va request carries an ordered list of references. On the wire (the Sample request's tensors) reference i
(0-based, request order) is

    ref_{i}_image  [24, 1, h, w]   normalised video-VAE latent of an image reference (its own size), or
    ref_{i}_video  [24, T, h, w]   normalised video-VAE latents of a video reference (24 fps, its own canvas),
    ref_{i}_audio  [2, 32, Ta]     normalised audio-VAE posterior mean, one item per stereo channel: the soundtrack
                                   of ref_{i}_video, or an audio reference on its own.

Visual references are noised once to ``0.999·z + 0.001·ε`` (one draw per image / video reference, in request order,
before the target noise: the same draw order as diffusers) and pinned at t = max(t_video, 0.999); reference audio
is clean at t = 1. The order is part of the request: it numbers the prompt's labels and advances the RoPE clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from minimax_h3.contract import (AUDIO_CHANNELS, MAX_REFERENCES, REF_PREFIX, REF_TENSOR_NAMES, REFERENCE_KINDS,
                                 check_reference_kinds, ref_tensor)
from stagekit.errors import InvalidArgument
from stagekit.wire import check_finite

from .layout import ReferenceBlock, patchify_audio

REFERENCES_INPUT = "references"  # the job input holding the parsed References


@dataclass(frozen=True)
class References:
    """The validated references of one request, in request order."""

    blocks: tuple[ReferenceBlock, ...]
    visual: tuple[torch.Tensor, ...]  # [24, T, h, w] per image / video reference, in request order
    audio: tuple[torch.Tensor, ...]  # [2, 32, Ta] per audio-bearing reference, in request order

    def audio_rows(self) -> torch.Tensor | None:
        """Channel-major rows of every reference audio, in request order (None without any)."""
        return torch.cat([patchify_audio(a.float()) for a in self.audio]) if self.audio else None


def _check_tensor(name: str, t: torch.Tensor, rank: int, lead: tuple[int, ...]) -> None:
    if t.ndim != rank or tuple(t.shape[:len(lead)]) != lead or min(t.shape) < 1:
        want = list(lead) + ["*"] * (rank - len(lead))
        raise InvalidArgument(f"{name} has shape {list(t.shape)}, expected {want} with every dimension >= 1")
    if not t.is_floating_point():
        raise InvalidArgument(f"{name} must be a float tensor, got {t.dtype}")
    check_finite(name, t)


def parse_references(inputs: Mapping[str, torch.Tensor], latent_channels: int, audio_channels: int,
                     patch: tuple[int, int, int]) -> References:
    """Reads `ref_{i}_*` tensors into References; raises InvalidArgument naming the tensor."""
    names = [n for n in inputs if n.startswith(REF_PREFIX)]
    unknown = sorted(set(names) - set(REF_TENSOR_NAMES))
    if unknown:
        raise InvalidArgument(f"unknown reference tensor {unknown[0]!r}; reference i (0-based, at most {MAX_REFERENCES}) "
                         f"is ref_<i>_image, ref_<i>_video and/or ref_<i>_audio")
    count = 1 + max(int(n.split("_")[1]) for n in names) if names else 0
    blocks, visual, audio = [], [], []
    _, ph, pw = patch
    for i in range(count):
        image, video, sound = (inputs.get(ref_tensor(i, p)) for p in REFERENCE_KINDS)
        if image is None and video is None and sound is None:
            raise InvalidArgument(f"reference {i} is missing: references are numbered 0..{count - 1} without gaps")
        if image is not None and (video is not None or sound is not None):
            raise InvalidArgument(f"reference {i}: an image reference carries {ref_tensor(i, 'image')} alone")
        if sound is not None:
            _check_tensor(ref_tensor(i, "audio"), sound, 3, (AUDIO_CHANNELS, audio_channels))
            audio.append(sound.float())
        for part, t in (("image", image), ("video", video)):
            if t is None:
                continue
            name = ref_tensor(i, part)
            _check_tensor(name, t, 4, (latent_channels, 1) if part == "image" else (latent_channels,))
            if t.shape[2] % ph or t.shape[3] % pw:
                raise InvalidArgument(f"{name} has latent size {t.shape[2]}x{t.shape[3]}, which the DiT's {ph}x{pw} "
                                 "patch does not divide (encode at a multiple of 32 pixels)")
            visual.append(t.float())
        kind = "image" if image is not None else "video" if video is not None else "audio"
        lat = visual[-1].shape if kind != "audio" else (0, 0, 0, 0)
        blocks.append(ReferenceBlock(kind, lat[1], lat[2], lat[3], 0 if sound is None else int(sound.shape[2])))
    check_reference_kinds([b.kind for b in blocks])
    return References(tuple(blocks), tuple(visual), tuple(audio))
