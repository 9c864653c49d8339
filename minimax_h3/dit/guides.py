"""Guides for the DiT stage: conditioning anchored at any frame (ComfyUI's MiniMaxH3AddGuide; docs/model.md §2.7-2.8).

A guide is an image and / or a sound anchored at pixel frame i of the generated video, in t2va, fl2va and ref2va
requests alike. On the wire (the Sample request's tensors) guide g (0-based, request order) is

    guide_frames    [G] int64         the pixel frame of every guide (negative: counted from the end, -1 the last)
    guide_{g}_image [24, 1, H/16, W/16] normalised video-VAE latent of its image, fitted to the render's canvas
    guide_{g}_audio [2, 32, n]        normalised audio-VAE posterior mean of its sound, one item per stereo channel

An image guide is one latent frame on the target's spatial grid at RoPE time T0 + 5/3·i (T0 the target timeline's
origin: L, or where the ref2va references end), noised once to ``0.999·z + 0.001·ε`` and pinned at
t = max(t_video, 0.999) like a keyframe: a guide at frame 0 is the first keyframe's conditioning, at F − 1 the
last one's. A sound guide is clean audio rows (t = 1) at T0 + 5/3·i + k, its channels at the extremes of the target
grid's w axis, cut to what remains of the audio track from frame i (floor(Ta − 5/3·i) latents), as ComfyUI cuts it.
Guide images draw their conditioning noise after the keyframes' / references', in request order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from minimax_h3.contract import (AUDIO_CHANNELS, GUIDE_FRAMES, GUIDE_PARTS, GUIDE_PREFIX, GUIDE_TENSOR_NAMES,
                                 MAX_GUIDES, guide_tensor, pixel_side, resolve_guide_frame)
from stagekit.errors import InvalidArgument
from stagekit.wire import check_finite

from .layout import Guide, LatentShape, guide_audio_room, patchify_audio

GUIDES_INPUT = "guides"  # the job input holding the parsed Guides


@dataclass(frozen=True)
class Guides:
    """The validated guides of one request, in request order."""

    blocks: tuple[Guide, ...]
    images: tuple[torch.Tensor, ...]  # [24, 1, h, w] per image guide, in request order
    audio: tuple[torch.Tensor, ...]  # [2, 32, n] per sound guide (cut to the room it has), in request order

    def audio_rows(self) -> torch.Tensor | None:
        """Channel-major rows of every guide's sound, in request order (None without any)."""
        return torch.cat([patchify_audio(a) for a in self.audio]) if self.audio else None


def has_guides(names) -> bool:
    """Whether a request's tensors include guides."""
    return any(n.startswith(GUIDE_PREFIX) for n in names)


def parse_guides(inputs: Mapping[str, torch.Tensor], shape: LatentShape, latent_channels: int,
                 audio_channels: int) -> Guides:
    """Reads `guide_frames` and the `guide_{g}_*` tensors of a request for a target of `shape` into Guides; raises
    InvalidArgument naming the tensor."""
    names = [n for n in inputs if n.startswith(GUIDE_PREFIX)]
    unknown = sorted(set(names) - set(GUIDE_TENSOR_NAMES) - {GUIDE_FRAMES})
    if unknown:
        raise InvalidArgument(f"unknown guide tensor {unknown[0]!r}; guide g (0-based, at most {MAX_GUIDES}) is "
                              f"guide_<g>_image and / or guide_<g>_audio, with its frame in {GUIDE_FRAMES}")
    frames = inputs.get(GUIDE_FRAMES)
    if frames is None:
        raise InvalidArgument(f"guide tensors without {GUIDE_FRAMES}: say the pixel frame of every guide")
    if frames.ndim != 1 or frames.is_floating_point() or frames.dtype == torch.bool:
        raise InvalidArgument(f"{GUIDE_FRAMES} must be an integer tensor [G], got {frames.dtype} {list(frames.shape)}")
    count = frames.shape[0]
    if not 1 <= count <= MAX_GUIDES:
        raise InvalidArgument(f"{count} guides; a render takes 1 to {MAX_GUIDES}")
    extra = sorted(n for n in names if n != GUIDE_FRAMES and int(n.split("_")[1]) >= count)
    if extra:
        raise InvalidArgument(f"{extra[0]} has no frame: {GUIDE_FRAMES} lists {count} guide(s)")
    want_image = (latent_channels, 1, shape.latent_height, shape.latent_width)
    blocks, images, audio = [], [], []
    for g, raw in enumerate(frames.tolist()):
        image, sound = (inputs.get(guide_tensor(g, p)) for p in GUIDE_PARTS)
        if image is None and sound is None:
            raise InvalidArgument(f"guide {g} has neither {guide_tensor(g, 'image')} nor {guide_tensor(g, 'audio')}")
        frame = resolve_guide_frame(raw, shape.frames)
        n = 0
        if image is not None:
            name = guide_tensor(g, "image")
            if tuple(image.shape) != want_image or not image.is_floating_point():
                raise InvalidArgument(
                    f"{name} is {image.dtype} {list(image.shape)}, but this render's canvas needs a float "
                    f"{list(want_image)} (one normalised VAE latent frame of the "
                    f"{pixel_side(shape.latent_width)}x{pixel_side(shape.latent_height)} canvas)")
            check_finite(name, image)
            images.append(image.float())
        if sound is not None:
            name = guide_tensor(g, "audio")
            if sound.ndim != 3 or tuple(sound.shape[:2]) != (AUDIO_CHANNELS, audio_channels) or sound.shape[2] < 1 \
                    or not sound.is_floating_point():
                raise InvalidArgument(f"{name} is {sound.dtype} {list(sound.shape)}, expected a float "
                                      f"[{AUDIO_CHANNELS}, {audio_channels}, n >= 1]")
            check_finite(name, sound)
            # At least one latent remains from any frame of the video: Ta = round(5F/3) > 5(F - 1)/3.
            n = min(int(sound.shape[2]), guide_audio_room(shape.audio_latents, frame))
            audio.append(sound[:, :, :n].float())
        blocks.append(Guide(frame, image is not None, n))
    return Guides(tuple(blocks), tuple(images), tuple(audio))
