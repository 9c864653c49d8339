"""The DiT attention's q/k RMSNorm + RoPE + layout write as one Triton kernel (GPU), with a plain-torch reference.

What it fuses: after the qkv projection, y [rows, 3, heads, head_dim] (compute dtype) becomes q, k, v in the
attention kernel's layout ([heads, rows, head_dim] each): q and k are RMS-normalised over head_dim in fp32 with
their gains, then split-half (rotate_half) RoPE turns the first r channels of every head (r = cos.shape[-1]; the
rest pass through), v is copied. q and k go to qk_out [2, 1, heads, rows, head_dim], v to v_out [1, heads, rows,
head_dim] (v_out None: v is not copied, its reader takes it from y), each cast to its buffer's dtype; with `qk_mult` (fp8 attention, minimax_h3/kernels/fp8_attention.py "static q/k
scales") qk_out is float8 e4m3 and holds clamp(x * qk_mult[i], +-448) for q (i = 0) and k (i = 1), so the
attention's own quantisation pass no longer reads q and k. Why: inside a compiled block Inductor splits
this into two RMS-statistics reductions running far below the memory bandwidth plus a pointwise pass, the largest of
the fused-kernel costs that docs/performance.md ("Where a step goes") lists; one kernel reads y once and
writes out once. docs/kernels.md ("Fused q/k RMSNorm + RoPE (Triton)") has how it is measured.

`qk_norm_rope` dispatches: the Triton kernel (the torch custom op `h3stages::qk_norm_rope_`, opaque to
torch.compile) when y is on a CUDA device, triton imports and the shapes are ones it serves; otherwise
`qk_norm_rope_reference`, which is the model's own math in plain torch (minimax_h3/dit/ops.py: `rms_norm`,
`apply_rope`).
The kernel's fp32 arithmetic matches the reference's except for the order of the sum of squares, so a few outputs
in a thousand differ by one unit in the last place of the compute dtype (tests/test_qk_norm_rope.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from minimax_h3.dit.ops import qk_norm_rope_reference

from .fp8 import FP8_E4M3_MAX
from .triton_ops import KernelFallback, interpreting, log_once, tl, triton
from .tuning import launch_params

log = logging.getLogger(__name__)
_FALLBACK = KernelFallback("q/k RMSNorm + RoPE", log)

SECTIONS = 3  # q, k, v
E4M3 = torch.float8_e4m3fn


def unsupported(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None, qk_out: torch.Tensor, v_out: torch.Tensor | None,
                qk_mult: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel does not serve these arguments, or None when it does (shapes, dtypes, devices)."""
    if triton is None:
        return "triton is not installed"
    if y.dim() != 4 or y.shape[1] != SECTIONS:
        return f"y must be [rows, 3, heads, head_dim], got {list(y.shape)}"
    rows, _, heads, d = y.shape
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    v_shape = None if v_out is None else tuple(v_out.shape)
    if tuple(qk_out.shape) != (2, 1, heads, rows, d) or v_shape not in (None, (1, heads, rows, d)):
        return (f"qk_out must be [2, 1, {heads}, {rows}, {d}] and v_out [1, {heads}, {rows}, {d}] (or None) for y "
                f"{list(y.shape)}, got {list(qk_out.shape)} and {v_shape}")
    if tuple(q_weight.shape) != (d,) or tuple(k_weight.shape) != (d,):
        return f"the q/k norm gains must be [{d}], got {list(q_weight.shape)} and {list(k_weight.shape)}"
    floats = (torch.float32, torch.bfloat16, torch.float16)
    qk_dtypes = (E4M3,) if qk_mult is not None else floats
    v_dtype = y.dtype if v_out is None else v_out.dtype
    if y.dtype not in floats or qk_out.dtype not in qk_dtypes or v_dtype not in floats:
        want = "e4m3 (qk_mult given)" if qk_mult is not None else "fp32/bf16/fp16"
        return (f"y and v_out must be fp32/bf16/fp16 and qk_out {want}, got {y.dtype}, {v_dtype} and "
                f"{qk_out.dtype}")
    tensors = [y, q_weight, k_weight, qk_out] + ([v_out] if v_out is not None else [])
    if qk_mult is not None:
        if tuple(qk_mult.shape) != (2,) or qk_mult.dtype != torch.float32:
            return f"qk_mult must be fp32 [2], got {qk_mult.dtype} {list(qk_mult.shape)}"
        tensors.append(qk_mult)
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
                 rope: tuple[torch.Tensor, torch.Tensor] | None, qk_out: torch.Tensor, v_out: torch.Tensor | None,
                 qk_mult: torch.Tensor | None = None) -> None:
    """y [rows, 3, heads, head_dim] (compute dtype), q/k gains [head_dim], rope (cos, sin) [rows, r] fp32 or None
    -> q, k into qk_out [2, 1, heads, rows, head_dim] (e4m3 scaled by qk_mult [2] when given), v into v_out
    [1, heads, rows, head_dim] (or not at all: None): the Triton kernel on CUDA where it serves the shapes, else the reference (see the
    module docstring)."""
    cos, sin = rope if rope is not None else (None, None)

    def reference() -> None:
        if qk_mult is not None and torch.compiler.is_compiling():
            torch.ops.h3stages.qk_norm_rope_reference_(y, q_weight, k_weight, eps, cos, sin, qk_out, v_out, qk_mult)
        else:
            qk_norm_rope_reference(y, q_weight, k_weight, eps, rope, qk_out, v_out, qk_mult)

    _FALLBACK.dispatch(
        y.device,
        unsupported(y, q_weight, k_weight, rope, qk_out, v_out, qk_mult) if y.is_cuda else "y is not on a CUDA device",
        lambda: torch.ops.h3stages.qk_norm_rope_(y, q_weight, k_weight, eps, cos, sin, qk_out, v_out, qk_mult),
        reference)


