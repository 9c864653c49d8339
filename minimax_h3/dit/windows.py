"""Long video on the DiT: a render past one window, sampled window by window (docs/long_video.md).

`minimax_h3.contract.plan_windows` cuts the clip into windows on the VAE's 17-frame clips (torch-free: the client,
the render service and the DiT all plan alike). This module samples a plan:

* **the window layout** (`window_layout`): one window's packed sequence, its RoPE times on the clip's clock (video
  from `T0 + 5/3 * start`, audio from `T0 + round(start / 24 * 40)`, `T0` the longest prompt's length so a
  window's prompt moves no picture or sound), and, for a continuation window, its guide: the clean latents of its
  first `guide` frames packed as conditioning rows in front of the targets, at the targets' own times (video rows
  mixed `0.999 z + 0.001 e` and pinned at t = max(t_video, 0.999) like a keyframe, audio rows clean at t = 1 like
  reference audio). vLLM-Omni's continuation guide is the same: condition rows sharing the target's origin.
* **fused windows** (`FusedWindows`): overlapping windows denoise the same latents; at every step each window's
  velocity is weighted (`fuse_weights`: pyramid, flat or overlap-linear, as ComfyUI's context windows) and the
  weighted mean is the step's velocity, so the sampler (`sampling.sample`) integrates the whole clip on the host
  while the device holds one window at a time.
* **continuation windows** (`sample_continuation`): each window is sampled to the end on its own, conditioned on the
  previous window's clean tail (an extension's first one on the source's), and its frames past the guide are kept.

Noise is the whole clip's, drawn once as a one-window render draws it (`sampling.draw_noise`), and sliced per window:
a plan of one window is today's render, bit for bit (the DiT engine then takes its one-window path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minimax_h3.contract import AUDIO_CHANNELS, FUSED, Window, WindowPlan, audio_latent_count, video_latent_frames
from stagekit.errors import InvalidArgument

from .config import TAG_AUDIO, TAG_TEXT, TAG_VIDEO, DiTConfig
from .keyframes import condition_rows, conditioned_denoise
from .layout import (KIND_AUDIO, KIND_COND, KIND_REF_AUDIO, KIND_VIDEO, ROPE_FRAME_RESCALE, LatentShape,
                     PackedLayout, _finish, _frame_grid, _place_audio, _place_video, latent_shape, patchify_audio,
                     patchify_video, unpatchify_audio, unpatchify_video)
from .sampling import Cancelled, SamplerConfig, sample

# model(video rows, audio rows, text states, t_video, t_audio, layout) -> (v_video, v_audio): H3DiT.forward.
Model = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# ---- layout -------------------------------------------------------------------------------------------------------
def window_layout(cfg: DiTConfig, text_len: int, media_origin: int, window: Window, height: int,
                  width: int) -> PackedLayout:
    """The packed sequence of one window: `[text | guide video | guide audio | target audio | target video]`, its
    media on the clip's clock from `media_origin` (docs/model.md §2.7-2.8). A window at frame 0 without a guide and
    `media_origin == text_len` is `layout.build_layout`'s t2va layout, bit for bit."""
    if media_origin < text_len:
        raise ValueError(f"media_origin {media_origin} lies inside the text ({text_len} rows)")
    _, ph, pw = cfg.patch
    full = latent_shape(cfg, window.frames, height, width)
    shp = LatentShape(window.frames, full.latent_frames, full.latent_height, full.latent_width, window.audio_latents)
    rpf = (shp.latent_height // ph) * (shp.latent_width // pw)
    gv, ga = window.guide_latents * rpf, AUDIO_CHANNELS * window.guide_audio
    c0 = text_len
    g_audio = c0 + gv
    a0 = g_audio + ga
    v0 = a0 + AUDIO_CHANNELS * shp.audio_latents
    seq = v0 + shp.latent_frames * rpf

    video_origin = float(media_origin) + ROPE_FRAME_RESCALE * window.start
    audio_origin = float(media_origin + window.audio_start)
    frame_hw, wg = _frame_grid(shp.latent_height, shp.latent_width, ph, pw)
    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)
    _place_video(pos, c0, window.guide_latents, video_origin, frame_hw)  # the guide at its frames' own times
    _place_audio(pos, g_audio, window.guide_audio, audio_origin, wg)
    _place_audio(pos, a0, shp.audio_latents, audio_origin, wg)
    _place_video(pos, v0, shp.latent_frames, video_origin, frame_hw)

    tag = torch.full((seq,), TAG_VIDEO, dtype=torch.long)
    tag[:text_len] = TAG_TEXT  # a long render's prompts are text alone
    tag[g_audio:a0] = TAG_AUDIO
    tag[a0:v0] = TAG_AUDIO
    kind = torch.full((seq,), KIND_VIDEO, dtype=torch.long)
    kind[c0:g_audio] = KIND_COND
    kind[g_audio:a0] = KIND_REF_AUDIO
    kind[a0:v0] = KIND_AUDIO
    return _finish(shp, rpf, text_len, a0, v0, pos, tag, kind, [torch.arange(c0, g_audio)],
                   [torch.arange(g_audio, a0)])


