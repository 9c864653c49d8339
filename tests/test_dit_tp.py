"""Tensor-parallel H3 DiT: TP 2 and 4 over gloo in real spawned processes must match TP 1 (1e-5 relative) with all
ranks bitwise identical; bad TP degrees fail with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.tp import ColumnParallelLinear, RowParallelLinear, TPConfigError, shard_state_dict, validate_tp
from tests.dit_ranks import assert_matches_one_rank, check_two_gpus, forward, one_rank, tiny_case
from tests.ranks import run_ranks

TP_RTOL = 1e-5
FORMS = ("mlp", "curve")
KEYFRAMES = ("first", "last")


def _tp_rank(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))  # an explicit group, not the default one
    result = {}
    for form in FORMS:  # one process launch serves both AdaLN forms (process start-up dominates test time)
        cfg, sd, lay, x = tiny_case(form, KEYFRAMES)
        model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=group).eval()
        model.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
        result[form] = forward(model, lay, x)
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_single_rank(world):
    outs = run_ranks(_tp_rank, world)
    for form in FORMS:
        cfg, sd, lay, x = tiny_case(form, KEYFRAMES)
        assert_matches_one_rank([o[form] for o in outs], one_rank(cfg, sd, lay, x), TP_RTOL, f"TP{world} {form}")


def test_shard_layout_and_bad_degrees():
    cfg = DiTConfig.tiny()
    with pytest.raises(TPConfigError, match="does not divide num_heads"):
        validate_tp(cfg, 3)
    with pytest.raises(TPConfigError, match="valid TP degrees"):
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
def _tp_model(cfg: DiTConfig, sd: dict, compute_dtype: torch.dtype, rank: int, world: int) -> H3DiT:
    m = H3DiT(cfg, compute_dtype=compute_dtype, tp_group=dist.group.WORLD)
    m.load_state_dict(shard_state_dict(sd, cfg, rank, world, H3DiT._tp_plan))
    return m


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_gpu():
    check_two_gpus(_tp_model, frames=20, label="TP2")
