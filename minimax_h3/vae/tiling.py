"""Work-unit geometry of the MiniMax-H3 video VAE: temporal chunking, spatial tiling and the blending that stitches
unit outputs back together (docs/model.md §4.2/§4.3).

Kept free of model code so the decoder stage can plan, scatter and assemble without touching weights:

    plan = plan_decode(cfg, T, H_lat, W_lat)          # one DecodeUnit per (temporal chunk x spatial tile)
    results = {u.index: decode_unit(vae, z, u) for u in my_share(plan)}   # on any rank, any order
    frames = assemble(plan, gathered_results)          # [3, F, H, W] in [0, 1]

Everything here is deterministic and elementwise per chunk, so the assembled frames do not depend on the order in
which the units were computed or on how they were split over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# ImageNet statistics: the H3 VAE works in ImageNet-normalised RGB over a [0, 1] base range (§4.2 "pixel convention").
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class TilingConfig(Protocol):
    """The config fields the planner needs (satisfied by `video_vae.VideoVAEConfig`)."""

    clip_length: int
    token_drop: int
    tile_px: int
    tile_overlap_min_px: int
    tiling: bool
    out_channels: int

    @property
    def spatial_ratio(self) -> int: ...

    @property
    def temporal_ratio(self) -> int: ...


# ----------------------------------------------------------------------------------------------------------------
# spatial tiles


@dataclass(frozen=True)
class TileSplit:
    """Tiles along one axis: start and length of every tile and the overlap between neighbours (all in pixels)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    overlaps: tuple[int, ...]