# ---- fusion -------------------------------------------------------------------------------------------------------
def fuse_weights(method: str, length: int, overlap: int, first: bool, last: bool) -> torch.Tensor:
    """[length] fp32 weights of a fused window's latents along time, as ComfyUI's context windows weigh them:
    "pyramid" rises 1, 2, ... to the middle and falls back; "flat" is 1 everywhere; "overlap-linear" is 1 but ramps
    over `overlap` latents at the edges a neighbour shares (not at the clip's first and last window's outer edge)."""
    if method == "flat":
        return torch.ones(length)
    if method == "pyramid":
        half = (length + 1) // 2
        rise = torch.arange(1, half + 1, dtype=torch.float32)
        return torch.cat([rise, rise[: length - half].flip(0)])
    if method == "overlap-linear":
        w = torch.ones(length)
        n = min(overlap, length)
        if not first:
            w[:n] = torch.linspace(1e-37, 1, n)
        if not last:
            w[length - n:] = torch.linspace(1, 1e-37, n)
        return w
    raise ValueError(f"unknown fuse method {method!r}")


@dataclass(frozen=True)
class _Fused:
    """One fused window: its layout (on the device), its prompt's states and where its rows sit in the clip's."""

    layout: PackedLayout
    text: torch.Tensor
    video_rows: slice        # its target video rows in the clip's rows
    audio_rows: torch.Tensor  # its target audio rows in the clip's (channel-major: left then right)
    video_w: torch.Tensor    # [its video rows, 1] weights
    audio_w: torch.Tensor    # [its audio rows, 1] weights


