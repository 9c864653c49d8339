"""Sequence-parallel (Ulysses) H3 DiT, alone and mixed with TP, over gloo in real spawned processes: SP4 and
TP2 x SP2 match one rank (1e-5 relative), every rank bitwise identical; the all-to-all layouts and bad degrees."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dit_svc.config import DiTConfig
from dit_svc.layout import build_layout
from dit_svc.model import H3DiT
from dit_svc.sp import (
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
from dit_svc.tp import TPConfigError, shard_state_dict

RTOL = 1e-5
T_VIDEO, T_AUDIO = 0.37, 0.58
WORLD = 4
DEGREES = (4, 2)  # SP degrees run in the one launch: SP4 (TP1), then TP2 x SP2


def _case():
    cfg = DiTConfig.tiny(num_layers=2, num_refiner_layers=1)
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    lay = build_layout(cfg, 5, 22, 64, 96, ("first",))
    g = torch.Generator().manual_seed(1)
    video = torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g)
    audio = torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g)
    text = torch.randn(lay.text_len, cfg.text_dim, generator=g)
    return cfg, model.state_dict(), lay, (video, audio, text)


def _worker(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    # Rendezvous through a file in the test's folder: no port to guess (docs/testing.md).
    dist.init_process_group("gloo", init_method=f"file://{outdir}/store", rank=rank, world_size=world)
    try:
        cfg, sd, lay, (video, audio, text) = _case()
        result = {}
        for sp_degree in DEGREES:
            g = make_groups(rank, world, sp_degree)
            model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=g.tp_group,
                          sp_group=g.sp_group).eval()
            model.load_state_dict(shard_state_dict(sd, cfg, g.tp_rank, g.tp_size, H3DiT._tp_plan))
            with torch.no_grad():
                result[sp_degree] = model(video, audio, text, torch.tensor(T_VIDEO), torch.tensor(T_AUDIO), lay)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_sp_and_tp_sp_match_single_rank():
    cfg, sd, lay, (video, audio, text) = _case()
    assert len(set(SeqShards.split(lay.seq_len, 0, 4).sizes)) == 2  # uneven shards are exercised
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(WORLD, d), nprocs=WORLD, join=True, start_method="spawn")
        outs = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ref.load_state_dict(sd)
    with torch.no_grad():
        rv, ra = ref(video, audio, text, torch.tensor(T_VIDEO), torch.tensor(T_AUDIO), lay)
    for sp_degree in DEGREES:
        v0, a0 = outs[0][sp_degree]
        for o in outs[1:]:  # every rank holds bitwise the same result
            assert torch.equal(o[sp_degree][0], v0) and torch.equal(o[sp_degree][1], a0)
        ev, ea = _rel(v0, rv), _rel(a0, ra)
        print(f"TP{WORLD // sp_degree} x SP{sp_degree}: video rel {ev:.3e}, audio rel {ea:.3e}")
        assert ev <= RTOL and ea <= RTOL


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
def _gpu_case():
    cfg = DiTConfig.full(num_layers=2, num_refiner_layers=1, hidden=1024, num_heads=8, ffn=2048, text_dim=512,
                         time_embed_hidden=512, time_embed_dim=256)
    torch.manual_seed(0)
    sd = H3DiT(cfg, compute_dtype=torch.float32).state_dict()
    lay = build_layout(cfg, 21, 56, 256, 448, ("first",))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(lay.num_video_rows, 96, generator=g), torch.randn(lay.num_audio_rows, 32, generator=g),
         torch.randn(lay.text_len, cfg.text_dim, generator=g))
    return cfg, sd, lay, x


def _gpu_worker(rank: int, world: int, outdir: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{outdir}/store", rank=rank, world_size=world)
    try:
        cfg, sd, lay, x = _gpu_case()
        res = {}
        for cd in (torch.float32, torch.bfloat16):
            m = H3DiT(cfg, compute_dtype=cd, sp_group=dist.group.WORLD).eval()
            m.load_state_dict(sd)
            m.cuda()
            with torch.no_grad():
                v, a = m(*(t.cuda() for t in x), 0.3, 0.6, lay.to("cuda"))
            res[str(cd)] = (v.cpu(), a.cpu())
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sp2_nccl_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, sd, lay, x = _gpu_case()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_gpu_worker, args=(2, d), nprocs=2, join=True, start_method="spawn")
        outs = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]
    for cd, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ref = H3DiT(cfg, compute_dtype=cd).eval()
        ref.load_state_dict(sd)
        ref.cuda()
        with torch.no_grad():
            rv, ra = ref(*(t.cuda() for t in x), 0.3, 0.6, lay.to("cuda"))
        v0, a0 = outs[0][str(cd)]
        assert torch.equal(outs[1][str(cd)][0], v0) and torch.equal(outs[1][str(cd)][1], a0)
        ev, ea = _rel(v0, rv.cpu()), _rel(a0, ra.cpu())
        print(f"NCCL SP2 {cd}: video rel {ev:.3e}, audio rel {ea:.3e}")
        assert ev <= tol and ea <= tol