@torch.library.custom_op("h3stages::qk_norm_rope_reference_", mutates_args=("qk_out", "v_out"))
def _reference_op(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor | None, sin: torch.Tensor | None, qk_out: torch.Tensor,
                  v_out: torch.Tensor | None, qk_mult: torch.Tensor | None) -> None:
    """The reference as one op, opaque to torch.compile: what a compiled block calls for e4m3 q/k without the
    kernel. Inductor (torch 2.11-2.13) cannot compile a write into a row slice of a float8 tensor (it fails to
    promote the slice's mask with float8), which is what the reference's e4m3 write is in a row chunk."""
    qk_norm_rope_reference(y, q_weight, k_weight, eps, (cos, sin) if cos is not None else None, qk_out, v_out,
                           qk_mult)


@torch.library.custom_op("h3stages::qk_norm_rope_", mutates_args=("qk_out", "v_out"))
def qk_norm_rope_op(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, qk_out: torch.Tensor,
                    v_out: torch.Tensor | None, qk_mult: torch.Tensor | None = None,
                    block_rows: int | None = None, num_warps: int | None = None,
                    heads_per_program: int | None = None, num_stages: int | None = None) -> None:
    """The Triton kernel as a torch op that writes `qk_out` and `v_out` (opaque to torch.compile); arguments as
    `launch`."""
    launch(y, q_weight, k_weight, eps, cos, sin, qk_out, v_out, qk_mult, block_rows, num_warps, heads_per_program,
           num_stages)