class FusedWindows:
    """The sampler's denoise over the whole clip's target rows (on the host), made of the plan's windows: each step,
    every window's velocity on its own rows (its model call on `device`), then the weighted mean per row."""

    def __init__(self, model: Model, cfg: DiTConfig, plan: WindowPlan, texts: Sequence[torch.Tensor], height: int,
                 width: int, device: torch.device | str):
        if plan.mode != FUSED or len(plan.windows) < 2:
            raise ValueError("FusedWindows samples a fused plan of several windows")
        self.model, self.device = model, device
        origin = max(int(t.shape[0]) for t in texts)
        last = plan.windows[-1]
        total_audio = last.audio_start + last.audio_latents
        windows = []
        vden = aden = None
        for k, w in enumerate(plan.windows):
            text = texts[w.prompt]
            lay = window_layout(cfg, int(text.shape[0]), origin, w, height, width)
            rpf = lay.rows_per_frame
            if vden is None:  # every row's weight sum, over the clip's rows
                vden = torch.zeros((last.latent_start + last.latent_frames) * rpf)
                aden = torch.zeros(AUDIO_CHANNELS * total_audio)
            edges = (k == 0, k == len(plan.windows) - 1)  # the clip's first and last window
            vw = fuse_weights(plan.fuse, w.latent_frames, video_latent_frames(plan.overlap), *edges)
            vw = vw.repeat_interleave(rpf)
            aw = fuse_weights(plan.fuse, w.audio_latents, audio_latent_count(plan.overlap), *edges)
            left = torch.arange(w.audio_start, w.audio_start + w.audio_latents)
            arows = torch.cat([left, left + total_audio])
            vrows = slice(w.latent_start * rpf, (w.latent_start + w.latent_frames) * rpf)
            vden[vrows] += vw
            aden[arows] += aw.repeat(AUDIO_CHANNELS)
            windows.append(_Fused(lay.to(device), text.to(device), vrows, arows, vw[:, None],
                                  aw.repeat(AUDIO_CHANNELS)[:, None]))
        self.windows = windows
        self.video_den, self.audio_den = vden[:, None], aden[:, None]

    def __call__(self, xv: torch.Tensor, xa: torch.Tensor, tv: torch.Tensor, ta: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if xv.shape[0] != self.video_den.shape[0] or xa.shape[0] != self.audio_den.shape[0]:
            raise ValueError(f"fused windows cover {self.video_den.shape[0]} video / {self.audio_den.shape[0]} audio "
                             f"rows, got {xv.shape[0]} / {xa.shape[0]}")
        v_sum, a_sum = torch.zeros_like(xv), torch.zeros_like(xa)
        tvd, tad = tv.to(self.device), ta.to(self.device)
        for w in self.windows:
            v, a = self.model(xv[w.video_rows].to(self.device), xa[w.audio_rows].to(self.device), w.text, tvd, tad,
                              w.layout)
            v_sum[w.video_rows] += w.video_w * v.float().cpu()
            a_sum.index_add_(0, w.audio_rows, w.audio_w * a.float().cpu())
        return v_sum / self.video_den, a_sum / self.audio_den


# ---- noise --------------------------------------------------------------------------------------------------------
def window_noise(video: torch.Tensor, audio_rows: torch.Tensor, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """(video latents [C, T, h, w], audio rows [2 * Ta, C]) of `window` cut from the clip's noise (`video`
    [C, T_all, h, w], channel-major `audio_rows` [2 * Ta_all, C])."""
    ls, a0, ta_all = window.latent_start, window.audio_start, audio_rows.shape[0] // AUDIO_CHANNELS
    rows = [audio_rows[c * ta_all + a0: c * ta_all + a0 + window.audio_latents] for c in range(AUDIO_CHANNELS)]
    return video[:, ls: ls + window.latent_frames], torch.cat(rows)


# ---- continuation -------------------------------------------------------------------------------------------------
def sample_continuation(model: Model, cfg: DiTConfig, plan: WindowPlan, texts: Sequence[torch.Tensor],
                        height: int, width: int, noise: tuple[torch.Tensor, torch.Tensor], sampler: SamplerConfig,
                        device: torch.device | str, guide: tuple[torch.Tensor, torch.Tensor] | None = None,
                        on_step: Callable[[int, int], None] | None = None,
                        should_stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a continuation plan window by window; returns the span's clean (video [C, T, h, w], audio [2, C, Ta])
    latents on the host, from `plan.span_start` (the whole clip, or for an extension its `guide` and what follows).

    `noise`: the whole clip's (video latents [C, T_all, h, w], audio rows [2 * Ta_all, C]). `guide`: an extension's
    source latents of its first window's guide frames (video [C, Tg, h, w], audio [2, C, Tga]). Window k > 0 takes
    its guide from window k - 1's clean latents; its own frames past the guide are kept."""
    first = plan.windows[0]
    span_lat, span_audio = first.latent_start, first.audio_start
    last = plan.windows[-1]
    video_all, audio_all = noise
    channels = video_all.shape[0]
    t_total = last.latent_start + last.latent_frames - span_lat
    ta_total = last.audio_start + last.audio_latents - span_audio
    lh, lw = video_all.shape[2:]
    video = torch.zeros(channels, t_total, lh, lw)
    audio = torch.zeros(AUDIO_CHANNELS, audio_all.shape[1], ta_total)
    if first.guide:
        if guide is None:
            raise InvalidArgument("an extension's first window needs the source's guide latents")
        gv, ga = guide
        if tuple(gv.shape) != (channels, first.guide_latents, lh, lw) or \
                tuple(ga.shape) != (AUDIO_CHANNELS, audio.shape[1], first.guide_audio):
            raise InvalidArgument(f"the guide is video {list(gv.shape)} / audio {list(ga.shape)}; this extension "
                                  f"needs [{channels}, {first.guide_latents}, {lh}, {lw}] / "
                                  f"[{AUDIO_CHANNELS}, {audio.shape[1]}, {first.guide_audio}]")
        video[:, :first.guide_latents] = gv.float()
        audio[..., :first.guide_audio] = ga.float()
    origin = max(int(t.shape[0]) for t in texts)
    n = len(plan.windows)
    for k, w in enumerate(plan.windows):
        text = texts[w.prompt]
        lay = window_layout(cfg, int(text.shape[0]), origin, w, height, width).to(device)
        v_noise, a_noise = window_noise(video_all, audio_all, w)
        lo, ao = w.latent_start - span_lat, w.audio_start - span_audio
        cond = ref_audio = None
        if w.guide:
            cond = condition_rows([video[:, lo: lo + w.guide_latents]], [v_noise[:, :w.guide_latents]],
                                  cfg.patch).to(device)
            ref_audio = patchify_audio(audio[..., ao: ao + w.guide_audio]).to(device)
        denoise = conditioned_denoise(model, text.to(device), lay, cond, ref_audio)

        def step(i: int, total: int, k: int = k) -> None:
            if on_step is not None:
                on_step(k * total + i, n * total)

        try:
            v0, a0 = sample(denoise, patchify_video(v_noise, cfg.patch).to(device), a_noise.to(device), sampler,
                            on_step=step, should_stop=should_stop)
        except Cancelled as e:
            raise Cancelled(k * e.total + e.steps_done, n * e.total) from None
        wv = unpatchify_video(v0, cfg.patch, channels, w.latent_frames, lh, lw).cpu()
        wa = unpatchify_audio(a0).cpu()
        video[:, lo + w.guide_latents: lo + w.latent_frames] = wv[:, w.guide_latents:]
        audio[..., ao + w.guide_audio: ao + w.audio_latents] = wa[..., w.guide_audio:]
    return video, audio


def sample_fused(model: Model, cfg: DiTConfig, plan: WindowPlan, texts: Sequence[torch.Tensor], height: int,
                 width: int, noise: tuple[torch.Tensor, torch.Tensor], sampler: SamplerConfig,
                 device: torch.device | str, on_step: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a fused plan: the sampler integrates the whole clip's rows on the host, each step made of every
    window's model call on `device` (`FusedWindows`). Returns the clip's clean (video [C, T, h, w], audio
    [2, C, Ta]) latents on the host."""
    video_all, audio_all = noise
    denoise = FusedWindows(model, cfg, plan, texts, height, width, device)
    v0, a0 = sample(denoise, patchify_video(video_all, cfg.patch), audio_all, sampler, on_step=on_step,
                    should_stop=should_stop)
    c, t, lh, lw = video_all.shape
    return unpatchify_video(v0, cfg.patch, c, t, lh, lw), unpatchify_audio(a0)


def window_rows(cfg: DiTConfig, window: Window, height: int, width: int) -> int:
    """Packed rows of a window besides its text: its target rows and its guide's."""
    _, ph, pw = cfg.patch
    shp = latent_shape(cfg, window.frames, height, width)
    rpf = (shp.latent_height // ph) * (shp.latent_width // pw)
    return ((window.latent_frames + window.guide_latents) * rpf
            + AUDIO_CHANNELS * (window.audio_latents + window.guide_audio))
