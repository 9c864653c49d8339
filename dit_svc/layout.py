"""Packed-sequence layout of a MiniMax-H3 t2va / fl2va request, and latent <-> row packing.

One DiT forward runs over a single packed sequence (docs/model.md §2.7):

    [ text (L) | keyframe rows (0, 1 or 2 latent frames) | target audio (2*Ta) | target video (T*rows_per_frame) ]

Every row carries a modality tag (AdaLN column block), a timestep *kind* (which of the request's noise levels it is
at; the model turns kinds into distinct timestep values each step) and a 3-axis RoPE position (t, h, w) built in
float64 exactly like the reference and cast to float32 once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from stagekit.errors import InvalidArgument

from .config import TAG_AUDIO, TAG_TEXT, TAG_VIDEO, DiTConfig

# ---- request geometry constants (docs/model.md §3) -------------------------------------------------------------
VAE_SPATIAL = 16  # pixels per latent on each spatial axis
VAE_FRAMES_PER_CHUNK = 17  # pixel frames per causal VAE clip
VAE_LATENTS_PER_CHUNK = 5  # latent frames kept per clip; valid counts are F = 17n + 5 -> T = 5n + 2
FPS = 24
AUDIO_LATENTS_PER_SECOND = 40  # 32 kHz, hop 800
AUDIO_CHANNELS = 2  # stereo = two channel-major blocks of rows

# ---- RoPE clock (docs/model.md §2.8) -----------------------------------------------------------------------------
# 1 time unit = 1 audio latent = 5/3 video frames at 24 fps; latent frame k covers (1,4,4,4,4)[k % 5] pixel frames.
ROPE_FRAME_RESCALE = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1.0, 4.0, 4.0, 4.0, 4.0)
ROPE_SPATIAL_SCALE = 32.0

# ---- timestep kinds -----------------------------------------------------------------------------------------------
# The model maps kinds to values each step: video -> t_video, cond -> max(t_video, COND_VIDEO_T),
# audio -> t_audio, ref_audio -> max(t_audio, REF_AUDIO_T). Text rows are at t_video (they never reach a head).
KIND_VIDEO = 0
KIND_COND = 1
KIND_AUDIO = 2
KIND_REF_AUDIO = 3
NUM_KINDS = 4
COND_VIDEO_T = 0.999  # keyframe latents are noised once to 0.999*z + 0.001*eps and pinned there
REF_AUDIO_T = 1.0

KEYFRAME_ANCHORS = ("first", "last")


# ---------------------------------------------------------------------------------------------------------------------
# Latent geometry
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LatentShape:
    frames: int  # pixel frames F (17n + 5)
    latent_frames: int  # T = 5n + 2
    latent_height: int  # height / 16
    latent_width: int  # width / 16
    audio_latents: int  # Ta per channel


def snap_frames(frames: int) -> int:
    """Smallest valid frame count (17n + 5) >= frames."""
    if frames < 1:
        raise InvalidArgument(f"frames must be >= 1, got {frames}")
    n = max(0, -(-(frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK))
    return VAE_FRAMES_PER_CHUNK * n + VAE_LATENTS_PER_CHUNK


def video_latent_frames(frames: int) -> int:
    """T = 5n + 2 for F = 17n + 5."""
    if frames < VAE_LATENTS_PER_CHUNK or frames % VAE_FRAMES_PER_CHUNK != VAE_LATENTS_PER_CHUNK:
        raise InvalidArgument(
            f"frames must be of the form 17*n + 5 (e.g. 124, 141, 362), got {frames}; snap_frames({frames}) = "
            f"{snap_frames(frames)}"
        )
    return (frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_LATENTS_PER_CHUNK + 2


def audio_latent_count(frames: int) -> int:
    """Ta = round(F / 24 * 40) audio latents per channel (never a .5 tie for F = 17n + 5)."""
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


def latent_shape(cfg: DiTConfig, frames: int, height: int, width: int) -> LatentShape:
    _, ph, pw = cfg.patch
    for name, value, p in (("height", height, ph), ("width", width, pw)):
        if value <= 0 or value % (VAE_SPATIAL * p):
            raise InvalidArgument(f"{name} must be a positive multiple of {VAE_SPATIAL * p} pixels, got {value}")
    return LatentShape(
        frames=frames,
        latent_frames=video_latent_frames(frames),
        latent_height=height // VAE_SPATIAL,
        latent_width=width // VAE_SPATIAL,
        audio_latents=audio_latent_count(frames),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Patchify
# ---------------------------------------------------------------------------------------------------------------------
def patchify_video(latents: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """[C, T, H, W] (or [1, C, T, H, W]) -> rows [T/pt * H/ph * W/pw, C*pt*ph*pw], frame-major then h then w;
    the row vector index is c*pt*ph*pw + it*ph*pw + ih*pw + iw."""
    if latents.ndim == 5:
        if latents.shape[0] != 1:
            raise InvalidArgument(f"patchify_video takes one item, got batch {latents.shape[0]}")
        latents = latents[0]
    if latents.ndim != 4:
        raise InvalidArgument(f"video latents must be [C, T, H, W], got shape {tuple(latents.shape)}")
    pt, ph, pw = patch
    c, t, h, w = latents.shape
    if t % pt or h % ph or w % pw:
        raise InvalidArgument(f"video latents {tuple(latents.shape)} are not divisible by the patch {tuple(patch)}")
    x = latents.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify_video(rows: torch.Tensor, patch: Sequence[int], channels: int, frames: int, height: int,
                     width: int) -> torch.Tensor:
    """Inverse of patchify_video: rows -> [C, T, H, W] (latent-space frames/height/width)."""
    pt, ph, pw = patch
    n = (frames // pt) * (height // ph) * (width // pw)
    if rows.shape != (n, channels * pt * ph * pw):
        raise ValueError(
            f"expected video rows of shape {(n, channels * pt * ph * pw)} for latent {channels}x{frames}x{height}x"
            f"{width}, got {tuple(rows.shape)}"
        )
    x = rows.reshape(frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    x = x.permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(channels, frames, height, width).contiguous()


def patchify_audio(latents: torch.Tensor) -> torch.Tensor:
    """[2, C, Ta] (one mono VAE item per stereo channel) -> channel-major rows [2*Ta, C]."""
    if latents.ndim != 3:
        raise InvalidArgument(f"audio latents must be [channels, C, Ta], got shape {tuple(latents.shape)}")
    return latents.transpose(1, 2).reshape(-1, latents.shape[1]).contiguous()


def unpatchify_audio(rows: torch.Tensor, channels: int = AUDIO_CHANNELS) -> torch.Tensor:
    """Inverse of patchify_audio: rows [channels*Ta, C] -> [channels, C, Ta]."""
    if rows.ndim != 2 or rows.shape[0] % channels:
        raise ValueError(f"audio rows must be [{channels}*Ta, C], got shape {tuple(rows.shape)}")
    return rows.reshape(channels, rows.shape[0] // channels, rows.shape[1]).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedLayout:
    """Static description of one packed sequence. Ranges are half-open [start, stop) row ranges."""

    shape: LatentShape
    keyframes: tuple[str, ...]
    text: tuple[int, int]
    cond: tuple[int, int]
    audio: tuple[int, int]
    video: tuple[int, int]
    rows_per_frame: int
    tag: torch.Tensor  # [S] long: 0 video, 1 text, 2 audio
    kind: torch.Tensor  # [S] long: KIND_* (which timestep the row is at)
    kinds: tuple[int, ...]  # KIND_* values present in `kind` (static, so the model needs no device sync for it)
    position_ids: torch.Tensor  # [S, 3] float32 (t, h, w)
    position_ids_f64: torch.Tensor = field(repr=False)  # [S, 3] float64 as built
    video_idx: torch.Tensor = field(repr=False)  # [Nv] cond rows then target video rows
    audio_idx: torch.Tensor = field(repr=False)  # [Na]
    text_idx: torch.Tensor = field(repr=False)  # [L]

    @property
    def seq_len(self) -> int:
        return int(self.tag.shape[0])

    @property
    def text_len(self) -> int:
        return self.text[1] - self.text[0]

    @property
    def num_cond_rows(self) -> int:
        return self.cond[1] - self.cond[0]

    @property
    def num_video_rows(self) -> int:
        """Video rows the model takes/returns: conditioning rows first, then target rows."""
        return int(self.video_idx.shape[0])

    @property
    def num_audio_rows(self) -> int:
        return int(self.audio_idx.shape[0])

    def to(self, device: torch.device | str) -> "PackedLayout":
        return replace(
            self,
            tag=self.tag.to(device),
            kind=self.kind.to(device),
            position_ids=self.position_ids.to(device),
            video_idx=self.video_idx.to(device),
            audio_idx=self.audio_idx.to(device),
            text_idx=self.text_idx.to(device),
        )  # position_ids_f64 stays on CPU (no fp64 on some accelerators; only the fp32 copy is used)


def spatial_grid(latent_dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """One aspect-normalised spatial RoPE axis: numpy linspace(left, left+ratio, dim/patch, endpoint=False) * 32,
    i.e. k*step + left with step = ((left+ratio) - left) / n, computed in float64 in that order."""
    n = latent_dim // patch
    ratio = latent_dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    step = ((left + ratio) - left) / n
    return (torch.arange(n, dtype=torch.float64) * step + left) * ROPE_SPATIAL_SCALE


def temporal_grid(latent_frames: int, origin: float) -> torch.Tensor:
    """RoPE time of each latent frame: origin + sum of the spans of the frames before it."""
    pattern = torch.tensor(ROPE_FRAMES_PER_LATENT, dtype=torch.float64)
    spans = ROPE_FRAME_RESCALE * pattern[torch.arange(latent_frames) % len(ROPE_FRAMES_PER_LATENT)]
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _last_keyframe_time(text_len: int, latent_frames: int) -> float:
    # The reference anchors the last keyframe at the rotary span of all generated frames minus one frame unit, the
    # span summed with numpy's pairwise summation (differs from a sequential sum in the last ulp for T >= 16).
    spans = np.full(latent_frames, ROPE_FRAME_RESCALE, dtype=np.float64)
    spans *= np.asarray(ROPE_FRAMES_PER_LATENT, dtype=np.float64)[np.arange(latent_frames) % 5]
    return float(text_len) + float(spans.sum()) - ROPE_FRAME_RESCALE


def build_layout(
    cfg: DiTConfig,
    text_len: int,
    frames: int,
    height: int,
    width: int,
    keyframes: Sequence[str] = (),
    text_tags: torch.Tensor | None = None,
) -> PackedLayout:
    """Layout of a t2va (keyframes=()) or fl2va request (keyframes ⊂ ("first", "last"), one latent frame each, in
    packed order). frames/height/width are pixel units (F = 17n+5; H, W multiples of 32).

    text_tags: optional [L] long tags of the text rows (vision-block tokens of keyframe presentations are tagged
    video = 0); default all text (1).
    """
    keyframes = tuple(keyframes)
    if len(keyframes) > 2 or any(k not in KEYFRAME_ANCHORS for k in keyframes):
        raise InvalidArgument(f"keyframes must be up to two of {KEYFRAME_ANCHORS}, got {keyframes!r}")
    if text_len < 0:
        raise InvalidArgument(f"text_len must be >= 0, got {text_len}")
    if text_tags is not None and tuple(text_tags.shape) != (text_len,):
        raise InvalidArgument(f"text_tags must have shape ({text_len},), got {tuple(text_tags.shape)}")
    shp = latent_shape(cfg, frames, height, width)
    pt, ph, pw = cfg.patch
    if pt != 1:
        raise ValueError(f"only temporal patch 1 is supported (release value), got {pt}")
    hl, wl, t_lat, ta = shp.latent_height, shp.latent_width, shp.latent_frames, shp.audio_latents
    rpf = (hl // ph) * (wl // pw)

    n_cond = len(keyframes) * rpf
    n_audio = AUDIO_CHANNELS * ta
    n_video = t_lat * rpf
    c0 = text_len
    a0 = c0 + n_cond
    v0 = a0 + n_audio
    seq = v0 + n_video

    # One latent frame's (h, w) grid, row-major.
    sqrt_area = math.sqrt(hl * wl)
    hg = spatial_grid(hl, ph, sqrt_area)
    wg = spatial_grid(wl, pw, sqrt_area)
    frame_hw = torch.stack(torch.meshgrid(hg, wg, indexing="ij"), dim=-1).reshape(-1, 2)

    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)
    for i, anchor in enumerate(keyframes):
        rows = slice(c0 + i * rpf, c0 + (i + 1) * rpf)
        pos[rows, 0] = float(text_len) if anchor == "first" else _last_keyframe_time(text_len, t_lat)
        pos[rows, 1:] = frame_hw
    # Audio: channel-major, t = L + k, no height, w pinned to the extremes of the video w grid (left / right).
    pos[a0:v0, 0] = (float(text_len) + torch.arange(ta, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    pos[a0:v0, 2] = torch.stack([wg[0], wg[-1]]).repeat_interleave(ta)
    # Target video: frame-major.
    vpos = pos[v0:].view(t_lat, rpf, 3)
    vpos[:, :, 0] = temporal_grid(t_lat, float(text_len))[:, None]
    vpos[:, :, 1:] = frame_hw[None]

    tag = torch.full((seq,), TAG_VIDEO, dtype=torch.long)
    tag[:text_len] = TAG_TEXT if text_tags is None else text_tags.to(torch.long)
    tag[a0:v0] = TAG_AUDIO
    kind = torch.full((seq,), KIND_VIDEO, dtype=torch.long)
    kind[c0:a0] = KIND_COND
    kind[a0:v0] = KIND_AUDIO

    return PackedLayout(
        shape=shp,
        keyframes=keyframes,
        text=(0, text_len),
        cond=(c0, a0),
        audio=(a0, v0),
        video=(v0, seq),
        rows_per_frame=rpf,
        tag=tag,
        kind=kind,
        kinds=tuple(sorted({KIND_VIDEO, KIND_AUDIO} | ({KIND_COND} if n_cond else set()))),
        position_ids=pos.to(torch.float32),
        position_ids_f64=pos,
        video_idx=torch.cat([torch.arange(c0, a0), torch.arange(v0, seq)]),
        audio_idx=torch.arange(a0, v0),
        text_idx=torch.arange(0, text_len),
    )
