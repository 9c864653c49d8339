"""The DiT block's plain math, in plain torch: what the model computes (minimax_h3/dit/model.py) and what every fused
kernel reproduces (minimax_h3/kernels/fp8_rows.py, minimax_h3/kernels/qk_norm_rope.py: each kernel's reference is
these functions, followed by its quantisation).

Precision: the norms, the modulation and RoPE run in fp32 and emit their result in the compute dtype; SwiGLU runs in
its input's dtype (facts: docs/model.md §2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minimax_h3.kernels.fp8 import FP8_E4M3_MAX


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in fp32 (weight is a plain gain, not 1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def modulate(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
             r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The AdaLN modulation before the qkv projection and fc1: x [rows, C] fp32, norm gain [C], shift / scale
    [M * 3, C] fp32, r [rows] (int, each row's AdaLN table row) -> rms_norm(x) * (1 + scale[r]) + shift[r] in fp32,
    emitted in `dtype`."""
    return (rms_norm(x, weight, eps) * (1.0 + scale.index_select(0, r)) + shift.index_select(0, r)).to(dtype)


def gated_add(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, r: torch.Tensor) -> None:
    """The block's gated residual add, in place: x [rows, C] fp32 (rows of the residual stream) += gate[r] * part,
    gate [M * 3, C] fp32 (the AdaLN gate rows), part [rows, C] (a projection's output, any float dtype: the product
    is taken in fp32), r [rows] (int, each row's AdaLN table row)."""
    x += gate.index_select(0, r) * part


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: y [rows, 2F] = [gate | value] (fc1's output) -> silu(gate) * value [rows, F] in y's
    dtype."""
    gate, value = y.chunk(2, dim=-1)
    return F.silu(gate) * value


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half (rotate_half) RoPE on the first cos.shape[-1] channels of every head; x [S, heads, d] fp32."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = xr * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    return torch.cat((rotated, xp), dim=-1)


def qk_norm_rope_reference(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                           rope: tuple[torch.Tensor, torch.Tensor] | None, qk_out: torch.Tensor,
                           v_out: torch.Tensor | None, qk_mult: torch.Tensor | None = None) -> None:
    """The step after the qkv projection: y [rows, 3, heads, head_dim] (compute dtype), gains [head_dim], rope
    (cos, sin) [rows, r] fp32 or None -> q, k RMS-normed over head_dim (fp32) and roped, written into
    qk_out [2, 1, heads, rows, head_dim], and v copied into v_out [1, heads, rows, head_dim] or nowhere (v_out None),
    each cast to its buffer's dtype. With qk_mult [2] fp32, qk_out is e4m3 and gets clamp(x * qk_mult[i], +-448)
    (fp8 attention's static q/k scales, minimax_h3/kernels/fp8_attention.py)."""
    q, k, v = y.unbind(1)
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)  # fp32
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    for i, t in enumerate((q, k)):
        if qk_mult is not None:
            t = (t * qk_mult[i]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        qk_out[i, 0].copy_(t.transpose(0, 1))  # [heads, rows, d], cast to the buffer's dtype
    if v_out is not None:
        v_out[0].copy_(v.transpose(0, 1))
