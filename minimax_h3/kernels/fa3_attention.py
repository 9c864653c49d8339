"""FlashAttention-3 (Hopper) through the optional `fa3-fwd` package: bf16 and fp8 attention candidates.

`fa3-fwd` 0.0.3 (PyPI) ships FlashAttention-3's forward kernels alone, bf16 and fp8 e4m3 (no fp16), built for
sm_90, as `fa3_fwd_interface.flash_attn_func(q, k, v, softmax_scale=None, causal=False, q_descale=None,
k_descale=None, v_descale=None, ...)` on [batch, rows, heads, head_dim] tensors with a unit stride on head_dim (any
row and head strides). With e4m3 inputs it takes fp32 descales of shape [batch, heads] and writes O in bf16.

- bf16 (`fa3_attention`): the model's q, k, v [1, H, S, D] go in as their [1, S, H, D] views (no copy); O comes
  back as the [1, H, S, D] view of the kernel's [1, S, H, D] output, whose rows are then contiguous for out_proj.
- fp8: minimax_h3/kernels/fp8_attention.py's `Fp8Attention(kernel="fa3")` quantises q, k, v exactly as for cuDNN's
  fp8 SDPA (static q/k scales from the q/k norm kernel in the blocks, per-head V scales and V smoothing; docs/kernels.md,
  "8-bit attention") and calls `fa3_fp8` here. FA3 takes a descale per head, so V's per-head scale is its descale and
  O needs no rescaling; O comes in bf16, and V's mean is added back to it.

Never needed elsewhere: without the package, off Hopper, or when the kernel loses the start-up probe or fails its
error bound, the registry chooses among the other candidates (minimax_h3/kernels/registry.py).
"""

from __future__ import annotations

import math

import torch

from .fp8 import E4M3, SOFTMAX_SCALE

PACKAGE = "fa3-fwd"
PINNED = "fa3-fwd==0.0.3"
CAPABILITY = (9, 0)  # the wheel's kernels are built for Hopper


def _interface():
    import fa3_fwd_interface

    return fa3_fwd_interface


def unavailable(device: torch.device | str) -> str | None:
    """None if FA3 can run on `device`, else why not. Never raises (the registry's probe asks every candidate)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashAttention-3 needs a CUDA GPU (device is {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap != CAPABILITY:
        return f"FlashAttention-3 ({PACKAGE}) runs on Hopper (sm_90); this GPU is sm_{cap[0]}{cap[1]}"
    try:
        _interface()
    except Exception as e:  # ImportError, or an extension built against another torch (OSError / RuntimeError)
        return f"{PACKAGE} is not importable ({type(e).__name__}: {e}); pip install {PINNED}"
    return None


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] (or [H, S, D]) -> its [1, S, H, D] view."""
    return (x if x.dim() == 4 else x.unsqueeze(0)).transpose(1, 2)


class Fa3Attention:
    """AttentionFn (minimax_h3/dit/model.py): (q, k, v) [1, H, S, D] bf16 -> o [1, H, S, D] bf16, non-causal,
    1/sqrt(D); FA3's bf16 kernel."""

    __name__ = "fa3_attention"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.dtype != torch.bfloat16:
            raise RuntimeError(f"{PACKAGE} ships bf16 and fp8 kernels only; the compute dtype here is {q.dtype} "
                               "(use another attention kernel, or bf16 compute)")
        o = _interface().flash_attn_func(_bshd(q), _bshd(k), _bshd(v), softmax_scale=1.0 / math.sqrt(q.shape[-1]))
        return o.transpose(1, 2)


def _head_descale(descale: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-tensor ([1]) or per-head ([H, ...]) descale as FA3's [1, H] fp32."""
    d = descale.float().reshape(-1)
    return (d.expand(heads) if d.numel() == 1 else d).reshape(1, heads).contiguous()


def fa3_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor, descale_k: torch.Tensor,
            descale_v: torch.Tensor) -> torch.Tensor:
    """[H, S, D] e4m3 q8 / k8 / v8 (any layout with a unit stride on D), descales [1] or [H] fp32 (value = descale
    x e4m3) -> O [H, S, D] bf16 (a view of FA3's [1, S, H, D] output) = softmax(q k^T / sqrt(D)) v."""
    h, _, d = q8.shape
    o = _interface().flash_attn_func(_bshd(q8), _bshd(k8), _bshd(v8), softmax_scale=1.0 / math.sqrt(d),
                                     q_descale=_head_descale(descale_q, h), k_descale=_head_descale(descale_k, h),
                                     v_descale=_head_descale(descale_v, h))
    return o[0].transpose(0, 1)


def fa3_fp8_emulated(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                     descale_k: torch.Tensor, descale_v: torch.Tensor) -> torch.Tensor:
    """fp32 emulation of `fa3_fp8` (any device; tests and small shapes: it holds the [H, S, S] scores): the softmax
    numerator exp(s - rowmax) rounded to e4m3 after scaling by 256 (FA3's fp8 max offset of 8 in log2), normalised
    by its fp32 row sum, O rounded to bf16."""
    h, _, d = q8.shape

    def per_head(x: torch.Tensor) -> torch.Tensor:
        return _head_descale(x, h).reshape(h, 1, 1)

    q = q8.float() * per_head(descale_q)
    k = k8.float() * per_head(descale_k)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * SOFTMAX_SCALE).to(E4M3).float() * (1.0 / SOFTMAX_SCALE)
    o = (p8 @ (v8.float() * per_head(descale_v))) / p.sum(-1, keepdim=True)
    return o.to(torch.bfloat16)
