"""Megatron-style tensor parallelism for the H3 DiT over an explicit torch.distributed process group.

The linear classes here hold only the *local* shard and never communicate; the reductions are visible
`dist.all_reduce` / `dist.all_gather` calls in the attention / MLP / AdaLN forwards of dit_svc/model.py.

Shard layout for TP size n, rank r (the checkpoint loader slices files exactly like `shard_state_dict` below):

  attn.qkv_proj.weight        rows [q rows of heads r*h/n..(r+1)*h/n ; k rows of those heads ; v rows of those heads]
  attn.out_proj.weight        the input columns of those heads
  mlp.fc1.weight              rows [gate rows r*F/n..(r+1)*F/n ; value rows of the same range]
  mlp.fc2.weight              input columns r*F/n..(r+1)*F/n
  *.adaln_proj.linear.{weight,bias}  (blocks and final layer) output rows r*O/n..(r+1)*O/n, outputs all-gathered
  everything else (norms incl. q_norm/k_norm, projections, heads, time embedder, curve table) replicated.

token_refiner blocks are sharded like DiT blocks. The AdaLN projections are sharded (not replicated) because the
unpruned ones total 13B params and cannot be replicated on 22 GB cards. For int8 checkpoints the per-output-row
`weight_scale` [out, 1] follows the weight's rows for column-parallel linears and is replicated for row-parallel ones.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .config import DiTConfig


class TPConfigError(ValueError):
    """The tensor-parallel degree does not fit the model config."""


# ---------------------------------------------------------------------------------------------------------------------
# Linear modules (local shards; no communication inside)
# ---------------------------------------------------------------------------------------------------------------------
class Linear(nn.Module):
    """nn.Linear-compatible module (same `weight`/`bias` keys) that runs in `compute_dtype`.

    compute_dtype None = the input's dtype. Any module with `forward(x) -> y` of the same shapes (e.g.
    stagekit.quant.Int8ConvRotLinear) can replace it via H3DiT.swap_linear; callers cast outputs themselves.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, compute_dtype: torch.dtype | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / max(1, self.in_features) ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype or x.dtype
        w = self.weight if self.weight.dtype == dt else self.weight.to(dt)
        b = None if self.bias is None else (self.bias if self.bias.dtype == dt else self.bias.to(dt))
        return F.linear(x.to(dt), w, b)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}")


class ColumnParallelLinear(Linear):
    """Holds out_features/tp_size output rows; output is this rank's slice (caller all-gathers if needed)."""

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, bias: bool = True, **kw):
        if out_features % tp_size:
            raise TPConfigError(f"out_features {out_features} not divisible by TP size {tp_size}")
        super().__init__(in_features, out_features // tp_size, bias=bias, **kw)
        self.tp_size = tp_size
        self.full_out_features = out_features


class RowParallelLinear(Linear):
    """Holds in_features/tp_size input columns; output is a partial sum (caller all-reduces, in fp32)."""

    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, bias: bool = False, **kw):
        if in_features % tp_size:
            raise TPConfigError(f"in_features {in_features} not divisible by TP size {tp_size}")
        if bias and tp_size > 1:
            raise TPConfigError("a row-parallel bias would be summed tp_size times; the H3 block linears have none")
        super().__init__(in_features // tp_size, out_features, bias=bias, **kw)
        self.tp_size = tp_size
        self.full_in_features = in_features


# ---------------------------------------------------------------------------------------------------------------------
# Group helpers
# ---------------------------------------------------------------------------------------------------------------------
def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def validate_tp(cfg: DiTConfig, n: int) -> None:
    """Raise TPConfigError (a ValueError) if TP degree n cannot shard cfg with the layout above."""
    if not isinstance(n, int) or n < 1:
        raise TPConfigError(f"TP degree must be a positive int, got {n!r}")
    checks = (
        ("num_heads", cfg.num_heads),
        ("ffn", cfg.ffn),
        ("block AdaLN out features (18*hidden)", cfg.adaln_out),
        ("final AdaLN out features (2*hidden)", cfg.final_adaln_out),
    )
    bad = [f"{name}={value}" for name, value in checks if value % n]
    if bad:
        ok = [d for d in range(1, cfg.num_heads + 1) if all(v % d == 0 for _, v in checks)]
        raise TPConfigError(
            f"TP degree {n} does not divide {', '.join(bad)}; valid TP degrees for this config: {ok}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Reference slicing (tests and docs; the checkpoint loader must produce exactly these tensors)
# ---------------------------------------------------------------------------------------------------------------------
_BLOCK = r"(?:blocks|token_refiner\.blocks)\.\d+"
_QKV = re.compile(rf"^{_BLOCK}\.attn\.qkv_proj\.(weight|weight_scale)$")
_OUT = re.compile(rf"^{_BLOCK}\.attn\.out_proj\.weight$")
_FC1 = re.compile(rf"^{_BLOCK}\.mlp\.fc1\.(weight|weight_scale)$")
_FC2 = re.compile(rf"^{_BLOCK}\.mlp\.fc2\.weight$")
_ADALN = re.compile(r"^(?:blocks\.\d+|final_layer)\.adaln_proj\.linear\.(weight|bias|weight_scale)$")


def shard_qkv_rows(t: torch.Tensor, cfg: DiTConfig, rank: int, n: int) -> torch.Tensor:
    hl = cfg.num_heads // n
    x = t.reshape(3, cfg.num_heads, cfg.head_dim, *t.shape[1:])
    return x[:, rank * hl:(rank + 1) * hl].reshape(3 * hl * cfg.head_dim, *t.shape[1:])


def shard_fc1_rows(t: torch.Tensor, cfg: DiTConfig, rank: int, n: int) -> torch.Tensor:
    fl = cfg.ffn // n
    x = t.reshape(2, cfg.ffn, *t.shape[1:])
    return x[:, rank * fl:(rank + 1) * fl].reshape(2 * fl, *t.shape[1:])


def shard_state_dict(full_sd: Mapping[str, torch.Tensor], cfg: DiTConfig, rank: int, n: int) -> dict[str, torch.Tensor]:
    """Slice a full (release-named, qkv [q;k;v], fc1 [gate;value]) state dict to TP rank `rank` of `n`."""
    validate_tp(cfg, n)
    if not 0 <= rank < n:
        raise TPConfigError(f"rank {rank} out of range for TP size {n}")
    if n == 1:
        return dict(full_sd)
    hd_lo = rank * (cfg.num_heads // n) * cfg.head_dim
    hd_hi = hd_lo + (cfg.num_heads // n) * cfg.head_dim
    f_lo, f_hi = rank * (cfg.ffn // n), (rank + 1) * (cfg.ffn // n)
    out: dict[str, torch.Tensor] = {}
    for key, t in full_sd.items():
        if _QKV.match(key):
            s = shard_qkv_rows(t, cfg, rank, n)
        elif _OUT.match(key):
            s = t[:, hd_lo:hd_hi]
        elif _FC1.match(key):
            s = shard_fc1_rows(t, cfg, rank, n)
        elif _FC2.match(key):
            s = t[:, f_lo:f_hi]
        elif _ADALN.match(key):
            rows = t.shape[0] // n
            s = t[rank * rows:(rank + 1) * rows]
        else:
            s = t
        out[key] = s.contiguous().clone() if s is not t else t
    return out
