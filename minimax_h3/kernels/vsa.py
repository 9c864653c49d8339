"""VSA (FastVideo's video sparse attention) over MiniMax-H3's packed sequence, as ComfyUI's `BlockSparseAttention`
node runs it with method "vsa" for the FastH3 checkpoints (docs/kernels.md, "Block-sparse attention (VSA)").

The sequence is cut into tiles of 64 rows (`vsa_tiles`): every segment before the target video (the text, each
keyframe, each reference's sound and frames, the target audio) in zero-padded tiles of its own, the "prefix" tiles;
then the target video in cubes of 4 x 4 x 4 rows of its (latent frames, H/2, W/2) grid, cubes ordered frame slab,
row, column, edge cubes padded. The live rows of a tile come first in it. Then, per head:

1. the mean of q, k and v over each tile's live rows, in fp32 (`tile_means`);
2. routing (`select_tiles`): a video query tile keeps the video key tiles whose pooled score q_mean . k_mean is at
   least its k-th largest, k = round(keep x video tiles) within [1, video tiles - 1] (`topk_count`), and the tiles at
   distance <= 1 of its own index; every query tile keeps every prefix tile, and a prefix query tile every tile;
3. fine: exact softmax attention (scale 1/sqrt(D)) of each query row over the live rows of the tiles its query tile
   kept;
4. coarse, for a checkpoint with VSA gates: softmax(q_mean k_mean^T / sqrt(D)) v_mean over all tiles, times the gate
   `to_gate_compress(x)` of each row, added to the row's fine output.

Step 3 has two implementations (`VSA_KERNELS`), the rest is shared: "fastvideo", the block-sparse kernel of the
optional `fastvideo-kernel` package (ThunderKittens on sm_90 where its extension loads, Triton on other CUDA GPUs;
bf16), and "reference", PyTorch on any device: the key tiles each query tile kept are gathered, a chunk of query
tiles at a time, and attended exactly by SDPA with the pad rows masked. The kernel registry picks one at start-up
(`minimax_h3.kernels.registry.select_vsa_kernel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

TILE = 64                 # rows per tile: a cube of CUBE rows, and the kernels' block
CUBE = (4, 4, 4)          # (latent frames, rows, columns) of a video tile
PACKAGE = "fastvideo-kernel"
PINNED = "fastvideo-kernel==0.3.5"
VSA_KERNELS = ("fastvideo", "reference")
REFERENCE_CHUNK_BYTES = 256 << 20  # gathered keys + values of one reference chunk of query tiles


@dataclass(frozen=True)
class VsaTiles:
    """The 64-row tiles of one packed sequence of S rows, N tiles."""

    slots: torch.Tensor   # [N * TILE] long: the packed row in each tile slot, -1 for a pad slot
    rows: torch.Tensor    # [S] long: the tile slot of each packed row
    sizes: torch.Tensor   # [N] long: live rows of each tile (>= 1), at its front
    prefix: int           # tiles before the video's (every segment but the target video)

    @property
    def count(self) -> int:
        return int(self.sizes.numel())

    @property
    def video(self) -> int:
        return self.count - self.prefix


def vsa_tiles(prefix_segments: Sequence[int], grid: tuple[int, int, int],
              device: torch.device | str = "cpu") -> VsaTiles:
    """The tiles of a packed sequence made of segments of `prefix_segments` rows (in order) followed by the target
    video's rows, frame-major then row then column on a `grid` (latent frames, H/2, W/2)."""
    if any(n < 0 for n in prefix_segments) or min(grid) < 1:
        raise ValueError(f"segments {list(prefix_segments)} and video grid {grid} must be sizes (grid >= 1)")
    parts, row = [], 0
    for n in prefix_segments:
        if n == 0:
            continue
        m = -(-n // TILE)
        seg = torch.full((m * TILE,), -1, dtype=torch.long)
        seg[:n] = torch.arange(row, row + n)
        parts.append(seg.view(m, TILE))
        row += n
    prefix = sum(p.shape[0] for p in parts)
    t, h, w = grid
    ct, ch, cw = CUBE
    pt, ph, pw = -(-t // ct) * ct, -(-h // ch) * ch, -(-w // cw) * cw
    video = torch.full((pt, ph, pw), -1, dtype=torch.long)
    video[:t, :h, :w] = torch.arange(row, row + t * h * w).view(t, h, w)
    cubes = video.view(pt // ct, ct, ph // ch, ch, pw // cw, cw).permute(0, 2, 4, 1, 3, 5).reshape(-1, TILE)
    order = torch.argsort((cubes < 0).to(torch.int8), dim=1, stable=True)  # live rows first, in their order
    parts.append(torch.gather(cubes, 1, order))
    tiles = torch.cat(parts)
    slots = tiles.reshape(-1)
    live = slots >= 0
    rows = torch.empty(row + t * h * w, dtype=torch.long)
    rows[slots[live]] = torch.nonzero(live).flatten()
    return VsaTiles(slots.to(device), rows.to(device), live.view(-1, TILE).sum(1).to(device), prefix)


def topk_count(video_tiles: int, keep: float) -> int:
    """Video key tiles a video query tile keeps by score: round(keep x video_tiles) within [1, video_tiles - 1] (0
    with a single video tile: the tiles next to its own are kept anyway); keep >= 1 keeps them all."""
    if keep >= 1:
        return video_tiles
    return max(0, min(video_tiles - 1, max(1, round(keep * video_tiles))))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tile means and the coarse branch: fp32, or the input's when wider."""
    return torch.promote_types(dtype, torch.float32)


def tile_means(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """x [H, N * TILE, D] tiled (pad rows zero) -> the mean over each tile's live rows [H, N, D], fp32 (or wider)."""
    h, _, d = x.shape
    wide = _wide(x.dtype)
    return x.view(h, -1, TILE, d).sum(2, dtype=wide) / sizes.view(1, -1, 1).to(wide)


def select_tiles(qm: torch.Tensor, km: torch.Tensor, prefix: int, keep: float) -> torch.Tensor:
    """The key tiles each query tile attends: bool [H, N, N] from the tile means qm, km [H, N, D] (step 2 of the
    module docstring). A tie with the k-th score is kept."""
    h, n, _ = qm.shape
    kk = topk_count(n - prefix, keep)
    if kk == n - prefix:
        return torch.ones(h, n, n, dtype=torch.bool, device=qm.device)
    mask = torch.zeros(h, n, n, dtype=torch.bool, device=qm.device)
    if kk:
        scores = torch.matmul(qm, km[:, prefix:].transpose(1, 2))  # [H, N, video tiles]
        mask[..., prefix:] = scores >= scores.topk(kk, dim=-1).values[..., -1:]
    idx = torch.arange(n, device=qm.device)
    mask |= (idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1
    mask[..., :prefix] = True
    mask[:, :prefix] = True
    return mask


def coarse(qm: torch.Tensor, km: torch.Tensor, vm: torch.Tensor) -> torch.Tensor:
    """The coarse branch before its gate: dense attention over the tile means [H, N, D] -> [H, N, D]."""
    s = torch.matmul(qm, km.transpose(1, 2)) * (1.0 / math.sqrt(qm.shape[-1]))
    return torch.matmul(torch.softmax(s, dim=-1), vm)


def _live(sizes: torch.Tensor) -> torch.Tensor:
    """[N * TILE] bool: the live slots of the tiles."""
    return (torch.arange(TILE, device=sizes.device).view(1, -1) < sizes.view(-1, 1)).reshape(-1)


def fine_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tiles: VsaTiles,
                   chunk_bytes: int = REFERENCE_CHUNK_BYTES) -> torch.Tensor:
    """Step 3 in PyTorch: q, k, v [H, N * TILE, D] tiled, mask [H, N, N] -> o [H, N * TILE, D] (pad rows zero).

    A prefix query tile attends every live row: its rows go to SDPA with the live keys themselves, `chunk_bytes` of
    scores at a time. A video query tile's kept key tiles are gathered (each tile's ids first, the query tile's count
    of them valid) and attended by SDPA with the pad and unused slots masked, `chunk_bytes` of gathered keys and
    values at a time."""
    h, _, d = q.shape
    live = _live(tiles.sizes)
    out = torch.zeros_like(q)
    elt = q.element_size()
    p_rows = tiles.prefix * TILE
    if p_rows:
        k_live, v_live = k[:, live], v[:, live]
        step = max(TILE, chunk_bytes // max(1, 4 * h * k_live.shape[1]) // TILE * TILE)  # fp32 scores of a chunk
        for a in range(0, p_rows, step):
            out[:, a:a + step] = F.scaled_dot_product_attention(q[:, a:a + step], k_live, v_live)
    n = tiles.count
    if n == tiles.prefix:
        return out
    counts = mask[:, tiles.prefix:].sum(-1)                                      # [H, video tiles]
    width = int(counts.max())
    kept = torch.argsort(mask[:, tiles.prefix:].to(torch.int8), dim=-1, descending=True, stable=True)[..., :width]
    offsets = torch.arange(TILE, device=q.device)
    per_tile = max(1, chunk_bytes // max(1, 2 * h * width * TILE * d * elt))
    for a in range(0, n - tiles.prefix, per_tile):
        b = min(a + per_tile, n - tiles.prefix)
        slot = (kept[:, a:b].unsqueeze(-1) * TILE + offsets).flatten(-2)        # [H, tiles, width * TILE]
        valid = torch.arange(width, device=q.device).view(1, 1, -1) < counts[:, a:b].unsqueeze(-1)
        valid = valid.repeat_interleave(TILE, dim=-1) & live[slot]
        idx = slot.reshape(h, -1, 1).expand(-1, -1, d)
        kg = torch.gather(k, 1, idx).view(h, b - a, -1, d)
        vg = torch.gather(v, 1, idx).view(h, b - a, -1, d)
        rows = slice((tiles.prefix + a) * TILE, (tiles.prefix + b) * TILE)
        qc = q[:, rows].reshape(h, b - a, TILE, d)
        out[:, rows] = F.scaled_dot_product_attention(qc, kg, vg, attn_mask=valid.unsqueeze(2)).reshape(h, -1, d)
    return out


def fastvideo_unavailable(device: torch.device | str) -> str | None:
    """None if fastvideo-kernel's block-sparse kernel can run on `device`, else why not (never raises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{PACKAGE} runs on CUDA GPUs (device is {device.type})"
    try:
        from fastvideo_kernel import block_sparse_attn  # noqa: F401
    except Exception as e:  # ImportError, or an extension built against another torch / CUDA
        return f"{PACKAGE} is not importable ({type(e).__name__}: {e}); pip install --no-deps {PINNED}"
    return None


def fine_fastvideo(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   tiles: VsaTiles) -> torch.Tensor:
    """Step 3 by fastvideo-kernel's `block_sparse_attn`: the same tiles and mask, bf16 [H, N * TILE, D] on CUDA (its
    pad rows hold whatever the kernel leaves there: no packed row reads them)."""
    from fastvideo_kernel import block_sparse_attn

    if q.dtype != torch.bfloat16:
        raise RuntimeError(f"{PACKAGE}'s block-sparse kernels take bf16; the compute dtype here is {q.dtype} (the "
                           "registry then picks the reference)")
    o, _ = block_sparse_attn(q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(),
                             mask.unsqueeze(0), tiles.sizes.to(torch.int32))
    return o[0]


_FINE = {"fastvideo": fine_fastvideo, "reference": fine_reference}


def tile_rows(x: torch.Tensor, tiles: VsaTiles) -> torch.Tensor:
    """[H, S, D] -> [H, N * TILE, D] in tile order, pad slots zero."""
    out = x.index_select(1, tiles.slots.clamp(min=0))
    return out.masked_fill_((tiles.slots < 0).view(1, -1, 1), 0)


def vsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VsaTiles, keep: float,
                  gate: torch.Tensor | None = None, kernel: str = "reference") -> torch.Tensor:
    """VSA of q, k, v [H, S, D] (after q/k norm and RoPE) -> o [H, S, D] in their dtype; `gate` [H, S, D] (the rows'
    to_gate_compress output) adds the coarse branch, None leaves it out; `keep` the fraction of video tiles kept."""
    if kernel not in _FINE:
        raise ValueError(f"unknown VSA kernel {kernel!r}; one of {VSA_KERNELS}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if q.shape[1] != tiles.rows.numel():
        raise ValueError(f"the tiles cover {tiles.rows.numel()} rows, the attention {q.shape[1]}")
    qt, kt, vt = (tile_rows(x, tiles) for x in (q, k, v))
    qm, km = tile_means(qt, tiles.sizes), tile_means(kt, tiles.sizes)
    mask = select_tiles(qm, km, tiles.prefix, keep)
    out = _FINE[kernel](qt, kt, vt, mask, tiles).index_select(1, tiles.rows)
    if gate is None:
        return out
    oc = coarse(qm, km, tile_means(vt, tiles.sizes))            # [H, N, D]
    wide = _wide(q.dtype)
    return (out.to(wide) + gate.to(wide) * oc.index_select(1, tiles.rows // TILE)).to(q.dtype)


@dataclass(frozen=True)
class VsaAttention:
    """The VSA of one model evaluation: the sequence's tiles, the fraction of video tiles kept, the kernel. Called
    by a block's attention on its q, k, v [1, H, S, D] (and gate [S, H * D] or None) in place of the dense kernel;
    kept out of torch.compile (its shapes depend on the routing)."""

    tiles: VsaTiles
    keep: float
    kernel: str = "reference"

    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
        h, s, d = q.shape[1:]
        g = None if gate is None else gate.view(s, h, d).transpose(0, 1)
        return vsa_attention(q[0], k[0], v[0], self.tiles, self.keep, g, self.kernel).unsqueeze(0)
