"""VSA block-sparse attention (minimax_h3/kernels/vsa.py) against an independent computation written here: the tile of
every row from its (frame, row, column), the tile means, the routing and its ties, one dense [S, S] mask, and plain
float64 softmax attention under it (docs/kernels.md, "Block-sparse attention (VSA)")."""

from __future__ import annotations

import math

import pytest
import torch

from minimax_h3.kernels.vsa import (TILE, VsaAttention, fastvideo_unavailable, fine_reference, select_tiles,
                                    tile_means, tile_rows, topk_count, vsa_attention, vsa_tiles)

# A packed sequence as H3 lays it out: text, one keyframe, the target audio, then the video grid (frames, H/2, W/2).
SEGMENTS = (70, 48, 30)
GRID = (7, 6, 9)  # 2 x 2 x 3 cubes, every edge cube partly padded


def tile_of_rows(segments, grid) -> tuple[torch.Tensor, int]:
    """Each packed row's tile, written from the definition: segments fill tiles of 64 rows in order, the video row
    (t, y, x) falls in cube (t // 4, y // 4, x // 4), cubes numbered frame slab, row, column after the prefix tiles."""
    tile, start = [], 0
    for n in segments:
        tile += [start + i // TILE for i in range(n)]
        start += math.ceil(n / TILE)
    t, h, w = grid
    nh, nw = math.ceil(h / 4), math.ceil(w / 4)
    for f in range(t):
        for y in range(h):
            for x in range(w):
                tile.append(start + ((f // 4) * nh + y // 4) * nw + x // 4)
    return torch.tensor(tile), start


def independent_vsa(q, k, v, segments, grid, keep, gate=None) -> torch.Tensor:
    """q, k, v [H, S, D] float64 -> [H, S, D]: routing per head from the tile means, then softmax over one dense
    mask; plus gate x the coarse branch."""
    tile, prefix = tile_of_rows(segments, grid)
    n = int(tile.max()) + 1
    member = torch.nn.functional.one_hot(tile, n).double()                       # [S, N]
    count = member.sum(0)
    qm, km, vm = ((member.T @ x) / count.view(-1, 1) for x in (q, k, v))         # [H, N, D]
    video = n - prefix
    kk = video if keep >= 1 else max(0, min(video - 1, max(1, round(keep * video))))
    h, s, d = q.shape
    out = torch.empty_like(q)
    for head in range(h):
        keep_tiles = torch.zeros(n, n, dtype=torch.bool)
        scores = qm[head] @ km[head, prefix:].T
        for i in range(n):
            if i < prefix or kk == video:
                keep_tiles[i] = True
                continue
            if kk:
                kth = scores[i].sort(descending=True).values[kk - 1]
                keep_tiles[i, prefix:] = scores[i] >= kth
            keep_tiles[i, :prefix] = True
            keep_tiles[i, max(0, i - 1):i + 2] = True
        allowed = keep_tiles[tile][:, tile]                                    # [S, S]
        logits = (q[head] @ k[head].T) / math.sqrt(d)
        logits = logits.masked_fill(~allowed, float("-inf"))
        out[head] = torch.softmax(logits, dim=-1) @ v[head]
        if gate is not None:
            c = torch.softmax(qm[head] @ km[head].T / math.sqrt(d), dim=-1) @ vm[head]   # [N, D]
            out[head] += gate[head] * c[tile]
    return out


def qkv(heads=2, dim=8, segments=SEGMENTS, grid=GRID, seed=0, dtype=torch.float64):
    s = sum(segments) + math.prod(grid)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, s, dim, generator=g, dtype=dtype) for _ in range(4)]


def test_tiles_follow_the_definition():
    tiles = vsa_tiles(SEGMENTS, GRID)
    tile, prefix = tile_of_rows(SEGMENTS, GRID)
    assert tiles.prefix == prefix == 4 and tiles.count == 4 + 12
    assert torch.equal(tiles.rows // TILE, tile)                                 # every row in its tile
    assert torch.equal(tiles.slots[tiles.rows], torch.arange(tile.numel()))     # ... once
    assert torch.equal(tiles.sizes, torch.bincount(tile))
    live = (torch.arange(TILE).view(1, -1) < tiles.sizes.view(-1, 1)).reshape(-1)
    assert torch.equal(live, tiles.slots >= 0)                                   # live rows at each tile's front


@pytest.mark.parametrize("n,keep,want", [(10, 0.1, 1), (1, 0.1, 0), (20, 0.95, 19), (100, 0.1, 10), (25, 0.1, 2),
                                         (15, 0.1, 2), (12, 1.0, 12)])
def test_topk_count(n, keep, want):
    assert topk_count(n, keep) == want  # round half to even (2.5 -> 2, 1.5 -> 2), at least 1, at most n - 1


@pytest.mark.parametrize("keep", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("grid", [GRID, (7, 8, 12), (2, 2, 2)])
def test_reference_equals_the_independent_computation(keep, grid):
    q, k, v, gate = qkv(grid=grid)
    tiles = vsa_tiles(SEGMENTS, grid)
    for g in (None, gate):
        got = vsa_attention(q, k, v, tiles, keep, g)
        want = independent_vsa(q, k, v, SEGMENTS, grid, keep, g)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_keeping_every_tile_is_dense_attention():
    q, k, v, _ = qkv()
    tiles = vsa_tiles(SEGMENTS, GRID)
    dense = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ v
    torch.testing.assert_close(vsa_attention(q, k, v, tiles, 1.0), dense, rtol=1e-10, atol=1e-10)


def test_ties_with_the_kth_score_are_kept():
    # Four video tiles whose means give one query tile the scores 3, 1, 1, 0: with k = 2 both 1s are kept.
    qm = torch.tensor([[[1.0, 0.0]] * 5])
    km = torch.tensor([[[0.0, 0.0], [3.0, 0.0], [1.0, 0.0], [1.0, 5.0], [0.0, 1.0]]])
    mask = select_tiles(qm, km, prefix=1, keep=0.5)
    assert topk_count(4, 0.5) == 2
    assert mask[0, 4].tolist() == [True, True, True, True, True]    # tiles 1-3 by score (a tie), 3-4 by distance
    assert mask[0, 1].tolist() == [True, True, True, True, False]   # the last tile neither scores nor neighbours


def test_the_reference_chunks_give_the_same_bits():
    q, k, v, _ = qkv(heads=3, grid=(7, 8, 12), dtype=torch.float32)
    tiles = vsa_tiles(SEGMENTS, (7, 8, 12))
    qt, kt, vt = (tile_rows(x, tiles) for x in (q, k, v))
    mask = select_tiles(tile_means(qt, tiles.sizes), tile_means(kt, tiles.sizes), tiles.prefix, 0.2)
    whole = fine_reference(qt, kt, vt, mask, tiles)
    for chunk in (1, 3 * 64 * 8 * 4 * 3):  # one query row / tile per chunk, and a few tiles
        assert torch.equal(fine_reference(qt, kt, vt, mask, tiles, chunk_bytes=chunk), whole)


def test_the_model_facing_call_takes_heads_side_by_side():
    q, k, v, gate = qkv(dtype=torch.float32)
    tiles = vsa_tiles(SEGMENTS, GRID)
    h, s, d = q.shape
    rows = gate.transpose(0, 1).reshape(s, h * d)  # a linear's output rows: heads side by side
    got = VsaAttention(tiles, 0.25)(q[None], k[None], v[None], rows)
    assert torch.equal(got[0], vsa_attention(q, k, v, tiles, 0.25, gate))


def test_fastvideo_needs_cuda():
    assert "CUDA" in fastvideo_unavailable("cpu")


@pytest.mark.skipif(not torch.cuda.is_available() or fastvideo_unavailable("cuda") is not None,
                    reason="needs a CUDA GPU with fastvideo-kernel")
def test_fastvideo_kernel_matches_the_reference():
    grid = (13, 24, 40)  # 4 x 6 x 10 cubes, as a 768x1280 canvas's third
    q, k, v, gate = (x.cuda() for x in qkv(heads=4, dim=128, segments=(300, 384, 414), grid=grid,
                                           dtype=torch.bfloat16))
    tiles = vsa_tiles((300, 384, 414), grid, "cuda")
    for g in (None, gate):
        ref = vsa_attention(q, k, v, tiles, 0.1, g, kernel="reference").double()
        got = vsa_attention(q, k, v, tiles, 0.1, g, kernel="fastvideo").double()
        assert float((got - ref).norm() / ref.norm()) < 2e-2


def test_the_registry_takes_the_reference_where_fastvideo_cannot_run():
    from minimax_h3.kernels.registry import select_vsa_kernel

    choice = select_vsa_kernel("cpu")
    assert (choice.op, choice.kernel) == ("vsa", "reference")
    assert "fastvideo-kernel runs on CUDA GPUs" in choice.reason
