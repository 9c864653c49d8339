"""The int8 ConvRot linear for a few rows (Triton, GPU): comfy-kitchen's int8 linear for M <= GEMV_MAX_ROWS, the
same bits from a kernel shaped for a weight stream.

Where it runs: the unpruned AdaLN of every DiT block multiplies M = 2-3 rows (one per distinct timestep) by an int8
weight of 64,512 x 2,688 (173 MB): the step reads 8.7 GB of AdaLN weights for a few hundred KB of output.
comfy-kitchen's Triton GEMM tiles M by 64-128 rows and K by 32-64 bytes (its autotuned configs, made for many
rows); at these shapes it streams the weights at about a third of the memory bandwidth (docs/kernels.md, "Int8
AdaLN for a few rows"). This kernel tiles M by one 16-row MMA block, N by BLOCK_N weight rows per program and K
by BLOCK_K contiguous bytes of each, with `num_stages` tiles in flight, so each weight byte is read once in long runs.

Same bits: the caller (minimax_h3/kernels/int8.py `int8_linear_few_rows`) quantises the activation with
comfy-kitchen's own rotation and per-row int8 quantiser, the int8 products accumulate exactly in int32 (any order
gives the same sum), and the epilogue is comfy-kitchen's kernel's op for op: fp32(acc) * (x_scale[m] * w_scale[n]),
plus the bias (in the output dtype, widened to fp32), stored in the output dtype. It serves only calls that
comfy-kitchen itself runs on its Triton backend; elsewhere (comfy-kitchen's CUDA kernels, the CPU) its op runs.
tests/test_int8_gemv.py checks the kernel against the exact integer product (CPU interpreter) and against
comfy-kitchen's op, bit for bit (GPU).

Launch parameters (BLOCK_N, BLOCK_K, warps, stages) and whether the few-row path uses the kernel at all
(`enabled`) are per-device data: minimax_h3/kernels/tuning.json.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .triton_ops import KernelFallback, interpreting, log_once, tl, triton
from .tuning import launch_params

log = logging.getLogger(__name__)
FALLBACK = KernelFallback("int8 linear for a few rows", log)

GEMV_MAX_ROWS = 16  # one MMA row block; more rows are a GEMM (comfy-kitchen's kernel)
BLOCK_M = 16


def unsupported(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> str | None:
    """Why the kernel does not serve these arguments, or None when it does (shapes, dtypes, strides, devices); x is
    the activation [M, K] (any float dtype) or, for `launch`, its int8 quantisation."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return f"x must be [rows, K] with 1..{GEMV_MAX_ROWS} rows, got {list(x.shape)}"
    k = x.shape[1]
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        return f"weight must be int8 [N, {k}] with contiguous rows, got {weight.dtype} {list(weight.shape)}"
    n = weight.shape[0]
    if weight_scale.numel() != n or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
        return f"weight_scale must be {n} contiguous fp32 values (one per row), got {list(weight_scale.shape)}"
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the output dtype must be fp32/bf16/fp16, got {out_dtype}"
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype or not bias.is_contiguous()):
        return f"bias must be [{n}] contiguous in the output dtype {out_dtype}, got {bias.dtype} {list(bias.shape)}"
    if any(t is not None and t.device != x.device for t in (weight, weight_scale, bias)):
        return "all tensors must be on x's device"
    if triton is None:
        return "triton is not installed"
    if x.device.type != "cuda" and not interpreting(_int8_gemv_kernel):
        return f"the kernel runs on CUDA devices (x is on {x.device})"
    return None


def enabled(device: torch.device) -> bool:
    """Whether the few-row path runs the kernel on `device` (tuning.json `int8_gemv.enabled`: set where
    benchmarks/bench_int8_gemv.py measured it faster than comfy-kitchen's op, bit for bit equal)."""
    return bool(launch_params("int8_gemv", device)["enabled"])


