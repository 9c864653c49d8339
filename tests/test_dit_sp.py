"""Sequence-parallel (Ulysses) H3 DiT, alone and mixed with TP, over gloo in real spawned processes: SP4 and
TP2 x SP2 match one rank (1e-5 relative), every rank bitwise identical; the all-to-all layouts and bad degrees."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.sp import (
                               SeqShards,
                               make_groups,
                               o_received,
                               o_send,
                               o_splits,
                               qkv_received,
                               qkv_send,
                               qkv_splits,
                               validate_parallel,
                               )
from minimax_h3.dit.tp import TPConfigError, shard_state_dict
from tests.dit_ranks import assert_matches_one_rank, check_two_gpus, forward, one_rank, tiny_case
from tests.ranks import run_ranks

RTOL = 1e-5
WORLD = 4
DEGREES = (4, 2)  # SP degrees run in the one launch: SP4 (TP1), then TP2 x SP2


def _sp_rank(rank: int, world: int) -> dict:
    cfg, sd, lay, x = tiny_case()
    result = {}
    for sp_degree in DEGREES:
        g = make_groups(rank, world, sp_degree)
        model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=g.tp_group, sp_group=g.sp_group).eval()
        model.load_state_dict(shard_state_dict(sd, cfg, g.tp_rank, g.tp_size, H3DiT._tp_plan))
        result[sp_degree] = forward(model, lay, x)
    return result


def test_sp_and_tp_sp_match_single_rank():
    cfg, sd, lay, x = tiny_case()
    assert len(set(SeqShards.split(lay.seq_len, 0, 4).sizes)) == 2  # uneven shards are exercised
    outs = run_ranks(_sp_rank, WORLD)
    ref = one_rank(cfg, sd, lay, x)
    for sp_degree in DEGREES:
        assert_matches_one_rank([o[sp_degree] for o in outs], ref, RTOL, f"TP{WORLD // sp_degree} x SP{sp_degree}")


def test_all_to_all_layouts_route_rows_and_heads():
    """The send/receive layouts, with the all-to-all done by hand: every rank ends with all rows of its heads, and
    then its rows of every head."""
    n, heads, d, total = 3, 6, 4, 10
    full = torch.randn(3, 1, heads, total, d)
    shards = [SeqShards.split(total, r, n) for r in range(n)]
    hs = heads // n

    def exchange(sends, splits):
        out = []
        for dst in range(n):
            parts = []
            for src in range(n):
                sizes = splits(shards[src])[0]
                off = sum(sizes[:dst])
                parts.append(sends[src][off:off + sizes[dst]])
            out.append(torch.cat(parts))
        return out

    recv = exchange([qkv_send(full[..., sh.rows(), :].contiguous(), n) for sh in shards],
                    lambda sh: qkv_splits(sh, hs, d))
    for r, sh in enumerate(shards):
        assert len(recv[r]) == sum(qkv_splits(sh, hs, d)[1])
        for i, t in enumerate(qkv_received(recv[r], sh, hs, d)):
            assert torch.equal(t, full[i][:, r * hs:(r + 1) * hs])
    o_full = torch.randn(1, heads, total, d)
    back = exchange([o_send(o_full[:, r * hs:(r + 1) * hs].contiguous(), sh) for r, sh in enumerate(shards)],
                    lambda sh: o_splits(sh, hs, d))
    for r, sh in enumerate(shards):
        assert torch.equal(o_received(back[r], sh, hs, d), o_full[..., sh.rows(), :])


def test_bad_degrees():
    cfg = DiTConfig.tiny()  # 4 heads
    validate_parallel(cfg, 2, 2)
    with pytest.raises(TPConfigError, match="valid SP degrees at TP2: \\[1, 2\\]"):
        validate_parallel(cfg, 2, 4)
    with pytest.raises(TPConfigError):
        validate_parallel(cfg, 1, 0)
    validate_parallel(DiTConfig.full(), 2, 4)  # 56 heads: TP2 x SP4 has 7 heads per rank
    with pytest.raises(TPConfigError, match="does not divide the 6 ranks"):
        make_groups(0, 6, 4)
    with pytest.raises(ValueError, match="cannot be split"):
        SeqShards.split(3, 0, 4)
    assert SeqShards.split(10, 2, 3).rows() == slice(7, 10)


# ---- GPU only: NCCL, release head_dim/rope, bf16 --------------------------------------------------------------------
def _sp_model(cfg: DiTConfig, sd: dict, compute_dtype: torch.dtype, rank: int, world: int) -> H3DiT:
    m = H3DiT(cfg, compute_dtype=compute_dtype, sp_group=dist.group.WORLD)
    m.load_state_dict(sd)
    return m


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sp2_nccl_gpu():
    check_two_gpus(_sp_model, frames=21, label="SP2")
