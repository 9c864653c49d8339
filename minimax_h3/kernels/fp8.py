"""fp8 facts: the e4m3 dtype and range, the rows an fp8 linear takes with their reference quantiser, and the fp8
attentions' softmax scale. Below the registry (minimax_h3/kernels/registry.py), the fused kernels (fp8_rows.py,
qk_norm_rope.py) and the fp8 attentions (fp8_attention.py, fa3_attention.py), so none of them imports another for
these facts."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_SCALE_FLOOR = 1e-12  # an all-zero row would otherwise divide by zero
# fp8 attention (fp8_attention.py, fa3_attention.py): the scale of the softmax numerator P~ in (0, 1] before its e4m3
# cast, a power of two (exact in fp32), below 448.
SOFTMAX_SCALE = 256.0


class Fp8Rows(NamedTuple):
    """Activation rows already quantised for an fp8 linear (as `quantize_fp8_rowwise` returns them): q [rows, K]
    float8 e4m3, scale [rows, 1] fp32, row i = q[i] * scale[i]. Made by minimax_h3/kernels/fp8_rows.py's fused kernels
    (modulation, SwiGLU, attention output); Fp8RowwiseLinear takes it in place of a tensor."""
    q: torch.Tensor
    scale: torch.Tensor


def quantize_fp8_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], fp32 scale [R, 1]) with scale = absmax(row) / 448 (round to nearest).

    This runs on every activation of every fp8 linear, so it is written for memory traffic: one reduction pass
    (vector_norm(inf) reads the row once, no |t| temporary) and the multiply stays in a 16-bit input's own dtype
    (bf16 x bf16 rounding before the 3-bit-mantissa fp8 rounding is negligible). The clamp matters: e4m3fn has no
    inf, an out-of-range value would become NaN.
    """
    if t.ndim != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(t.shape)}")
    work = t if t.dtype in (torch.bfloat16, torch.float16) else t.float()
    amax = torch.linalg.vector_norm(work, ord=math.inf, dim=1, keepdim=True).float()
    scale = (amax / FP8_E4M3_MAX).clamp(min=FP8_SCALE_FLOOR)
    q = (work * (1.0 / scale).to(work.dtype)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