def launch(y: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor | None,
           sin: torch.Tensor | None, qk_out: torch.Tensor, v_out: torch.Tensor | None,
           qk_mult: torch.Tensor | None = None, block_rows: int | None = None, num_warps: int | None = None,
           heads_per_program: int | None = None, num_stages: int | None = None) -> None:
    """Runs the kernel: y [rows, 3, heads, D] (any strides), gains [D], cos/sin [rows, r] fp32 or both None,
    qk_out [2, 1, heads, rows, D] and v_out [1, heads, rows, D] or None (any strides, e.g. row slices of bigger
    buffers),
    qk_mult [2] fp32 with an e4m3 qk_out, or None. Raises ValueError for arguments it does not serve
    (`unsupported`). block_rows (rows per program, a power of two), num_warps, heads_per_program (the (section,
    head) pairs one program takes, loading its rows' RoPE table once for all) and num_stages (loads of the next
    pair in flight) tune the launch (None: the device's, minimax_h3/kernels/tuning.json)."""
    tuned = launch_params("qk_norm_rope", y.device)
    block_rows = tuned["block_rows"] if block_rows is None else block_rows
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    heads_per_program = tuned["heads_per_program"] if heads_per_program is None else heads_per_program
    num_stages = tuned["num_stages"] if num_stages is None else num_stages
    rope = (cos, sin) if cos is not None else None
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if heads_per_program < 1 or num_stages < 1:
        raise ValueError(f"heads_per_program and num_stages must be >= 1, got {heads_per_program} and {num_stages}")
    reason = unsupported(y, q_weight, k_weight, rope, qk_out, v_out, qk_mult)
    if reason is not None:
        raise ValueError(f"the Triton q/k RMSNorm + RoPE kernel does not serve this call: {reason}")
    rows, _, heads, d = y.shape
    if rows == 0 or heads == 0:
        return
    log_once(log, f"q/k RMSNorm + RoPE: Triton kernel ({block_rows} rows x {heads_per_program} heads x {num_warps} "
                  f"warps per program{', e4m3 q/k' if qk_mult is not None else ''})")
    if cos is not None:
        r, cos_t, sin_t, rope_strides = cos.shape[-1], cos, sin, (*cos.stride(), *sin.stride())
    else:  # HAS_ROPE=False compiles the table loads out; the pointer arguments still need a tensor
        r, cos_t, sin_t, rope_strides = 0, q_weight, q_weight, (0, 0, 0, 0)
    mult = qk_mult if qk_mult is not None else q_weight  # QK_FP8=False compiles its loads out
    sections = SECTIONS if v_out is not None else 2  # no v programs without v_out
    v_t, v_strides = (v_out, v_out.stride()[1:]) if v_out is not None else (qk_out, (0, 0, 0))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(sections * heads, heads_per_program))
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # Triton uses the current device
        _qk_norm_rope_kernel[grid](
            y, q_weight, k_weight, cos_t, sin_t, qk_out, v_t, mult, rows, heads, eps,
            *y.stride(), qk_out.stride(0), qk_out.stride(2), qk_out.stride(3), qk_out.stride(4),
            *v_strides, *rope_strides,
            D=d, R=r, HAS_ROPE=cos is not None, QK_FP8=qk_mult is not None, FP8_MAX=FP8_E4M3_MAX, NSEC=sections,
            BLOCK_R=block_rows, HEADS_PER_PROGRAM=heads_per_program, STAGES=num_stages, num_warps=num_warps,
            enable_fp_fusion=False,  # no FMA contraction: products rounded as the reference's separate ops are
        )


