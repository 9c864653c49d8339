"""Tensor-parallel H3 DiT: TP 2 and 4 over gloo in real spawned processes must match TP 1 (1e-5 relative) with all
ranks bitwise identical; bad TP degrees fail with a clear error."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dit_svc.config import DiTConfig
from dit_svc.layout import build_layout
from dit_svc.model import H3DiT, curve_state_dict_from_mlp
from dit_svc.tp import ColumnParallelLinear, RowParallelLinear, TPConfigError, shard_state_dict, validate_tp

TP_RTOL = 1e-5
T_VIDEO, T_AUDIO = 0.37, 0.58


def _case(form: str):
    """Deterministic full model + inputs (identical in every process)."""
    cfg = DiTConfig.tiny(num_layers=2, num_refiner_layers=1)
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = model.state_dict()
    if form == "curve":
        sd, cfg = curve_state_dict_from_mlp(sd, cfg)
    lay = build_layout(cfg, 5, 22, 64, 96, ("first", "last"))
    g = torch.Generator().manual_seed(1)
    video = torch.randn(lay.num_video_rows, cfg.video_patch_dim, generator=g)
    audio = torch.randn(lay.num_audio_rows, cfg.audio_in_channels, generator=g)
    text = torch.randn(lay.text_len, cfg.text_dim, generator=g)
    return cfg, sd, lay, (video, audio, text)


FORMS = ("mlp", "curve")


def _worker(rank: int, world: int, outdir: str) -> None:
    torch.set_num_threads(1)
    # A file rendezvous in the test's own folder: no port to pick, so none another process can take meanwhile.
    dist.init_process_group("gloo", init_method=f"file://{outdir}/store", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # an explicit group, not the default one
        result = {}
        for form in FORMS:  # one process launch serves both AdaLN forms (process start-up dominates test time)
            cfg, sd, lay, (video, audio, text) = _case(form)
            model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=group).eval()
            model.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
            with torch.no_grad():
                result[form] = model(video, audio, text, torch.tensor(T_VIDEO), torch.tensor(T_AUDIO), lay)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_tp(world: int):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, d), nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_single_rank(world):
    outs = _run_tp(world)
    for form in FORMS:
        cfg, sd, lay, (video, audio, text) = _case(form)
        ref = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
        ref.load_state_dict(sd)
        with torch.no_grad():
            rv, ra = ref(video, audio, text, torch.tensor(T_VIDEO), torch.tensor(T_AUDIO), lay)
        v0, a0 = outs[0][form]
        for o in outs[1:]:  # every rank holds bitwise the same result
            assert torch.equal(o[form][0], v0) and torch.equal(o[form][1], a0)
        ev, ea = _rel(v0, rv), _rel(a0, ra)
        print(f"TP{world} {form}: video rel {ev:.3e}, audio rel {ea:.3e}")
        assert ev <= TP_RTOL and ea <= TP_RTOL


def test_shard_layout_and_bad_degrees():
    cfg = DiTConfig.tiny()
    with pytest.raises(TPConfigError, match="does not divide num_heads"):
        validate_tp(cfg, 3)
    with pytest.raises(ValueError, match="valid TP degrees"):
        validate_tp(DiTConfig.full(), 3)
    validate_tp(DiTConfig.full(), 8)
    with pytest.raises(TPConfigError):
        validate_tp(cfg, 0)
    with pytest.raises(TPConfigError):
        shard_state_dict({}, cfg, 2, 2, H3DiT._tp_plan)
    # reference slicing: qkv/fc1 keep [q;k;v] / [gate;value] blocks of this rank's heads / ffn range
    full = H3DiT(cfg, compute_dtype=torch.float32).state_dict()
    n, r = 2, 1
    sh = shard_state_dict(full, cfg, r, n, H3DiT._tp_plan)
    hd, hl, fl = cfg.head_dim, cfg.num_heads // n, cfg.ffn // n
    qkv = full["blocks.0.attn.qkv_proj.weight"]
    inner = cfg.attn_inner
    exp = torch.cat([qkv[i * inner + r * hl * hd: i * inner + (r + 1) * hl * hd] for i in range(3)])
    assert torch.equal(sh["blocks.0.attn.qkv_proj.weight"], exp)
    assert torch.equal(sh["token_refiner.blocks.0.attn.out_proj.weight"],
                       full["token_refiner.blocks.0.attn.out_proj.weight"][:, r * hl * hd:(r + 1) * hl * hd])
    fc1 = full["blocks.1.mlp.fc1.weight"]
    assert torch.equal(sh["blocks.1.mlp.fc1.weight"], torch.cat([fc1[r * fl:(r + 1) * fl],
                                                                fc1[cfg.ffn + r * fl: cfg.ffn + (r + 1) * fl]]))
    assert torch.equal(sh["blocks.1.mlp.fc2.weight"], full["blocks.1.mlp.fc2.weight"][:, r * fl:(r + 1) * fl])
    ad = full["final_layer.adaln_proj.linear.bias"]
    assert torch.equal(sh["final_layer.adaln_proj.linear.bias"], ad[ad.shape[0] // 2:])
    for k in ("blocks.0.attn.q_norm.weight", "condition_proj.weight", "final_layer.video_out.weight"):
        assert torch.equal(sh[k], full[k])
    # local module shapes agree with the slices
    with pytest.raises(TPConfigError):
        ColumnParallelLinear(4, 6, tp_size=4)
    with pytest.raises(TPConfigError):
        RowParallelLinear(6, 4, tp_size=4)


# ---- GPU-only: NCCL, release head_dim/rope, bf16 --------------------------------------------------------------------
def _gpu_case():
    cfg = DiTConfig.full(num_layers=2, num_refiner_layers=1, hidden=1024, num_heads=8, ffn=2048, text_dim=512,
                         time_embed_hidden=512, time_embed_dim=256)
    torch.manual_seed(0)
    sd = H3DiT(cfg, compute_dtype=torch.float32).state_dict()
    lay = build_layout(cfg, 20, 56, 256, 448, ("first",))
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
            m = H3DiT(cfg, compute_dtype=cd, tp_group=dist.group.WORLD).eval()
            m.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
            m.cuda()
            with torch.no_grad():
                v, a = m(*(t.cuda() for t in x), 0.3, 0.6, lay.to("cuda"))
            res[str(cd)] = (v.cpu(), a.cpu())
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_gpu():
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
        print(f"NCCL TP2 {cd}: video rel {ev:.3e}, audio rel {ea:.3e}")
        assert ev <= tol and ea <= tol
