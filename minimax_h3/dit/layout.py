"""Packed-sequence layout of a MiniMax-H3 t2va / fl2va / ref2va request, and latent <-> row packing.

One DiT forward runs over a single packed sequence (docs/model.md §2.7):

    t2va / fl2va: [ text (L) | keyframe rows (0, 1 or 2 latent frames) | target audio (2*Ta) | target video ]
    ref2va:       [ text (L) | reference blocks in request order        | target audio (2*Ta) | target video ]

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

from minimax_h3.contract import (AUDIO_CHANNELS, AUDIO_LATENTS_PER_SECOND, FPS, KEYFRAME_ANCHORS, REFERENCE_KINDS,
                                 VAE_SPATIAL, audio_latent_count, latent_side, one_video_latent, video_latent_frames)
from stagekit.errors import InvalidArgument

from .config import TAG_AUDIO, TAG_TEXT, TAG_VIDEO, DiTConfig

# ---- RoPE clock (docs/model.md §2.8) -----------------------------------------------------------------------------
# 1 time unit = 1 audio latent = 5/3 video frames at 24 fps; latent frame k covers (1,4,4,4,4)[k % 5] pixel frames.
ROPE_FRAME_RESCALE = AUDIO_LATENTS_PER_SECOND / FPS  # 5/3
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


def latent_shape(cfg: DiTConfig, frames: int, height: int, width: int) -> LatentShape:
    _, ph, pw = cfg.patch
    for name, value, p in (("height", height, ph), ("width", width, pw)):
        if value <= 0 or value % (VAE_SPATIAL * p):
            raise InvalidArgument(f"{name} must be a positive multiple of {VAE_SPATIAL * p} pixels, got {value}")
    return LatentShape(
        frames=frames,
        latent_frames=video_latent_frames(frames),
        latent_height=latent_side(height),
        latent_width=latent_side(width),
        audio_latents=audio_latent_count(frames),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Patchify
# ---------------------------------------------------------------------------------------------------------------------
def patchify_video(latents: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """[C, T, H, W] (or [1, C, T, H, W]) -> rows [T/pt * H/ph * W/pw, C*pt*ph*pw], frame-major then h then w;
    the row vector index is c*pt*ph*pw + it*ph*pw + ih*pw + iw."""
    latents = one_video_latent(latents, "patchify_video")
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
    cond: tuple[int, int]  # the conditioning rows: keyframes (fl2va) or every reference block (ref2va)
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
    references: tuple["ReferenceBlock", ...] = ()  # ref2va: the reference blocks in packed (request) order
    guides: tuple["Guide", ...] = ()  # guides in packed order, after the keyframes / references

    @property
    def seq_len(self) -> int:
        return int(self.tag.shape[0])

    @property
    def text_len(self) -> int:
        return self.text[1] - self.text[0]

    @property
    def num_cond_rows(self) -> int:
        """Leading conditioning rows of `video_idx` (keyframes, or ref2va image / video references; then guide
        images)."""
        return self.num_video_rows - self.shape.latent_frames * self.rows_per_frame

    @property
    def num_ref_audio_rows(self) -> int:
        """Leading reference rows of `audio_idx` (ref2va audio references and soundtracks, then guide sounds; clean,
        never sampled)."""
        return self.num_audio_rows - AUDIO_CHANNELS * self.shape.audio_latents

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
    pattern = np.asarray(ROPE_FRAMES_PER_LATENT, dtype=np.float64)
    spans *= pattern[np.arange(latent_frames) % len(pattern)]
    return float(text_len) + float(spans.sum()) - ROPE_FRAME_RESCALE


@dataclass(frozen=True)
class Guide:
    """Geometry of one guide (ComfyUI's MiniMaxH3AddGuide; docs/model.md §2.7-2.8): conditioning anchored at pixel
    frame `frame` (0-based, resolved) of the generated video: an image (`image`: one latent frame of the target
    canvas) and / or a sound (`audio_latents` per channel, from that frame on; 0 = none)."""

    frame: int
    image: bool = True
    audio_latents: int = 0

    def __post_init__(self):
        if self.frame < 0 or self.audio_latents < 0 or not (self.image or self.audio_latents):
            raise InvalidArgument(f"a guide is an image and / or audio latents at a frame >= 0, got {self}")


def guide_time(origin: float, frame: int) -> float:
    """RoPE time of a guide at pixel frame `frame`: the target timeline's origin plus 5/3 per frame (float64, as
    ComfyUI computes it)."""
    return float(origin) + ROPE_FRAME_RESCALE * frame


def guide_audio_room(audio_latents: int, frame: int) -> int:
    """Audio latents per channel a sound guide at `frame` may hold: what remains of the target's audio track from
    that frame on, floor(Ta - 5/3 * frame), as ComfyUI cuts it."""
    return math.floor(audio_latents - ROPE_FRAME_RESCALE * frame)


def _place_guides(pos: torch.Tensor, tag: torch.Tensor, kind: torch.Tensor, start: int, guides: Sequence[Guide],
                  origin: float, frame_hw: torch.Tensor, w_axis: torch.Tensor) -> tuple[list, list, int]:
    """Guide rows from `start`, each guide its image's rows (the target grid, one latent frame) then its sound's
    (w at the target grid's extremes), both at the guide's time: (video row ranges, audio row ranges, next row)."""
    video, audio = [], []
    for g in guides:
        t = guide_time(origin, g.frame)
        if g.image:
            n = frame_hw.shape[0]
            _place_video(pos, start, 1, t, frame_hw)
            kind[start:start + n] = KIND_COND
            video.append(torch.arange(start, start + n))
            start += n
        if g.audio_latents:
            n = AUDIO_CHANNELS * g.audio_latents
            _place_audio(pos, start, g.audio_latents, t, w_axis)
            tag[start:start + n] = TAG_AUDIO
            kind[start:start + n] = KIND_REF_AUDIO
            audio.append(torch.arange(start, start + n))
            start += n
    return video, audio, start


def _check_guides(guides: Sequence[Guide], shp: "LatentShape") -> None:
    for i, g in enumerate(guides):
        if g.frame >= shp.frames:
            raise InvalidArgument(f"guide {i}: frame {g.frame} is outside the video's {shp.frames} frames")
        room = guide_audio_room(shp.audio_latents, g.frame)
        if g.audio_latents > room:
            raise InvalidArgument(f"guide {i}: {g.audio_latents} audio latents at frame {g.frame}, but only {room} "
                                  "remain of the audio track from there")


def _guide_rows(guides: Sequence[Guide], rpf: int) -> int:
    return sum(rpf * g.image + AUDIO_CHANNELS * g.audio_latents for g in guides)


@dataclass(frozen=True)
class ReferenceBlock:
    """Geometry of one ref2va reference, as its latents give it (docs/model.md §2.7-2.8).

    kind "image": one latent frame of its own size; "video": its latent frames and, when it has a soundtrack, that
    soundtrack's audio latents per channel; "audio": audio latents per channel only.
    """

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    def __post_init__(self):
        if self.kind not in REFERENCE_KINDS:
            raise InvalidArgument(f"a reference is one of {REFERENCE_KINDS}, got {self.kind!r}")
        visual = (self.latent_frames, self.latent_height, self.latent_width)
        if self.kind == "audio":
            if any(visual) or self.audio_latents < 1:
                raise InvalidArgument(f"an audio reference has audio latents only (>= 1), got {self}")
            return
        if min(visual) < 1 or self.audio_latents < 0:
            raise InvalidArgument(f"a {self.kind} reference needs positive latent dimensions, got {self}")
        if self.kind == "image" and (self.latent_frames != 1 or self.audio_latents):
            raise InvalidArgument(f"an image reference is one latent frame without audio, got {self}")

    @property
    def has_audio(self) -> bool:
        return self.audio_latents > 0


def _frame_grid(latent_height: int, latent_width: int, ph: int, pw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) RoPE coordinates of one latent frame [rows_per_frame, 2] (row-major) and its w axis."""
    sqrt_area = math.sqrt(latent_height * latent_width)
    hg = spatial_grid(latent_height, ph, sqrt_area)
    wg = spatial_grid(latent_width, pw, sqrt_area)
    return torch.stack(torch.meshgrid(hg, wg, indexing="ij"), dim=-1).reshape(-1, 2), wg


def _place_audio(pos: torch.Tensor, start: int, latents: int, origin: float, w_axis: torch.Tensor) -> None:
    """Channel-major audio rows from `start`: t = origin + k, no height, w at the extremes of `w_axis`."""
    rows = pos[start:start + AUDIO_CHANNELS * latents]
    rows[:, 0] = (origin + torch.arange(latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    rows[:, 2] = torch.stack([w_axis[0], w_axis[-1]]).repeat_interleave(latents)


def _place_video(pos: torch.Tensor, start: int, latent_frames: int, origin: float, frame_hw: torch.Tensor) -> None:
    """Frame-major video rows from `start`, latent frame j at RoPE time origin + its span offset."""
    rows = pos[start:start + latent_frames * frame_hw.shape[0]].view(latent_frames, frame_hw.shape[0], 3)
    rows[:, :, 0] = temporal_grid(latent_frames, origin)[:, None]
    rows[:, :, 1:] = frame_hw[None]


def _video_span(latent_frames: int) -> float:
    """RoPE time a reference video occupies: its frame spans summed one by one in float64 (the order matters in
    the last ulp; the fl2va last-keyframe anchor sums the same series pairwise)."""
    total = 0.0
    for k in range(latent_frames):
        total += ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)]
    return total


def _check_text(text_len: int, text_tags: torch.Tensor | None) -> None:
    if text_len < 0:
        raise InvalidArgument(f"text_len must be >= 0, got {text_len}")
    if text_tags is not None and tuple(text_tags.shape) != (text_len,):
        raise InvalidArgument(f"text_tags must have shape ({text_len},), got {tuple(text_tags.shape)}")


def _target(cfg: DiTConfig, frames: int, height: int, width: int) -> tuple[LatentShape, int]:
    shp = latent_shape(cfg, frames, height, width)
    pt, ph, pw = cfg.patch
    if pt != 1:
        raise ValueError(f"only temporal patch 1 is supported (release value), got {pt}")
    return shp, (shp.latent_height // ph) * (shp.latent_width // pw)


def build_layout(
    cfg: DiTConfig,
    text_len: int,
    frames: int,
    height: int,
    width: int,
    keyframes: Sequence[str] = (),
    text_tags: torch.Tensor | None = None,
    guides: Sequence[Guide] = (),
) -> PackedLayout:
    """Layout of a t2va (keyframes=()) or fl2va request (keyframes ⊂ ("first", "last"), one latent frame each, in
    packed order), with `guides` after the keyframes. frames/height/width are pixel units (F = 17n+5; H, W
    multiples of 32).

    text_tags: optional [L] long tags of the text rows (vision-block tokens of keyframe presentations are tagged
    video = 0); default all text (1).
    """
    keyframes, guides = tuple(keyframes), tuple(guides)
    if len(keyframes) > 2 or any(k not in KEYFRAME_ANCHORS for k in keyframes):
        raise InvalidArgument(f"keyframes must be up to two of {KEYFRAME_ANCHORS}, got {keyframes!r}")
    _check_text(text_len, text_tags)
    shp, rpf = _target(cfg, frames, height, width)
    _check_guides(guides, shp)
    _, ph, pw = cfg.patch
    t_lat, ta = shp.latent_frames, shp.audio_latents

    c0 = text_len
    g0 = c0 + len(keyframes) * rpf
    a0 = g0 + _guide_rows(guides, rpf)
    v0 = a0 + AUDIO_CHANNELS * ta
    seq = v0 + t_lat * rpf

    frame_hw, wg = _frame_grid(shp.latent_height, shp.latent_width, ph, pw)
    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)
    for i, anchor in enumerate(keyframes):
        rows = slice(c0 + i * rpf, c0 + (i + 1) * rpf)
        pos[rows, 0] = float(text_len) if anchor == "first" else _last_keyframe_time(text_len, t_lat)
        pos[rows, 1:] = frame_hw
    tag = torch.full((seq,), TAG_VIDEO, dtype=torch.long)
    tag[:text_len] = TAG_TEXT if text_tags is None else text_tags.to(torch.long)
    kind = torch.full((seq,), KIND_VIDEO, dtype=torch.long)
    kind[c0:g0] = KIND_COND
    guide_video, guide_audio, _ = _place_guides(pos, tag, kind, g0, guides, float(text_len), frame_hw, wg)
    _place_audio(pos, a0, ta, float(text_len), wg)
    _place_video(pos, v0, t_lat, float(text_len), frame_hw)
    tag[a0:v0] = TAG_AUDIO
    kind[a0:v0] = KIND_AUDIO

    return _finish(shp, rpf, text_len, a0, v0, pos, tag, kind, [torch.arange(c0, g0)] + guide_video, guide_audio,
                   keyframes=keyframes, guides=guides)


def build_ref2va_layout(
    cfg: DiTConfig,
    text_len: int,
    frames: int,
    height: int,
    width: int,
    references: Sequence[ReferenceBlock],
    text_tags: torch.Tensor | None = None,
    guides: Sequence[Guide] = (),
) -> PackedLayout:
    """Layout of a ref2va request: `[text | reference blocks in request order | target audio | target video]`
    (docs/model.md §2.7-2.8). frames/height/width are the target's pixel units.

    A reference block is an image's rows (its own grid), an audio reference's channel-major rows, or a video's
    soundtrack rows followed by its frame rows. One RoPE clock starts at L and every reference advances it: an image
    by 1, an audio reference by its latent count, a video by the longer of its soundtrack and its frame span; the
    target rows start where it ends. Reference video rows are conditioning rows (t pinned at 0.999), reference audio
    rows are clean (t = 1). `video_idx` / `audio_idx` list the reference rows first, in request order. `guides`
    follow the references, timed from where the clock ends (the target's origin).
    """
    references, guides = tuple(references), tuple(guides)
    if not references:
        raise InvalidArgument("a ref2va layout needs at least one reference")
    if all(r.kind == "audio" for r in references):
        raise InvalidArgument("audio references need at least one image or video reference beside them")
    _check_text(text_len, text_tags)
    shp, rpf = _target(cfg, frames, height, width)
    _, ph, pw = cfg.patch
    for i, r in enumerate(references):
        if r.kind != "audio" and (r.latent_height % ph or r.latent_width % pw):
            raise InvalidArgument(f"reference {i + 1}: latent {r.latent_height}x{r.latent_width} is not divisible by "
                             f"the patch {ph}x{pw}")
    _check_guides(guides, shp)
    t_lat, ta = shp.latent_frames, shp.audio_latents
    target_hw, target_w = _frame_grid(shp.latent_height, shp.latent_width, ph, pw)

    def visual_rows(r: ReferenceBlock) -> int:
        return r.latent_frames * (r.latent_height // ph) * (r.latent_width // pw)

    ref_rows = sum(visual_rows(r) + AUDIO_CHANNELS * r.audio_latents for r in references)
    a0 = text_len + ref_rows + _guide_rows(guides, rpf)
    v0 = a0 + AUDIO_CHANNELS * ta
    seq = v0 + t_lat * rpf
    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)
    tag = torch.full((seq,), TAG_VIDEO, dtype=torch.long)
    tag[:text_len] = TAG_TEXT if text_tags is None else text_tags.to(torch.long)
    kind = torch.full((seq,), KIND_VIDEO, dtype=torch.long)

    video_idx, audio_idx = [], []
    cursor, clock = text_len, float(text_len)
    for r in references:
        if r.has_audio:  # an audio reference, or a video's soundtrack (before its frames, same origin)
            n = AUDIO_CHANNELS * r.audio_latents
            w_axis = target_w if r.kind == "audio" else _frame_grid(r.latent_height, r.latent_width, ph, pw)[1]
            _place_audio(pos, cursor, r.audio_latents, clock, w_axis)
            tag[cursor:cursor + n] = TAG_AUDIO
            kind[cursor:cursor + n] = KIND_REF_AUDIO
            audio_idx.append(torch.arange(cursor, cursor + n))
            cursor += n
        if r.kind != "audio":
            n = visual_rows(r)
            frame_hw, _ = _frame_grid(r.latent_height, r.latent_width, ph, pw)
            _place_video(pos, cursor, r.latent_frames, clock, frame_hw)
            kind[cursor:cursor + n] = KIND_COND
            video_idx.append(torch.arange(cursor, cursor + n))
            cursor += n
        if r.kind == "image":
            clock += 1.0  # one integer slot, not a latent frame's 5/3
        elif r.kind == "audio":
            clock += float(r.audio_latents)
        else:
            clock += max(float(r.audio_latents), _video_span(r.latent_frames))

    guide_video, guide_audio, _ = _place_guides(pos, tag, kind, cursor, guides, clock, target_hw, target_w)
    _place_audio(pos, a0, ta, clock, target_w)
    _place_video(pos, v0, t_lat, clock, target_hw)
    tag[a0:v0] = TAG_AUDIO
    kind[a0:v0] = KIND_AUDIO
    return _finish(shp, rpf, text_len, a0, v0, pos, tag, kind, video_idx + guide_video, audio_idx + guide_audio,
                   references=references, guides=guides)


def _finish(shp: LatentShape, rpf: int, text_len: int, a0: int, v0: int, pos: torch.Tensor, tag: torch.Tensor,
            kind: torch.Tensor, cond_video: list[torch.Tensor], ref_audio: list[torch.Tensor],
            keyframes: tuple[str, ...] = (), references: tuple[ReferenceBlock, ...] = (),
            guides: tuple[Guide, ...] = ()) -> PackedLayout:
    """The PackedLayout of rows placed as [text | conditioning | target audio (a0) | target video (v0)]:
    `cond_video` / `ref_audio` list the conditioning rows of each modality in packed order."""
    seq = int(tag.shape[0])
    return PackedLayout(
        shape=shp,
        keyframes=keyframes,
        text=(0, text_len),
        cond=(text_len, a0),
        audio=(a0, v0),
        video=(v0, seq),
        rows_per_frame=rpf,
        tag=tag,
        kind=kind,
        kinds=tuple(sorted(set(kind[text_len:].tolist()))),
        position_ids=pos.to(torch.float32),
        position_ids_f64=pos,
        video_idx=torch.cat(cond_video + [torch.arange(v0, seq)]),
        audio_idx=torch.cat(ref_audio + [torch.arange(a0, v0)]),
        text_idx=torch.arange(0, text_len),
        references=references,
        guides=guides,
    )
