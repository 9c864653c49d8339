"""fl2va keyframe conditioning for the DiT stage (docs/model.md §2.6-2.8, §3.3).

A keyframe is one normalised VAE latent frame [24, 1, H/16, W/16] of the target canvas, anchored to the first or
the last frame of the video. It is noised once to ``0.999·z + 0.001·ε`` and packed as conditioning rows right after
the text (video tag, t pinned at max(t_video, 0.999), RoPE time L for "first" and L + 5/3·(F−1) for "last"; the
layout does the packing). The sampler never sees these rows: it integrates the target rows only and the denoise
closure built here prepends the fixed conditioning rows to every model call and strips them from the result.

Noise draw order follows diffusers' fl2va pipeline on one CPU generator seeded with the request seed: one draw per
keyframe in packed order, then the target video noise, then the target audio noise. Without keyframes this is
exactly `sampling.initial_noise`, so t2va renders keep their bits.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from minimax_h3.contract import TEXT_STATES, TEXT_TAGS, pixel_side
from stagekit.errors import InvalidArgument
from stagekit.wire import check_finite

from .layout import PackedLayout, patchify_video
from .sparse import VsaRun
from .step_cache import FirstBlockCache

# Conditioning-noise level of keyframe latents: diffusers' `keyframe_noise_aug`, ComfyUI's 0.999 mix.
KEYFRAME_NOISE_AUG = 0.001


def check_keyframe(name: str, t: torch.Tensor, channels: int, latent_h: int, latent_w: int) -> None:
    """Raises ValueError naming the expected shape (the servers map it to INVALID_ARGUMENT)."""
    want = (channels, 1, latent_h, latent_w)
    if tuple(t.shape) != want:
        raise InvalidArgument(f"{name} has shape {list(t.shape)}, but this render's canvas needs {list(want)} (one "
                         f"normalised VAE latent frame of the {pixel_side(latent_w)}x{pixel_side(latent_h)} canvas; "
                         "encode the image with the decoder's EncodeImage at the render size)")
    if not t.is_floating_point():
        raise InvalidArgument(f"{name} must be a float tensor, got {t.dtype}")
    check_finite(name, t)


def check_text_tags(tags: torch.Tensor, text_len: int, text_tag: int, video_tag: int) -> torch.Tensor:
    """[L] integer tags, each the text or the video tag. Returns them as int64."""
    if tuple(tags.shape) != (text_len,):
        raise InvalidArgument(f"{TEXT_TAGS} has shape {list(tags.shape)}, expected [{text_len}] (one tag per "
                              f"{TEXT_STATES} row)")
    if tags.is_floating_point() or tags.dtype == torch.bool:
        raise InvalidArgument(f"{TEXT_TAGS} must be an integer tensor, got {tags.dtype}")
    tags = tags.to(torch.int64)
    bad = ~((tags == text_tag) | (tags == video_tag))
    if bad.any():
        raise InvalidArgument(f"text_tags may only hold {text_tag} (text) or {video_tag} (vision block); "
                         f"found {sorted(set(tags[bad].tolist()))[:5]}")
    return tags


def condition_rows(latents: Sequence[torch.Tensor], noises: Sequence[torch.Tensor],
                   patch: Sequence[int]) -> torch.Tensor | None:
    """Noised (0.999·z + 0.001·ε) and patchified conditioning rows of the keyframes, in packed order; None if none."""
    if not latents:
        return None
    rows = [patchify_video((1.0 - KEYFRAME_NOISE_AUG) * z.float() + KEYFRAME_NOISE_AUG * e, patch)
            for z, e in zip(latents, noises)]
    return torch.cat(rows)


def conditioned_denoise(model: Callable, text: torch.Tensor, layout: PackedLayout, cond: torch.Tensor | None,
                        ref_audio: torch.Tensor | None = None,
                        step_cache: FirstBlockCache | None = None, sparse: VsaRun | None = None) -> Callable:
    """The sampler's denoise closure: the model sees [cond rows | target rows] on the video side and [reference
    rows | target rows] on the audio side (ref2va); the sampler gets the target rows back. The conditioning rows are
    the same tensors at every step (never updated). `step_cache`: the run's First Block Cache (`quality = "fast"`,
    minimax_h3/dit/step_cache.py), handed to every evaluation; None: every block runs at every step. `sparse`: the
    run's VSA (minimax_h3/dit/sparse.py), evaluation i (the sampler's step i) in its window or not; None: dense."""
    n_cond, n_ref = layout.num_cond_rows, layout.num_ref_audio_rows
    for name, rows, want in (("conditioning", cond, n_cond), ("reference audio", ref_audio, n_ref)):
        if (0 if rows is None else rows.shape[0]) != want:
            raise InvalidArgument(f"layout reserves {want} {name} rows but {0 if rows is None else rows.shape[0]} "
                                  "were given")

    calls = [0]  # the sampler calls denoise once per step, in order

    def denoise(xv, xa, tv, ta):
        if n_cond:
            xv = torch.cat([cond.to(xv.dtype), xv])
        if n_ref:
            xa = torch.cat([ref_audio.to(xa.dtype), xa])
        extra = {}
        if step_cache is not None:
            extra["step_cache"] = step_cache
        if sparse is not None and (step := sparse.at(calls[0])) is not None:
            extra["sparse"] = step
        calls[0] += 1
        v, a = model(xv, xa, text, tv, ta, layout, **extra)
        return v[n_cond:], a[n_ref:]

    return denoise