def launch(x_int8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, block_n: int | None = None, block_k: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x_int8 [M, K] int8 (contiguous columns), x_scale [M] / [M, 1] fp32, weight [N, K] int8, weight_scale [N] /
    [N, 1] fp32, bias [N] (out_dtype) or None -> [M, N] out_dtype = fp32(x_int8 @ weight^T) * (x_scale * w_scale)
    (+ bias), new and contiguous. Raises ValueError for arguments it does not serve (`unsupported`); the block
    sizes (powers of two, block_k >= 32), warps and stages tune the launch (None: the device's, tuning.json)."""
    reason = unsupported(x_int8, weight, weight_scale, bias, out_dtype)
    if reason is None and (x_int8.dtype != torch.int8 or x_int8.stride(1) != 1):
        reason = f"x must be int8 with contiguous columns, got {x_int8.dtype} strides {list(x_int8.stride())}"
    if reason is None and (x_scale.numel() != x_int8.shape[0] or x_scale.dtype != torch.float32
                           or not x_scale.is_contiguous()):
        reason = f"x_scale must be {x_int8.shape[0]} contiguous fp32 values, got {x_scale.dtype} {list(x_scale.shape)}"
    if reason is None and x_scale.device != x_int8.device:
        reason = "all tensors must be on x's device"
    if reason is not None:
        raise ValueError(f"the Triton int8 linear for a few rows does not serve this call: {reason}")
    tuned = launch_params("int8_gemv", x_int8.device)  # launch parameters (its "enabled" is the caller's)
    block_n = tuned["block_n"] if block_n is None else block_n
    block_k = tuned["block_k"] if block_k is None else block_k
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    num_stages = tuned["num_stages"] if num_stages is None else num_stages
    for name, v, least in (("block_n", block_n, 16), ("block_k", block_k, 32)):
        if v < least or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
    m, k = x_int8.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_int8.device)
    if n == 0:
        return out
    log_once(log, f"{FALLBACK.what}: Triton kernel ({block_n} x {block_k} weight tiles, {num_warps} warps, "
                  f"{num_stages} stages)")
    with torch.cuda.device(x_int8.device) if x_int8.is_cuda else contextlib.nullcontext():
        _int8_gemv_kernel[(triton.cdiv(n, block_n),)](
            x_int8, weight, out, x_scale, weight_scale, bias if bias is not None else weight_scale, m, n, k,
            x_int8.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
            BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages, num_warps=num_warps)
    return out


if triton is not None:

    @triton.jit
    def _int8_gemv_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, m, n, k, a_s_row, b_s_row, c_s_row,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """One program: output columns [pid * BLOCK_N, +BLOCK_N) of all M (<= BLOCK_M) rows. The weight rows stream
        through once (evict_first), BLOCK_K contiguous bytes of each per step; the few activation rows stay cached."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        row_ok = rows < m
        col_ok = cols < n
        a_at = a_ptr + rows[:, None] * a_s_row + kk[None, :]
        b_at = b_ptr + cols.to(tl.int64)[:, None] * b_s_row + kk[None, :]
        # 1. The int32 sum of int8 products over K, BLOCK_K at a time (exact: the order does not matter).
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in tl.range(0, k, BLOCK_K, num_stages=STAGES):
            k_ok = (k0 + kk) < k
            a = tl.load(a_at + k0, mask=row_ok[:, None] & k_ok[None, :], other=0, eviction_policy="evict_last")
            b = tl.load(b_at + k0, mask=col_ok[:, None] & k_ok[None, :], other=0, eviction_policy="evict_first")
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        # 2. comfy-kitchen's epilogue, op for op: fp32(acc) * (x_scale * w_scale), plus the bias, stored.
        sa = tl.load(sa_ptr + rows, mask=row_ok, other=0.0)
        sb = tl.load(sb_ptr + cols, mask=col_ok, other=0.0)
        c = acc.to(tl.float32) * (sa[:, None] * sb[None, :])
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
        tl.store(c_ptr + rows[:, None] * c_s_row + cols[None, :], c.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