def split_tiles(length: int, tile: int, min_overlap: int, step: int) -> TileSplit:
    """Lay `tile`-wide tiles over `length` pixels like the reference.

    The tile count is the smallest N with `tile*N - min_overlap*(N-1) >= length`; the slack is then handed out
    round-robin to the overlaps in whole `step` (= spatial compression ratio) increments so every tile boundary stays
    latent-aligned. A frame no larger than one tile is a single tile of the frame's own size.
    """
    if tile >= length:
        return TileSplit((0,), (length,), ())
    if tile <= min_overlap:
        raise ValueError(f"tile size {tile} must exceed the minimum tile overlap {min_overlap}")
    n = math.ceil(length / tile)
    while tile * n - min_overlap * (n - 1) < length:
        n += 1
    overlaps = [min_overlap] * (n - 1)
    slack = tile * n - sum(overlaps) - length
    for i in range(slack // step):
        overlaps[i % (n - 1)] += step
    starts = [0]
    for ov in overlaps:
        starts.append(starts[-1] + tile - ov)
    return TileSplit(tuple(starts), (tile,) * n, tuple(overlaps))


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Linear cross-fade of the last `extent` slices of `a` into the first `extent` slices of `b` along `dim`.

    Returns `b` with its leading `extent` slices replaced by the blend (weights (1 - k/e, k/e), k = 0..e-1, as the
    reference: the first blended slice is pure `a`)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    pos = torch.arange(extent, device=b.device, dtype=b.dtype)
    shape = [1] * b.ndim
    shape[dim] = extent
    w_b = (pos / extent).view(shape)
    w_a = (1 - pos / extent).view(shape)
    head = a.narrow(dim, a.shape[dim] - extent, extent) * w_a + b.narrow(dim, 0, extent) * w_b
    if extent == b.shape[dim]:
        return head
    return torch.cat([head, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def stitch_tiles(tiles: Sequence[Sequence[torch.Tensor]], h_overlaps: Sequence[int],
                 w_overlaps: Sequence[int]) -> torch.Tensor:
    """Stitch a row-major grid of tiles (spatial dims last two) as the reference does.

    Each tile is first blended with the *raw* tile above it, then with the *raw* tile to its left (so the corner
    region uses the left tile's un-blended values — a quirk of the reference we keep for bit-level fidelity), then
    cropped by the overlaps it shares with the tile below / to the right.
    """
    n_rows, n_cols = len(tiles), len(tiles[0])
    rows = []
    for i in range(n_rows):
        row = []
        for j in range(n_cols):
            t = tiles[i][j]
            if i > 0:
                t = blend(tiles[i - 1][j], t, h_overlaps[i - 1], dim=-2)
            if j > 0:
                t = blend(tiles[i][j - 1], t, w_overlaps[j - 1], dim=-1)
            if i < n_rows - 1:
                t = t[..., : t.shape[-2] - h_overlaps[i], :]
            if j < n_cols - 1:
                t = t[..., : t.shape[-1] - w_overlaps[j]]
            row.append(t)
        rows.append(torch.cat(row, dim=-1) if n_cols > 1 else row[0])
    return torch.cat(rows, dim=-2) if n_rows > 1 else rows[0]


def tile_splits(cfg: TilingConfig, height_px: int, width_px: int) -> tuple[TileSplit, TileSplit]:
    """Tile layout for a frame of `height_px` x `width_px` (one tile when tiling is off)."""
    if not cfg.tiling:
        return TileSplit((0,), (height_px,), ()), TileSplit((0,), (width_px,), ())
    step = cfg.spatial_ratio
    return (split_tiles(height_px, cfg.tile_px, cfg.tile_overlap_min_px, step),
            split_tiles(width_px, cfg.tile_px, cfg.tile_overlap_min_px, step))


# ----------------------------------------------------------------------------------------------------------------
# temporal chunks


def chunk_geometry(cfg: TilingConfig) -> tuple[int, int, int, int]:
    """(tokens_chunk_size, token_overlap, frame_pre_padding, frame_overlap), derived from clip_length / token_drop.

    17-frame encoder clips give 5 latents each (ceil(17/4)); `token_drop` = 3 trailing latents removed at encode
    time leave 2 latents (`token_overlap`) of context that the decoder re-reads, and the 17 = 4*5 - 3 mismatch means
    each decoded chunk starts with 3 pre-padding frames (`frame_pre_padding`) that are discarded."""
    rt = cfg.temporal_ratio
    tokens_chunk = math.ceil(cfg.clip_length / rt)
    token_overlap = (-cfg.token_drop) % tokens_chunk
    pre_pad = (-cfg.clip_length) % rt
    frame_overlap = max(token_overlap * rt - pre_pad, 0)
    return tokens_chunk, token_overlap, pre_pad, frame_overlap


def num_decoded_frames(cfg: TilingConfig, latent_t: int) -> int:
    """Pixel frames `decode` returns for `latent_t` latent frames (5n+2 -> 17n+5; 1 -> 1)."""
    return _temporal_plan(cfg, latent_t)[-1]


def _temporal_plan(cfg: TilingConfig, latent_t: int):
    tokens_chunk, token_overlap, pre_pad, frame_overlap = chunk_geometry(cfg)
    rt = cfg.temporal_ratio
    if latent_t == 1:
        # A still image: one latent decodes to rt frames, the last one is the image (as ComfyUI does).
        return 0, 1, 1, (rt - 1, rt), (rt, rt), 0, 1
    has_tail = cfg.token_drop > 0
    n_tok = latent_t + cfg.token_drop
    pad = (-n_tok) % tokens_chunk
    n_chunks = (n_tok + pad) // tokens_chunk - int(has_tail)
    if n_chunks < 1:
        # T = 2 is too short for one chunk; pad one whole chunk of repeated latents (ComfyUI; diffusers rejects it).
        pad += tokens_chunk
        n_chunks += 1
    clip_lat = tokens_chunk + token_overlap
    chunk_dec = tokens_chunk * rt
    clip_frames = clip_lat * rt
    main = (pre_pad, min(chunk_dec, clip_frames))
    tail = (chunk_dec + pre_pad, clip_frames) if has_tail else (clip_frames, clip_frames)
    tail = (tail[0], max(tail[0], tail[1]))
    n_main, n_tail = main[1] - main[0], tail[1] - tail[0]
    # Trailing frames produced by the repeated pad latents: a chunk-final latent covers clip_length % rt frames
    # (the pre-padding eats the rest), any other latent covers rt.
    intra_tail = cfg.clip_length % rt
    if intra_tail == 0:
        pad_frames = pad * rt
    else:
        pad_frames = sum(intra_tail if (latent_t + k) % tokens_chunk == 0 else rt for k in range(pad))
    total = n_chunks * n_main + n_tail - pad_frames
    return pad, n_chunks, clip_lat, main, tail, frame_overlap, total


# ----------------------------------------------------------------------------------------------------------------
# decode plan


@dataclass(frozen=True)
class DecodeGeometry:
    """Everything `assemble` needs about one decode request (shared by all its units)."""

    latent_t: int
    latent_h: int
    latent_w: int
    out_channels: int
    spatial_ratio: int
    temporal_ratio: int
    num_chunks: int
    tokens_per_chunk: int  # latents between consecutive chunk starts (5)
    clip_latents: int  # latents one chunk decodes (7)
    main_frames: tuple[int, int]  # [start, stop) of a chunk's decoded frames kept as its body
    tail_frames: tuple[int, int]  # [start, stop) kept as the overlap tail cross-faded into the next chunk
    frame_overlap: int
    tiles_h: TileSplit  # in pixels
    tiles_w: TileSplit
    num_frames: int  # F of the assembled video
    height: int
    width: int

    @property
    def frames_per_unit(self) -> int:
        return (self.main_frames[1] - self.main_frames[0]) + (self.tail_frames[1] - self.tail_frames[0])

    @property
    def tiles_per_chunk(self) -> int:
        return len(self.tiles_h.starts) * len(self.tiles_w.starts)


@dataclass(frozen=True)
class DecodeUnit:
    """One decoder call: latent frames [t0, t1) (indices past T-1 repeat the last latent) x one spatial tile.

    `decode_unit` returns `[out_channels, geom.frames_per_unit, h1-h0 (x16), w1-w0 (x16)]` raw decoder output
    (ImageNet space, body frames then tail frames, pre-padding frames already dropped)."""

    index: int
    chunk: int
    tile_row: int
    tile_col: int
    t0: int
    t1: int
    h0: int
    h1: int
    w0: int
    w1: int
    geom: DecodeGeometry

    def latent_frame_indices(self) -> list[int]:
        return [min(t, self.geom.latent_t - 1) for t in range(self.t0, self.t1)]

    def output_shape(self) -> tuple[int, int, int, int]:
        g = self.geom
        return (g.out_channels, g.frames_per_unit, (self.h1 - self.h0) * g.spatial_ratio,
                (self.w1 - self.w0) * g.spatial_ratio)


def plan_decode(cfg: TilingConfig, latent_t: int, latent_h: int, latent_w: int) -> list[DecodeUnit]:
    """Split a decode of a `[C, latent_t, latent_h, latent_w]` latent into work units, chunk-major then row-major.

    Units are independent; any subset can run anywhere. `assemble(plan, results)` restores the reference output."""
    for name, v in (("latent_t", latent_t), ("latent_h", latent_h), ("latent_w", latent_w)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    _pad, n_chunks, clip_lat, main, tail, frame_overlap, total = _temporal_plan(cfg, latent_t)
    r = cfg.spatial_ratio
    height, width = latent_h * r, latent_w * r
    th, tw = tile_splits(cfg, height, width)
    geom = DecodeGeometry(
        latent_t=latent_t, latent_h=latent_h, latent_w=latent_w, out_channels=cfg.out_channels,
        spatial_ratio=r, temporal_ratio=cfg.temporal_ratio, num_chunks=n_chunks,
        tokens_per_chunk=chunk_geometry(cfg)[0], clip_latents=clip_lat, main_frames=main, tail_frames=tail,
        frame_overlap=frame_overlap, tiles_h=th, tiles_w=tw, num_frames=total, height=height, width=width,
    )
    units = []
    for c in range(n_chunks):
        t0 = c * geom.tokens_per_chunk
        for i, (hs, hl) in enumerate(zip(th.starts, th.lengths)):
            for j, (ws, wl) in enumerate(zip(tw.starts, tw.lengths)):
                units.append(DecodeUnit(
                    index=len(units), chunk=c, tile_row=i, tile_col=j, t0=t0, t1=t0 + clip_lat,
                    h0=hs // r, h1=(hs + hl) // r, w0=ws // r, w1=(ws + wl) // r, geom=geom,
                ))
    return units


# ----------------------------------------------------------------------------------------------------------------
# assembly


def finalize_pixels(x: torch.Tensor) -> torch.Tensor:
    """ImageNet-normalised decoder output [3, ...] -> float32 RGB clamped to [0, 1]."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=x.device).view(shape)
    return (x.float() * std + mean).clamp_(0.0, 1.0)


class StreamingAssembler:
    """Accepts unit results in any order and writes each temporal chunk into the output as soon as all its tiles
    (and every earlier chunk) are in, then frees them — so at most the out-of-order chunks are held, not the whole
    plan's fp32 outputs. The result is bitwise independent of arrival order.

    With a `sink`, finished frames are not kept: each stretch of them ([C, n, H, W], in order) goes to `sink` as it
    is finished (a long clip's mux takes them chunk by chunk), and `finish` returns None."""

    def __init__(self, plan: Sequence[DecodeUnit], *, finalize: bool = True,
                 device: torch.device | str | None = None, sink=None):
        if not plan:
            raise ValueError("empty decode plan")
        self.geom = plan[0].geom
        self.plan = list(plan)
        self.finalize = finalize
        self._device = device
        self._pending: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._seen: set[int] = set()
        self._next_chunk = 0
        self._tail: torch.Tensor | None = None
        self._write = 0
        self._sink = sink
        self.out: torch.Tensor | None = None

    def add(self, unit: DecodeUnit, result: torch.Tensor) -> None:
        if unit.geom != self.geom or unit.index >= len(self.plan) or self.plan[unit.index] != unit:
            raise ValueError(f"unit {unit.index} does not belong to this decode plan")
        if unit.index in self._seen:
            raise ValueError(f"unit {unit.index} was added twice")
        if tuple(result.shape) != unit.output_shape():
            raise ValueError(f"unit {unit.index}: result shape {tuple(result.shape)} != expected {unit.output_shape()}")
        self._seen.add(unit.index)
        self._pending.setdefault(unit.chunk, {})[(unit.tile_row, unit.tile_col)] = result
        while len(self._pending.get(self._next_chunk, ())) == self.geom.tiles_per_chunk:
            self._flush(self._pending.pop(self._next_chunk))
            self._next_chunk += 1

    def _emit(self, part: torch.Tensor) -> None:
        g = self.geom
        if self.out is None and self._sink is None:
            dev = part.device if self._device is None else self._device
            self.out = torch.empty(g.out_channels, g.num_frames, g.height, g.width, dtype=torch.float32, device=dev)
        n = min(part.shape[1], g.num_frames - self._write)  # frames of repeated pad latents are cut here
        if n > 0:
            part = part[:, :n]
            part = finalize_pixels(part) if self.finalize else part.float()
            if self._sink is not None:
                self._sink(part)
            else:
                self.out[:, self._write:self._write + n].copy_(part)
            self._write += n

    def _flush(self, tiles: dict[tuple[int, int], torch.Tensor]) -> None:
        g = self.geom
        # fp32 blending whatever dtype the units were shipped in
        grid = [[tiles[(i, j)].float() for j in range(len(g.tiles_w.starts))] for i in range(len(g.tiles_h.starts))]
        chunk = stitch_tiles(grid, g.tiles_h.overlaps, g.tiles_w.overlaps)
        del grid, tiles
        n_main = g.main_frames[1] - g.main_frames[0]
        body, tail = chunk[:, :n_main], chunk[:, n_main:]
        if self._tail is not None:
            body = blend(self._tail, body, g.frame_overlap, dim=1)
        self._emit(body)
        self._tail = tail if tail.shape[1] > 0 else None

    def finish(self) -> torch.Tensor | None:
        missing = [u.index for u in self.plan if u.index not in self._seen]
        if missing:
            raise ValueError(f"cannot assemble: results missing for units {missing[:16]}"
                             f"{' ...' if len(missing) > 16 else ''}")
        if self._tail is not None:
            self._emit(self._tail)
            self._tail = None
        assert self._write == self.geom.num_frames, "internal frame accounting error"
        return self.out


def assemble(plan: Sequence[DecodeUnit], results: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], *,
             finalize: bool = True) -> torch.Tensor:
    """Blend tiles, cross-fade chunks, cut pad frames -> `[3, F, H, W]` float32.

    `results` maps `unit.index` -> `decode_unit` output (a dict, or a list aligned with `plan`). With
    `finalize=True` the frames are RGB in [0, 1]; with False they stay in the raw ImageNet-normalised space."""
    asm = StreamingAssembler(plan, finalize=finalize)
    if isinstance(results, Mapping):
        bad = [k for k in results if not (isinstance(k, int) and 0 <= k < len(plan))]
        if bad:
            raise ValueError(f"result keys {bad[:8]} are not unit indices of this plan (0..{len(plan) - 1})")
        items = [(plan[k], v) for k, v in results.items()]
    else:
        if len(results) != len(plan):
            raise ValueError(f"got {len(results)} results for a plan of {len(plan)} units")
        items = list(zip(plan, results))
    for unit, res in sorted(items, key=lambda p: p[0].index):
        asm.add(unit, res)
    return asm.finish()
