"""Megatron-style tensor parallelism for the H3 DiT over an explicit torch.distributed process group.

The linear classes here hold only the *local* shard and never communicate; the reductions are visible
`dist.all_reduce` / `dist.all_gather` calls in the attention / MLP / AdaLN forwards of minimax_h3/dit/model.py.

Which linear is column- or row-parallel is declared once, as `H3DiT._tp_plan` (module-name suffix -> style); the
model builds its linears from it, the checkpoint loader reads each rank's part of a file from it, and
`shard_state_dict` below (the reference slicer of the tests) and the LoRA code slice with it. For TP size n, rank r:

  ColumnParallel(sections=k)  output features (weight rows) split: the rows form k equal sections (q/k/v of
                              attn.qkv_proj, gate/value of mlp.fc1, one for the AdaLN projections), each cut into n
                              contiguous parts; rank r keeps part r of every section, in section order. For qkv a
                              part is whole heads (num_heads % n == 0). Bias and an int8 per-row weight_scale follow
                              the rows.
  RowParallel()               input features (weight columns) split into n contiguous parts; the output is a partial
                              sum all-reduced in fp32 in forward; an int8 per-row weight_scale is replicated.
  (not in the plan)           replicated: norms incl. q_norm/k_norm, patch/condition projections, output heads, time
                              embedder, curve table.

token_refiner blocks are sharded like DiT blocks. The AdaLN projections are sharded (not replicated) because the
unpruned ones total 13B params and cannot be replicated on 22 GB cards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from stagekit.errors import FailedPrecondition

from .config import DiTConfig


class TPConfigError(FailedPrecondition):
    """The tensor-parallel (or sequence-parallel) degree does not fit the model config: a setting of the server's
    (its rank count, --sp-degree) that the operator changes."""


# ---------------------------------------------------------------------------------------------------------------------
# Linear modules (local shards; no communication inside)
# ---------------------------------------------------------------------------------------------------------------------
class Linear(nn.Module):
    """nn.Linear-compatible module (same `weight`/`bias` keys) that runs in `compute_dtype`.

    compute_dtype None = the input's dtype. Any module with `forward(x) -> y` of the same shapes (e.g.
    minimax_h3.kernels.int8.Int8ConvRotLinear) can replace it via H3DiT.swap_linear; callers cast outputs themselves.
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
    """Raise TPConfigError (FAILED_PRECONDITION) if TP degree n cannot shard cfg with the layout above."""
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
# The plan's vocabulary and the slicing it implies
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnParallel:
    """Output features split; `sections` equal row blocks are each split (see the module docstring)."""

    sections: int = 1


@dataclass(frozen=True)
class RowParallel:
    """Input features split; the output is a partial sum."""


TPStyle = ColumnParallel | RowParallel
TPPlan = Mapping[str, TPStyle]  # module-name suffix ("attn.qkv_proj") -> style
QUANT_SIDECARS = ("weight_scale",)  # per-row tensors that travel with an int8 weight


def tp_style(plan: TPPlan, module: str) -> TPStyle | None:
    """The style of linear `module` ("blocks.3.attn.qkv_proj"), None = replicated."""
    for suffix, style in plan.items():
        if module == suffix or module.endswith("." + suffix):
            return style
    return None


def param_style(plan: TPPlan, key: str) -> TPStyle | None:
    """The style a parameter ("blocks.3.attn.qkv_proj.weight") is sliced by (its module's); None = replicated."""
    module, _, _ = key.rpartition(".")
    return tp_style(plan, module) if module else None


def section_ranges(style: ColumnParallel, rows: int, rank: int, n: int) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of a column-parallel tensor with `rows` rows that rank `rank` of `n` keeps."""
    per = rows // style.sections
    part = per // n
    if per * style.sections != rows or part * n != per:
        raise TPConfigError(f"{rows} rows do not split into {style.sections} section(s) x {n} ranks")
    return [(s * per + rank * part, s * per + (rank + 1) * part) for s in range(style.sections)]


def column_range(cols: int, rank: int, n: int) -> tuple[int, int]:
    """Column range [lo, hi) of a row-parallel weight with `cols` input features that rank `rank` of `n` keeps."""
    if cols % n:
        raise TPConfigError(f"{cols} input features do not split over {n} ranks")
    return rank * (cols // n), (rank + 1) * (cols // n)


def shard_tensor(t: torch.Tensor, style: TPStyle | None, param: str, rank: int, n: int) -> torch.Tensor:
    """This rank's part of full tensor `t`, parameter `param` ("weight", "bias", "weight_scale") of a linear."""
    if isinstance(style, ColumnParallel):
        return torch.cat([t[lo:hi] for lo, hi in section_ranges(style, t.shape[0], rank, n)])
    if isinstance(style, RowParallel) and param == "weight":
        lo, hi = column_range(t.shape[1], rank, n)
        return t[:, lo:hi]
    return t  # replicated, or the bias / per-row scale of a row-parallel linear


def shard_state_dict(full_sd: Mapping[str, torch.Tensor], cfg: DiTConfig, rank: int, n: int,
                     plan: TPPlan) -> dict[str, torch.Tensor]:
    """Slice a full (release-named, qkv [q;k;v], fc1 [gate;value]) state dict to TP rank `rank` of `n` by `plan`
    (the reference the checkpoint loader's per-rank reads are tested against)."""
    validate_tp(cfg, n)
    if not 0 <= rank < n:
        raise TPConfigError(f"rank {rank} out of range for TP size {n}")
    out: dict[str, torch.Tensor] = {}
    for key, t in full_sd.items():
        s = shard_tensor(t, param_style(plan, key), key.rpartition(".")[2], rank, n) if n > 1 else t
        out[key] = s.contiguous().clone() if s is not t else t
    return out
