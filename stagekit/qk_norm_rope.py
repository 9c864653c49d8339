"""The DiT attention's q/k RMSNorm + RoPE + layout write as one Triton kernel (GPU), with a plain-torch reference.

What it fuses: after the qkv projection, y [rows, 3, heads, head_dim] (compute dtype) becomes q, k, v in the
attention kernel's layout out [3, 1, heads, rows, head_dim]: q and k are RMS-normalised over head_dim in fp32 with
their gains, then split-half (rotate_half) RoPE turns the first r channels of every head (r = cos.shape[-1]; the
rest pass through), v is copied; all three are cast to out's dtype. Why: inside a compiled block Inductor splits
this into two RMS-statistics reductions running far below the memory bandwidth plus a pointwise pass, the largest of
the fused-kernel costs that docs/performance.md ("Where a step goes", issue 18) lists; one kernel reads y once and
writes out once. docs/performance.md ("Fused q/k RMSNorm + RoPE (Triton)") has how it is measured.

`qk_norm_rope` dispatches: the Triton kernel (the torch custom op `h3stages::qk_norm_rope_`, opaque to
torch.compile) when y is on a CUDA device, triton imports and the shapes are ones it serves; otherwise
`qk_norm_rope_reference`, which is exactly the model's own math (`rms_norm`, `apply_rope` below; dit_svc/model.py
uses them).
The kernel's fp32 arithmetic matches the reference's except for the order of the sum of squares, so a few outputs
in a thousand differ by one unit in the last place of the compute dtype (tests/test_qk_norm_rope.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .triton_kernels import KernelFallback, interpreting, log_once, tl, triton

log = logging.getLogger(__name__)
_FALLBACK = KernelFallback("q/k RMSNorm + RoPE", log)

DEFAULT_BLOCK_ROWS = 32  # rows per program: a [32, 128] tile is 8 KiB of bf16, read in 256-byte rows
DEFAULT_NUM_WARPS = 4
SECTIONS = 3  # q, k, v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Split-half (rotate_half) RoPE on the first cos.shape[-1] channels of every head; x [S, heads, d] fp32."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = xr * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    return torch.cat((rotated, xp), dim=-1)


def qk_norm_rope_reference(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                           rope: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor) -> None:
    """y [rows, 3, heads, head_dim] (compute dtype), gains [head_dim], rope (cos, sin) [rows, r] fp32 or None ->
    written into out [3, 1, heads, rows, head_dim] (out's dtype). The model's own math, in plain torch."""
    q, k, v = y.unbind(1)
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)  # fp32
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    for i, t in enumerate((q, k, v)):
        out[i, 0].copy_(t.transpose(0, 1))  # [heads, rows, d], cast to out's dtype


def unsupported(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor) -> str | None:
    """Why the Triton kernel does not serve these arguments, or None when it does (shapes, dtypes, devices)."""
    if triton is None:
        return "triton is not installed"
    if y.dim() != 4 or y.shape[1] != SECTIONS:
        return f"y must be [rows, 3, heads, head_dim], got {list(y.shape)}"
    rows, _, heads, d = y.shape
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    if tuple(out.shape) != (SECTIONS, 1, heads, rows, d):
        return f"out must be [3, 1, {heads}, {rows}, {d}] for y {list(y.shape)}, got {list(out.shape)}"
    if tuple(q_weight.shape) != (d,) or tuple(k_weight.shape) != (d,):
        return f"the q/k norm gains must be [{d}], got {list(q_weight.shape)} and {list(k_weight.shape)}"
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if y.dtype not in floats or out.dtype not in floats:
        return f"y and out must be fp32/bf16/fp16, got {y.dtype} and {out.dtype}"
    tensors = [y, q_weight, k_weight, out]
    if rope is not None:
        cos, sin = rope
        r = cos.shape[-1]
        if cos.shape != (rows, r) or sin.shape != (rows, r) or r % 2 or not 0 < r <= d:
            return (f"cos and sin must both be [{rows}, r] with r even and <= {d}, got {list(cos.shape)} and "
                    f"{list(sin.shape)}")
        tensors += [cos, sin]
    if any(t.device != y.device for t in tensors):
        return "all tensors must be on y's device"
    if y.device.type != "cuda" and not interpreting(_qk_norm_rope_kernel):
        return f"the kernel runs on CUDA devices (y is on {y.device})"
    return None


def qk_norm_rope(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor) -> None:
    """y [rows, 3, heads, head_dim] (compute dtype), q/k gains [head_dim], rope (cos, sin) [rows, r] fp32 or None
    -> written into out [3, 1, heads, rows, head_dim]: the Triton kernel on CUDA where it serves the shapes, else
    the reference (see the module docstring)."""
    reason = unsupported(y, q_weight, k_weight, rope, out) if y.is_cuda else "y is not on a CUDA device"
    if reason is None:
        reason = _FALLBACK.reason(y.device)
    if reason is None:
        cos, sin = rope if rope is not None else (None, None)
        ok, result = _FALLBACK.run(y.device, lambda: torch.ops.h3stages.qk_norm_rope_(y, q_weight, k_weight, eps,
                                                                                       cos, sin, out))
        if ok:
            return
        reason = result
    if y.is_cuda and not torch.compiler.is_compiling():
        log_once(log, f"q/k RMSNorm + RoPE: plain torch ({reason})")
    qk_norm_rope_reference(y, q_weight, k_weight, eps, rope, out)


@torch.library.custom_op("h3stages::qk_norm_rope_", mutates_args=("out",))
def qk_norm_rope_op(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, out: torch.Tensor,
                    block_rows: int = DEFAULT_BLOCK_ROWS, num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """The Triton kernel as a torch op that writes `out` (opaque to torch.compile); arguments as `launch`."""
    launch(y, q_weight, k_weight, eps, cos, sin, out, block_rows, num_warps)


def launch(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor | None,
           sin: torch.Tensor | None, out: torch.Tensor, block_rows: int = DEFAULT_BLOCK_ROWS,
           num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Runs the kernel: y [rows, 3, heads, D] (any strides), gains [D], cos/sin [rows, r] fp32 or both None,
    out [3, 1, heads, rows, D] (any strides, e.g. a row slice of a bigger buffer). Raises ValueError for arguments
    it does not serve (`unsupported`). block_rows (a power of two) and num_warps tune the launch."""
    rope = (cos, sin) if cos is not None else None
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    reason = unsupported(y, q_weight, k_weight, rope, out)
    if reason is not None:
        raise ValueError(f"the Triton q/k RMSNorm + RoPE kernel does not serve this call: {reason}")
    rows, _, heads, d = y.shape
    if rows == 0 or heads == 0:
        return
    log_once(log, f"q/k RMSNorm + RoPE: Triton kernel ({block_rows} rows x {num_warps} warps per program)")
    if cos is not None:
        r, cos_t, sin_t, rope_strides = cos.shape[-1], cos, sin, (*cos.stride(), *sin.stride())
    else:  # HAS_ROPE=False compiles the table loads out; the pointer arguments still need a tensor
        r, cos_t, sin_t, rope_strides = 0, q_weight, q_weight, (0, 0, 0, 0)
    grid = (triton.cdiv(rows, block_rows) * SECTIONS * heads,)
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # Triton uses the current device
        _qk_norm_rope_kernel[grid](
            y, q_weight, k_weight, cos_t, sin_t, out, rows, heads, eps,
            *y.stride(), out.stride(0), out.stride(2), out.stride(3), out.stride(4), *rope_strides,
            D=d, R=r, HAS_ROPE=cos is not None, BLOCK_R=block_rows, num_warps=num_warps,
            enable_fp_fusion=False,  # no FMA contraction: products rounded as the reference's separate ops are
        )




if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, rows, heads, eps,
                             y_s_row, y_s_sec, y_s_head, y_s_d, o_s_sec, o_s_head, o_s_row, o_s_d,
                             c_s_row, c_s_d, s_s_row, s_s_d,
                             D: tl.constexpr, R: tl.constexpr, HAS_ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
        """One program: BLOCK_R rows of one head of one section (0 q, 1 k, 2 v). Consecutive programs take the
        sections and heads of the same rows in y's order, so the programs in flight read one band of y."""
        pid = tl.program_id(0)
        band = pid // (3 * heads)
        sec = (pid // heads) % 3
        head = (pid % heads).to(tl.int64)
        row = band * BLOCK_R + tl.arange(0, BLOCK_R)
        ch = tl.arange(0, D)
        mask = (row < rows)[:, None]
        row = row.to(tl.int64)[:, None]  # int64 offsets: out spans 3 * heads * S * D elements
        y_row = y_ptr + sec.to(tl.int64) * y_s_sec + head * y_s_head + row * y_s_row
        x = tl.load(y_row + ch[None, :] * y_s_d, mask=mask, other=0.0).to(tl.float32)
        if sec == 2:
            res = x  # v: layout and cast only
        else:
            # RMSNorm in fp32 over head_dim: x * rsqrt(mean(x^2) + eps) * gain (`rms_norm` above).
            gain = tl.where(sec == 0, tl.load(qw_ptr + ch).to(tl.float32), tl.load(kw_ptr + ch).to(tl.float32))
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            res = x * rstd * gain[None, :]
            if HAS_ROPE:
                # rotate_half on channels [0, R): out_j = n_j cos_j + n_p sin_j * (-1 if j < R/2 else 1), with the
                # partner p = j +- R/2 normalised by the same row's rstd; channels >= R pass through.
                half = R // 2
                in_rope = ch < R
                partner = tl.where(ch < half, ch + half, tl.where(in_rope, ch - half, ch))
                xp = tl.load(y_row + partner[None, :] * y_s_d, mask=mask, other=0.0).to(tl.float32)
                gain_p = tl.where(sec == 0, tl.load(qw_ptr + partner).to(tl.float32),
                                  tl.load(kw_ptr + partner).to(tl.float32))
                np_ = xp * rstd * gain_p[None, :]
                rot = tl.where((ch < half)[None, :], -np_, np_)
                cmask = mask & in_rope[None, :]
                c = tl.load(cos_ptr + row * c_s_row + ch[None, :] * c_s_d, mask=cmask, other=0.0)
                s = tl.load(sin_ptr + row * s_s_row + ch[None, :] * s_s_d, mask=cmask, other=0.0)
                res = tl.where(in_rope[None, :], res * c + rot * s, res)
        out = out_ptr + sec.to(tl.int64) * o_s_sec + head * o_s_head + row * o_s_row + ch[None, :] * o_s_d
        tl.store(out, res.to(out_ptr.dtype.element_ty), mask=mask)