if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qk_ptr, v_ptr, mult_ptr, rows, heads, eps,
                             y_s_row, y_s_sec, y_s_head, y_s_d, o_s_sec, o_s_head, o_s_row, o_s_d,
                             v_s_head, v_s_row, v_s_d, c_s_row, c_s_d, s_s_row, s_s_d,
                             D: tl.constexpr, R: tl.constexpr, HAS_ROPE: tl.constexpr, QK_FP8: tl.constexpr,
                             FP8_MAX: tl.constexpr, NSEC: tl.constexpr, BLOCK_R: tl.constexpr,
                             HEADS_PER_PROGRAM: tl.constexpr, STAGES: tl.constexpr):
        """One program: BLOCK_R rows of HEADS_PER_PROGRAM consecutive (section, head) pairs, the sections in order
        (0 q, 1 k, 2 v; NSEC = 2: no v) and the heads in order within each. The rows' RoPE table (cos / sin) is
        loaded once for all of them; the loop over the pairs prefetches the next pair's rows (STAGES)."""
        band = tl.program_id(0)
        first = tl.program_id(1) * HEADS_PER_PROGRAM
        row = band * BLOCK_R + tl.arange(0, BLOCK_R)
        ch = tl.arange(0, D)
        mask = (row < rows)[:, None]
        row = row.to(tl.int64)[:, None]  # int64 offsets: out spans 3 * heads * S * D elements
        if HAS_ROPE:
            # rotate_half on channels [0, R): out_j = n_j cos_j + n_p sin_j * (-1 if j < R/2 else 1), with the
            # partner p = j +- R/2 normalised by the same row's rstd; channels >= R pass through.
            half = R // 2
            in_rope = ch < R
            partner = tl.where(ch < half, ch + half, tl.where(in_rope, ch - half, ch))
            cmask = mask & in_rope[None, :]
            c = tl.load(cos_ptr + row * c_s_row + ch[None, :] * c_s_d, mask=cmask, other=0.0)
            s = tl.load(sin_ptr + row * s_s_row + ch[None, :] * s_s_d, mask=cmask, other=0.0)
        last = tl.minimum(first + HEADS_PER_PROGRAM, NSEC * heads)
        for pair in tl.range(first, tl.minimum(last, 2 * heads), num_stages=STAGES):  # q and k
            sec = pair // heads
            head = (pair % heads).to(tl.int64)
            y_row = y_ptr + sec.to(tl.int64) * y_s_sec + head * y_s_head + row * y_s_row
            x = tl.load(y_row + ch[None, :] * y_s_d, mask=mask, other=0.0).to(tl.float32)
            # RMSNorm in fp32 over head_dim: x * rsqrt(mean(x^2) + eps) * gain (minimax_h3/dit/ops.py `rms_norm`).
            gain = tl.where(sec == 0, tl.load(qw_ptr + ch).to(tl.float32), tl.load(kw_ptr + ch).to(tl.float32))
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            res = x * rstd * gain[None, :]
            if HAS_ROPE:
                xp = tl.load(y_row + partner[None, :] * y_s_d, mask=mask, other=0.0).to(tl.float32)
                gain_p = tl.where(sec == 0, tl.load(qw_ptr + partner).to(tl.float32),
                                  tl.load(kw_ptr + partner).to(tl.float32))
                np_ = xp * rstd * gain_p[None, :]
                rot = tl.where((ch < half)[None, :], -np_, np_)
                res = tl.where(in_rope[None, :], res * c + rot * s, res)
            if QK_FP8:  # the static e4m3 scale of q or k (`qk_mult`), then e4m3's range
                res = tl.minimum(tl.maximum(res * tl.load(mult_ptr + sec), -FP8_MAX), FP8_MAX)
            out = qk_ptr + sec.to(tl.int64) * o_s_sec + head * o_s_head + row * o_s_row + ch[None, :] * o_s_d
            tl.store(out, res.to(qk_ptr.dtype.element_ty), mask=mask)
        if NSEC == 3:  # v: layout and cast only
            for pair in tl.range(tl.maximum(first, 2 * heads), last, num_stages=STAGES):
                head = (pair - 2 * heads).to(tl.int64)
                x = tl.load(y_ptr + 2 * y_s_sec + head * y_s_head + row * y_s_row + ch[None, :] * y_s_d, mask=mask,
                            other=0.0)
                tl.store(v_ptr + head * v_s_head + row * v_s_row + ch[None, :] * v_s_d, x.to(v_ptr.dtype.element_ty),
                         mask=mask)
