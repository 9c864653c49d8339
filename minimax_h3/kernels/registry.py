"""Kernel registry per GPU architecture, with a short measured start-up probe.

Two ops are dispatched here: the block *linears* (weights come from the int8 ConvRot checkpoint, or a dense one)
and *attention* (q, k, v [B, heads, S, head_dim] in the compute dtype).

Candidates (name -> what runs):
  linear     fp32 / bf16 / fp16  dense cuBLAS (F.linear) on the dequantised weight
             int8                comfy-kitchen int8 ConvRot GEMM (minimax_h3.kernels.int8.Int8ConvRotLinear, mode="kernel")
             fp8                 float8 e4m3 row-wise scaled matmul (torch._scaled_mm, sm_89+): weight quantised per
                                 output row from the dequantised int8, activations per row (Fp8RowwiseLinear below)
  attention  cudnn / flash / efficient / math   torch SDPA pinned to one backend
             int8                comfy-kitchen int8 (SageAttention-style) kernel, when its API and CUDA ext exist
             fp8                 cuDNN fp8 SDPA via nvidia-cudnn-frontend (optional package, sm_90+), with fused
                                 q/k/v quantisation, K/V smoothing and per-head V scales (minimax_h3/kernels/fp8_attention.py)
             fa3                 FlashAttention-3 bf16 via fa3-fwd (optional package, Hopper)
             fa3_fp8             FlashAttention-3 fp8 via fa3-fwd, on the fp8 candidate's quantised q, k, v
                                 (minimax_h3/kernels/fa3_attention.py)
  vsa        fastvideo           VSA block-sparse attention by fastvideo-kernel (optional package, CUDA, bf16), for
                                 jobs that ask for VSA (minimax_h3/kernels/vsa.py); else the exact PyTorch reference

Which candidates are *considered* depends on the device's architecture (ARCH table below: e.g. no fp8 before
sm_89, no bf16 GEMMs on Turing, only the dense / math fallbacks on CPU). `select_kernels` then runs every considered
candidate once on representative shapes, rejects any whose relative error against an fp32 reference exceeds its
bound (or that raises / returns non-finite values), times the survivors in rounds that call each once, each as the
blocks call it (an attention fn's `block_call` where it has one; `interleaved_ms`: docs/kernels.md, "How the probe
times") and picks the fastest per op. A config override
(`linear_kernel="fp8"`, `attention_kernel="cudnn"`, ...) skips the race but still checks availability and parity,
so a forced kernel that is broken on this machine fails at start-up, not mid-request.

The VSA kernel is not raced: `select_vsa_kernel` takes fastvideo-kernel where it is importable and matches the
exact reference on a small problem, else the reference, with the reason (a row of its own in Status).

The result (`KernelSelection`) carries (op, kernel, reason) rows for the Status RPC, a factory for linear modules
and the attention callable to hand to the model (`H3DiT(attention_fn=...)` / `H3DiT.set_attention_fn`). How each
linear and the attention then compute inside a block (and what they fuse) is their method's:
minimax_h3/kernels/layers.py.

`select_kernels_remembered` keeps a probe's outcome per machine (a JSON file under the stage's cache directory),
keyed by everything the outcome depends on: the GPU (name, memory, compute capability), torch, CUDA, cuDNN and the
kernel packages' versions, the config, the candidates, their bounds and the source of every module of this package
(with its tuning table). A stage that starts again on the same machine reads the choice instead of measuring it
again; anything in the key that changes makes it measure afresh, and so does a record that is not what this
registry's probe writes (read at most PROBE_RECORD_MAX_BYTES, from a regular file only; its kernels the
registry's, and the ones its own results make the probe pick).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import stat
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stagekit.errors import FailedPrecondition, Internal
from .fp8 import Fp8Rows, quantize_fp8_rowwise
from .int8 import DEFAULT_CONVROT_GROUPSIZE, Int8ConvRotLinear, QuantizedWeight, is_power_of_4, quantize_convrot
from .layers import fp8_rows_method
from .tuning import GPU_ARCHS, arch_key, fp8_fast_accum

log = logging.getLogger(__name__)

AUTO = "auto"
LINEAR_OP = "linear"
ATTENTION_OP = "attention"
VSA_OP = "vsa"

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper / Blackwell have fp8 tensor cores
FP8_ALIGN = 16  # torch._scaled_mm needs K and N multiples of 16
PROBE_ERROR_CHARS = 500  # of a rejected candidate's error kept for Status (cuDNN's reasons come at the end)

# Relative error bounds ||y - ref|| / ||ref|| vs an fp32 reference on the *same* (dequantised) weights.
# bf16 operands land at 2-4e-3; 8-bit activations (int8 per token after ConvRot, fp8 e4m3 per row) at 1-3e-2
# (docs/model.md §8.2); the bounds leave ~3x headroom, a broken kernel is far above them.
REL_ERR_BOUND = {
    "fp32": 1e-3,  # allows tf32 if a user enabled it
    "bf16": 1.5e-2,
    "fp16": 1e-2,
    "int8": 6e-2,
    "fp8": 8e-2,
    "cudnn": 1.5e-2,
    "flash": 1.5e-2,
    "efficient": 1.5e-2,
    "math": 1.5e-2,
    "fa3": 1.5e-2,  # bf16 attention, as the SDPA backends
    "int8_attention": 6e-2,  # upstream's own test threshold is NRMSE < 0.03 vs SDPA
    # e4m3 q, k, v, softmax numerator and O (Hopper's fp8 SDPA writes fp8 O): 6-8e-2 on the probe's random
    # Gaussian data (flat softmax, small-norm outputs: the worst case, docs/kernels.md "8-bit attention");
    # a broken kernel lands near 1. Whether that error is acceptable for the model is the velocity error that
    # benchmarks/bench_attention.py reports, not this bound.
    "fp8_attention": 0.15,
    "vsa": 1.5e-2,  # bf16 block-sparse attention against the reference on the same tiles and routing
}


class KernelError(FailedPrecondition):
    """A kernel setting that cannot be honoured on this machine (unknown name, unavailable, fails parity)."""


class Fp8Unavailable(KernelError):
    """fp8 row-wise matmul was asked for on a device without fp8 tensor cores (a kernel setting this machine cannot
    honour)."""


# =====================================================================================================================
# fp8 row-wise linear
# =====================================================================================================================


def fp8_rowwise_reference(x: torch.Tensor | Fp8Rows, weight_fp8: torch.Tensor,
                          weight_scale: torch.Tensor) -> torch.Tensor:
    """Exact math of the fp8 row-wise GEMM, emulated in fp32 (any device): (q_x s_x) @ (q_w s_w)^T; x is quantised
    here unless it comes as Fp8Rows."""
    xq, xs = x if isinstance(x, Fp8Rows) else quantize_fp8_rowwise(x)
    return (xq.float() * xs) @ (weight_fp8.float() * weight_scale.float()).T


def fp8_supported(device: torch.device | str) -> str | None:
    """None if torch._scaled_mm row-wise fp8 can run on `device`, else the reason it cannot."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8 row-wise matmul needs a CUDA GPU (device is {device.type})"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm / float8_e4m3fn"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return f"fp8 tensor cores need compute capability >= 8.9, this GPU is sm_{cap[0]}{cap[1]}"
    return None


class Fp8RowwiseLinear(nn.Module):
    """y = x W^T (+ b) with W stored float8 e4m3 + fp32 per-output-row scale; activations quantised per row.

    Build from a dense weight (`from_dense`) or an int8 ConvRot checkpoint weight (`from_quantized`: dequantised,
    un-rotated, then re-quantised per row -- the int8 rounding is kept, fp8 rounding is added on top).
    On CUDA sm_89+ the GEMM is torch._scaled_mm (bf16/fp16 out). Elsewhere it raises Fp8Unavailable, unless
    `emulate=True`, which runs the same quantisation math in fp32 (slow; for tests and CPU parity checks).
    The input is a tensor [..., in] (quantised here) or Fp8Rows [rows, in] quantised upstream: its method
    (minimax_h3/kernels/layers.py Fp8RowsMethod) hands it rows quantised by a fused neighbour.
    `arch` (default: `device`'s) is the GPU architecture whose tuned values apply (minimax_h3/kernels/tuning.json):
    fast accumulation unless `fast_accum` says otherwise, and which fused kernels the method runs in compiled blocks.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 out_dtype: torch.dtype = torch.bfloat16, emulate: bool = False, device=None,
                 fast_accum: bool | None = None, arch: str | None = None) -> None:
        super().__init__()
        if in_features % FP8_ALIGN or out_features % FP8_ALIGN:
            raise ValueError(f"fp8 row-wise matmul needs in/out features divisible by {FP8_ALIGN}, "
                             f"got {in_features}/{out_features}; use a dense kernel for this layer")
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")

        arch = arch_key(device or "cpu") if arch is None else arch
        self.linear_method = fp8_rows_method(arch)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = out_dtype
        self.emulate = emulate
        self.fast_accum = fp8_fast_accum(arch) if fast_accum is None else fast_accum
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_dense(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> "Fp8RowwiseLinear":
        """From a dense weight [out, in], tuned for the architecture of w's device unless `arch` says otherwise."""
        n_out, n_in = w.shape
        kw.setdefault("arch", arch_key(w.device))
        layer = cls(n_in, n_out, bias=bias is not None, device="meta", **kw)
        q, s = quantize_fp8_rowwise(w)
        layer.weight, layer.weight_scale = q, s  # registered buffers: plain assignment replaces them
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        return layer

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None, **kw) -> "Fp8RowwiseLinear":
        return cls.from_dense(qw.dequantize(torch.float32), bias, **kw)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x [..., in] (compute dtype) or Fp8Rows (q [rows, in] e4m3, scale [rows, 1]) -> [..., out] out_dtype."""
        if isinstance(x, Fp8Rows):
            if x.q.ndim != 2 or x.q.shape[1] != self.in_features or tuple(x.scale.shape) != (x.q.shape[0], 1):
                raise ValueError(f"Fp8Rows must be q [rows, {self.in_features}] and scale [rows, 1], got "
                                 f"{list(x.q.shape)} and {list(x.scale.shape)}")
            lead, x2 = x.q.shape[:-1], x
            device = x.q.device
        else:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features)
            device = x2.device
        if device.type == "cuda" and not self.emulate:
            if not torch.compiler.is_compiling():  # a device query would only break a compiled graph
                reason = fp8_supported(device)
                if reason:
                    raise Fp8Unavailable(f"{reason}; use linear_kernel='bf16' or 'int8' on this GPU")
            xq, xs = x2 if isinstance(x2, Fp8Rows) else quantize_fp8_rowwise(x2)
            # row-wise scaling: scale_a [M, 1], scale_b [1, N] fp32; W^T is the column-major view of the [N, K] weight.
            out_dtype = self.out_dtype if self.out_dtype != torch.float32 else torch.bfloat16
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.t(), out_dtype=out_dtype,
                                 use_fast_accum=self.fast_accum)
        elif self.emulate:
            y = fp8_rowwise_reference(x2, self.weight, self.weight_scale)
        else:
            raise Fp8Unavailable(f"Fp8RowwiseLinear has no {device.type} kernel (fp8 tensor cores are CUDA sm_89+); "
                                 "use linear_kernel='bf16'/'fp32' here, or emulate=True for a slow exact emulation")
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, out_dtype={self.out_dtype}, emulate={self.emulate}"


class DenseLinear(nn.Module):
    """Plain F.linear in one dtype (cuBLAS on GPU); weight stored in that dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), self.weight, self.bias)


# =====================================================================================================================
# Candidates
# =====================================================================================================================

WeightSource = torch.Tensor | QuantizedWeight


def _dense_weight(w: WeightSource, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


# Elements of a float weight quantised at once when a linear is converted at load: every row quantises on its own
# (ConvRot rotates within a row's column groups; the scale is per row), so a large weight goes a slab of rows at a
# time and its fp32 temporaries stay ~100 MB instead of several times the weight (a 28672 x 5376 refiner fc1 would
# otherwise take ~2.5 GB of temporaries on top of every loaded weight: a 22 GB card's load peak).
QUANTIZE_CHUNK_ELEMS = 1 << 24


def _int8_weight(w: WeightSource, chunk_elems: int = QUANTIZE_CHUNK_ELEMS) -> QuantizedWeight:
    if isinstance(w, QuantizedWeight):
        return w
    n, k = w.shape
    g = DEFAULT_CONVROT_GROUPSIZE
    while g >= 4 and (k % g or not is_power_of_4(g)):
        g //= 2
    group = g if g >= 4 else None
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    s = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    rows = max(1, chunk_elems // k)
    for i in range(0, n, rows):
        q[i:i + rows], s[i:i + rows] = quantize_convrot(w[i:i + rows].float(), group)
    return QuantizedWeight(q, s, group)


def _build_int8(w: WeightSource, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> nn.Module:
    qw = _int8_weight(w)
    n_out, n_in = qw.qdata.shape
    layer = Int8ConvRotLinear(n_in, n_out, bias=bias is not None, groupsize=qw.groupsize, mode="kernel",
                              compute_dtype=compute_dtype, device="meta")
    layer.weight, layer.weight_scale = qw.qdata, qw.scale.float().reshape(n_out, 1).contiguous()  # no copy
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    return layer


def fp8_builder(fast_accum: bool | None = None, emulate: bool = False):
    """The fp8 candidate's build (Fp8RowwiseLinear, bf16 / fp16 out). fast_accum None: the tuned value of the
    weight's architecture (minimax_h3/kernels/tuning.json); emulate: the fp32 emulation (any device)."""

    def build(w: WeightSource, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> nn.Module:
        kw = dict(out_dtype=compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16,
                  fast_accum=fast_accum, emulate=emulate)
        if isinstance(w, QuantizedWeight):
            return Fp8RowwiseLinear.from_quantized(w, bias, **kw)
        return Fp8RowwiseLinear.from_dense(w, bias, **kw)

    return build


def _dense_builder(dtype: torch.dtype):
    def build(w: WeightSource, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> nn.Module:
        return DenseLinear(_dense_weight(w, dtype), bias, dtype)
    return build


def _cuda_only(device: torch.device) -> str | None:
    return None if device.type == "cuda" else f"needs a CUDA GPU (device is {device.type})"


def _int8_available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "comfy-kitchen int8 on CPU is its eager fallback (slower than dense); GPU only here"
    try:
        from comfy_kitchen.backends import cuda as ck_cuda  # noqa: F401
    except ImportError as e:
        return f"comfy-kitchen is not importable ({e})"
    if not getattr(ck_cuda, "_CUBLASLT_AVAILABLE", True):
        return "comfy-kitchen CUDA int8_linear is not registered (no cuBLASLt 13): it would run on triton/eager"
    return None


def _sdpa_fn(backend) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)

    attention.__name__ = f"sdpa_{backend.name.lower()}"
    return attention


def _int8_attention_fn() -> Callable:
    import comfy_kitchen  # noqa: F401  (registers torch.ops.comfy_kitchen)

    op = torch.ops.comfy_kitchen.int8_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return op(q, k, v, None)

    return attention


def _int8_attention_available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "comfy-kitchen int8 attention has no CPU path"
    if torch.version.cuda is None or int(torch.version.cuda.split(".")[0]) < 13:
        return f"comfy-kitchen CUDA kernels need a CUDA 13 torch (this one: {torch.version.cuda})"
    try:
        import comfy_kitchen as ck
    except ImportError as e:
        return f"comfy-kitchen is not importable ({e})"
    if not hasattr(ck, "int8_attention_is_available") or not hasattr(torch.ops.comfy_kitchen, "int8_attention"):
        return "this comfy-kitchen has no int8_attention"
    if not ck.int8_attention_is_available(device):
        return "comfy-kitchen int8 attention is not available on this GPU (needs sm_75+ and its CUDA extension)"
    return None


def _fp8_attention_fn(kernel: str = "cudnn") -> Callable:
    from .fp8_attention import DEFAULT_OPTIONS, Fp8Attention

    # Eager models get the quantisation compiled on its own; compiled blocks trace through it and fuse it anyway.
    return Fp8Attention(DEFAULT_OPTIONS, compile_quant=True, kernel=kernel)


def _fp8_attention_available(device: torch.device) -> str | None:
    from .fp8_attention import unavailable

    return unavailable(device)


def _fa3_attention_fn() -> Callable:
    from .fa3_attention import Fa3Attention

    return Fa3Attention()


def _fa3_available(device: torch.device) -> str | None:
    from .fa3_attention import unavailable  # imports fa3-fwd only inside its check: absent, the candidate says so

    return unavailable(device)


def _sdpa_available(backend_name: str):
    def check(device: torch.device) -> str | None:
        if backend_name == "math":
            return None
        if device.type != "cuda":
            return f"SDPA {backend_name} backend is CUDA-only"
        if backend_name == "flash" and torch.cuda.get_device_capability(device) < (8, 0):
            return "SDPA flash needs sm_80+"
        if backend_name == "cudnn" and torch.cuda.get_device_capability(device) < (8, 0):
            return "SDPA cuDNN attention needs sm_80+"
        return None
    return check


@dataclass(frozen=True)
class LinearCandidate:
    name: str
    build: Callable[[WeightSource, torch.Tensor | None, torch.dtype], nn.Module]
    rel_err_bound: float
    unavailable: Callable[[torch.device], str | None] = lambda d: None  # None = usable, else why not
    archs: tuple[str, ...] | None = None  # auto-candidate on these arch keys (None = all)


@dataclass(frozen=True)
class AttentionCandidate:
    name: str
    make_fn: Callable[[], Callable]  # -> fn(q, k, v) on [B, heads, S, d]
    rel_err_bound: float
    unavailable: Callable[[torch.device], str | None] = lambda d: None
    archs: tuple[str, ...] | None = None


_FROM_80 = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
_FP8_ARCHS = ("sm_89", "sm_90", "sm_100", "sm_120")
_FP8_ATTENTION_ARCHS = ("sm_90", "sm_100", "sm_120")  # cuDNN's fp8 SDPA starts at Hopper
_FA3_ARCHS = ("sm_90",)  # fa3-fwd's kernels are built for Hopper


def default_linear_candidates() -> dict[str, LinearCandidate]:
    return {
        "fp32": LinearCandidate("fp32", _dense_builder(torch.float32), REL_ERR_BOUND["fp32"], archs=("cpu",)),
        # bf16 GEMMs are emulated (slow) on Turing: not a candidate there; CPU runs them natively on AVX512-BF16.
        "bf16": LinearCandidate("bf16", _dense_builder(torch.bfloat16), REL_ERR_BOUND["bf16"],
                                archs=("cpu",) + _FROM_80),
        "fp16": LinearCandidate("fp16", _dense_builder(torch.float16), REL_ERR_BOUND["fp16"],
                                unavailable=_cuda_only, archs=("sm_75",)),
        "int8": LinearCandidate("int8", _build_int8, REL_ERR_BOUND["int8"], unavailable=_int8_available,
                                archs=GPU_ARCHS),
        "fp8": LinearCandidate("fp8", fp8_builder(), REL_ERR_BOUND["fp8"], unavailable=fp8_supported,
                               archs=_FP8_ARCHS),
    }


def default_attention_candidates() -> dict[str, AttentionCandidate]:
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": AttentionCandidate("cudnn", lambda: _sdpa_fn(SDPBackend.CUDNN_ATTENTION), REL_ERR_BOUND["cudnn"],
                                    _sdpa_available("cudnn"), archs=_FROM_80),
        "flash": AttentionCandidate("flash", lambda: _sdpa_fn(SDPBackend.FLASH_ATTENTION), REL_ERR_BOUND["flash"],
                                    _sdpa_available("flash"), archs=_FROM_80),
        "efficient": AttentionCandidate("efficient", lambda: _sdpa_fn(SDPBackend.EFFICIENT_ATTENTION),
                                        REL_ERR_BOUND["efficient"], _sdpa_available("efficient"), archs=GPU_ARCHS),
        # math materialises the S x S scores: only the CPU fallback (still selectable by override on GPU).
        "math": AttentionCandidate("math", lambda: _sdpa_fn(SDPBackend.MATH), REL_ERR_BOUND["math"],
                                   _sdpa_available("math"), archs=("cpu",)),
        "int8": AttentionCandidate("int8", _int8_attention_fn, REL_ERR_BOUND["int8_attention"],
                                   _int8_attention_available, archs=GPU_ARCHS),
        "fp8": AttentionCandidate("fp8", _fp8_attention_fn, REL_ERR_BOUND["fp8_attention"],
                                  _fp8_attention_available, archs=_FP8_ATTENTION_ARCHS),
        # Each held to the bound of its precision: bf16 as the SDPA backends, fp8 as cuDNN's fp8 SDPA.
        "fa3": AttentionCandidate("fa3", _fa3_attention_fn, REL_ERR_BOUND["fa3"], _fa3_available, archs=_FA3_ARCHS),
        "fa3_fp8": AttentionCandidate("fa3_fp8", lambda: _fp8_attention_fn("fa3"), REL_ERR_BOUND["fp8_attention"],
                                      _fa3_available, archs=_FA3_ARCHS),
    }


# =====================================================================================================================
# Probe + selection
# =====================================================================================================================


@dataclass(frozen=True)
class KernelConfig:
    """Kernel settings of a stage (flags --linear-kernel / --attention-kernel map here)."""

    linear_kernel: str = AUTO  # auto | fp32 | bf16 | fp16 | int8 | fp8
    attention_kernel: str = AUTO  # auto | cudnn | flash | efficient | math | int8 | fp8 | fa3 | fa3_fp8
    compute_dtype: torch.dtype = torch.bfloat16
    # Representative probe shapes: (tokens, in, out) GEMMs (DiT qkv-like and fc2-like) and one attention
    # [1, heads, seq, head_dim]. The attention row count is a served one: the smallest seed shape, 832x480x124,
    # has S = 14,882, and an 8-bit kernel's per-row quantisation cost only pays off against the S^2 work at such
    # lengths (docs/kernels.md, "8-bit attention": at S = 4,096 fp8 loses to cuDNN bf16, at 14,882 it wins). Served
    # lengths are no multiple of a kernel's tile, so neither is the probe's: a kernel is timed with its ragged
    # last tile, as a job runs it. Well under a second per candidate on a datacenter GPU.
    linear_shapes: tuple[tuple[int, int, int], ...] = ((4096, 5376, 21504), (4096, 14336, 5376))
    attention_shape: tuple[int, int, int, int] = (1, 56, 14882, 128)
    probe_iters: int = 5
    seed: int = 0


@dataclass(frozen=True)
class KernelChoice:
    op: str
    kernel: str
    reason: str

    def as_tuple(self) -> tuple[str, str, str]:
        return (self.op, self.kernel, self.reason)


@dataclass
class ProbeResult:
    kernel: str
    ok: bool
    ms: float | None = None
    rel_err: float | None = None
    bound: float | None = None
    why: str = ""

    def summary(self) -> str:
        if self.ok:
            return f"{self.kernel} {self.ms:.3f} ms (err {self.rel_err:.1e})"
        return f"{self.kernel} rejected ({self.why})"


@dataclass
class KernelSelection:
    device: torch.device
    arch: str
    linear: str
    attention: str
    choices: list[KernelChoice]
    probes: dict[str, list[ProbeResult]] = field(default_factory=dict)
    _linear_cands: dict[str, LinearCandidate] = field(default_factory=dict, repr=False)
    _attention_cands: dict[str, AttentionCandidate] = field(default_factory=dict, repr=False)
    compute_dtype: torch.dtype = torch.bfloat16
    vsa: KernelChoice | None = None  # `select_vsa_kernel`'s choice (set after the probe, never remembered)

    def __getstate__(self) -> dict:
        """Pickled without the candidates (closures): a device worker gets the stage's start-up choice and rebuilds
        the default candidates."""
        return {**self.__dict__, "_linear_cands": None, "_attention_cands": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._linear_cands = default_linear_candidates()
        self._attention_cands = default_attention_candidates()

    def status_rows(self) -> list[tuple[str, str, str]]:
        """(op, kernel, reason) for the Status RPC."""
        return [c.as_tuple() for c in self.choices + ([self.vsa] if self.vsa else [])]

    @property
    def vsa_kernel(self) -> str:
        return self.vsa.kernel if self.vsa else "reference"

    def make_linear(self, weight: WeightSource, bias: torch.Tensor | None = None) -> nn.Module:
        return self._linear_cands[self.linear].build(weight, bias, self.compute_dtype)

    def attention_fn(self) -> Callable:
        return self._attention_cands[self.attention].make_fn()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


QUEUE_SPIN_CYCLES = 2_000_000  # ~1 ms at the clocks of a loaded H100 / H200: longer than a call takes to enqueue


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median ms per call after `warmup` calls (CUDA events on GPU, perf_counter on CPU)."""
    return interleaved_ms([fn], device, iters, warmup)[0]


def interleaved_ms(fns: Sequence[Callable[[], object]], device: torch.device, rounds: int,
                   warmup: int = 1) -> list[float]:
    """Each fn's median ms per call over `rounds` rounds that call every fn once in turn, after `warmup` calls of
    each (CUDA events on GPU, perf_counter on CPU). In turn because a GPU at its power limit changes its clock as it
    goes: timed one after another, candidates would be measured at different clocks, and the order would pick the
    winner (docs/kernels.md, "How the probe times"). On GPU each call is queued behind a spin of
    `QUEUE_SPIN_CYCLES` (`torch.cuda._sleep`): the host enqueues the call while the stream is still busy, so the events
    time the GPU's work and not the host's launches (in the model the host runs ahead of the GPU: its launches are
    hidden there). A call that raises is reported as `TimedCallError`."""
    cuda = device.type == "cuda"

    def one_call(position: int, fn: Callable[[], object]) -> float:
        try:
            if not cuda:
                t0 = time.perf_counter()
                fn()
                return (time.perf_counter() - t0) * 1e3
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(QUEUE_SPIN_CYCLES)
            a.record()
            fn()
            b.record()
            b.synchronize()  # a kernel's asynchronous fault surfaces here, still this fn's
            return a.elapsed_time(b)
        except Exception as e:
            raise TimedCallError(position, e) from e

    for position, fn in enumerate(fns):
        for _ in range(warmup):
            one_call(position, fn)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for position, fn in enumerate(fns):
            times[position].append(one_call(position, fn))
    return [statistics.median(ms) for ms in times]


class TimedCallError(Internal):
    """A timed call that raised (`interleaved_ms`): which of the fns (`position`) and its error (`error`). The probe
    rejects that candidate with the error; anywhere else it is a server fault."""

    def __init__(self, position: int, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.position, self.error = position, error


def _check(name: str, bound: float, outs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, str]:
    """Worst relative error over the probe outputs and a rejection reason ("" when within bound)."""
    worst = 0.0
    for y, ref in outs:
        if y.shape != ref.shape:
            return math.inf, f"wrong output shape {tuple(y.shape)} != {tuple(ref.shape)}"
        if not torch.isfinite(y).all():
            return math.inf, "non-finite output"
        worst = max(worst, rel_err(y, ref))
    if worst > bound:
        return worst, f"parity: rel err {worst:.2e} > bound {bound:.0e}"
    return worst, ""


def _probe_linear(cands: Sequence[LinearCandidate], device: torch.device, cfg: KernelConfig) -> list[ProbeResult]:
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    cases = []
    for m, k, n in cfg.linear_shapes:
        w = torch.randn(n, k, generator=gen, device=device) / math.sqrt(k)
        qw = _int8_weight(w)  # the service's weights are int8 ConvRot: every kernel starts from the same codes
        w_ref = qw.dequantize(torch.float32)
        x = torch.randn(m, k, generator=gen, device=device)
        # DiT-like activations: a few outlier channels (what ConvRot is for).
        x[:, torch.randperm(k, generator=gen, device=device)[:8]] *= 8.0
        x = x.to(cfg.compute_dtype)
        ref = F.linear(x.float(), w_ref)
        cases.append((qw, x, ref))
    results: list[ProbeResult] = []
    timed: list[tuple[int, Callable[[], object]]] = []  # (index in results, one call over all cases)
    for c in cands:
        try:
            mods = [c.build(qw, None, cfg.compute_dtype) for qw, _, _ in cases]
            with torch.inference_mode():
                outs = [(mod(x), ref) for mod, (_, x, ref) in zip(mods, cases)]
            err, why = _check(c.name, c.rel_err_bound, outs)
            outs = None
            results.append(ProbeResult(c.name, not why, rel_err=err, bound=c.rel_err_bound, why=why))
            if not why:
                timed.append((len(results) - 1, lambda ms=mods: [m(x) for m, (_, x, _) in zip(ms, cases)]))
        except Exception as e:  # a kernel that raises on this machine is rejected, with the error as its reason
            results.append(ProbeResult(c.name, False, why=_error_why(e)))
    _time_in_turn(results, timed, device, cfg)
    return results


def _time_in_turn(results: list[ProbeResult], timed: list[tuple[int, Callable[[], object]]], device: torch.device,
                  cfg: KernelConfig) -> None:
    """Time the candidates that passed their check in turn (`interleaved_ms`) and set their ms; a candidate whose
    call raises while timed is rejected with the error, and the others are timed again without it."""
    while timed:
        try:
            with torch.inference_mode():
                ms = interleaved_ms([fn for _, fn in timed], device, cfg.probe_iters)
        except TimedCallError as e:
            i, _ = timed.pop(e.position)
            results[i] = ProbeResult(results[i].kernel, False, why=_error_why(e.error))
            continue
        for (i, _), t in zip(timed, ms):
            results[i].ms = t
        return


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention of [B, H, S, D] q, k, v that never holds the S x S scores of all heads: PyTorch's
    memory-efficient kernel in fp32 where it runs (CUDA), else the math kernel one head at a time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qf, kf, vf = q.float(), k.float(), v.float()
    if q.is_cuda:
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(qf, kf, vf)
        except RuntimeError:  # this build / GPU has no fp32 memory-efficient kernel
            pass
    with sdpa_kernel([SDPBackend.MATH]):
        return torch.cat([F.scaled_dot_product_attention(qf[:, i:i + 1], kf[:, i:i + 1], vf[:, i:i + 1])
                          for i in range(q.shape[1])], dim=1)


def _probe_attention(cands: Sequence[AttentionCandidate], device: torch.device,
                     cfg: KernelConfig) -> list[ProbeResult]:
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    b, h, s, d = cfg.attention_shape
    q, k, v = (torch.randn(b, h, s, d, generator=gen, device=device).to(cfg.compute_dtype) for _ in range(3))
    with torch.inference_mode():
        ref = attention_reference(q, k, v)
    results: list[ProbeResult] = []
    timed: list[tuple[int, Callable[[], object]]] = []
    for c in cands:
        try:
            fn = c.make_fn()
            with torch.inference_mode():
                err, why = _check(c.name, c.rel_err_bound, [(fn(q, k, v), ref)])
            results.append(ProbeResult(c.name, not why, rel_err=err, bound=c.rel_err_bound, why=why))
            if not why:
                # Timed as the blocks call it, where that differs from (q, k, v) (fp8 attention: q and k come in e4m3).
                call = fn.block_call(q, k, v) if hasattr(fn, "block_call") else (lambda f=fn: f(q, k, v))
                timed.append((len(results) - 1, call))
        except Exception as e:
            results.append(ProbeResult(c.name, False, why=_error_why(e)))
    _time_in_turn(results, timed, device, cfg)
    return results


def _error_why(e: BaseException) -> str:
    """A rejected candidate's reason from its error."""
    return f"error: {type(e).__name__}: {str(e)[:PROBE_ERROR_CHARS]}"


def _why_unavailable(cand, device: torch.device) -> str | None:
    """The candidate's own availability answer; an availability check that raises (a broken optional package)
    makes the candidate unavailable with that error as the reason, never the stage's start-up."""
    try:
        return cand.unavailable(device)
    except Exception as e:
        return f"availability check failed: {type(e).__name__}: {str(e)[:PROBE_ERROR_CHARS]}"


def _considered(cands: dict, arch: str) -> list:
    """The candidates an automatic probe on `arch` considers."""
    return [c for c in cands.values() if c.archs is None or arch in c.archs]


def _fastest(results: Sequence[ProbeResult]) -> ProbeResult | None:
    """The probe's pick: the fastest result that passed (the first of equals); None when none passed."""
    ok = [r for r in results if r.ok]
    return min(ok, key=lambda r: r.ms) if ok else None


def _decide(op: str, setting: str, cands: dict, arch: str, device: torch.device, cfg: KernelConfig,
            probe) -> tuple[str, str, list[ProbeResult]]:
    if setting != AUTO:
        if setting not in cands:
            raise KernelError(f"unknown {op} kernel {setting!r}; choose one of {[AUTO, *sorted(cands)]}")
        why_not = _why_unavailable(cands[setting], device)
        if why_not:
            raise KernelError(f"{op}_kernel={setting!r} cannot run on {device} ({arch}): {why_not}; "
                              f"use {op}_kernel='auto'")
        res = probe([cands[setting]], device, cfg)
        if not res[0].ok:
            raise KernelError(f"{op}_kernel={setting!r} failed its start-up check on {device}: {res[0].why}; "
                              f"use {op}_kernel='auto'")
        return setting, f"forced by config ({op}_kernel={setting!r}); {res[0].summary()}", res
    considered = _considered(cands, arch)
    skipped = {}
    usable = []
    for c in considered:
        why_not = _why_unavailable(c, device)
        if why_not:
            skipped[c.name] = why_not
        else:
            usable.append(c)
    if not usable:
        raise KernelError(f"no {op} kernel is available on {device} ({arch}); skipped: {skipped}")
    res = probe(usable, device, cfg)
    best = _fastest(res)
    if best is None:
        raise KernelError(f"every {op} kernel failed its start-up check on {device}: "
                          + "; ".join(r.summary() for r in res))
    others = [r.summary() for r in res if r is not best] + [f"{n} skipped ({w})" for n, w in skipped.items()]
    reason = (f"fastest valid on {arch}: {best.summary()}"
              + (f"; others: {', '.join(others)}" if others else ""))
    return best.kernel, reason, res


def select_kernels(device: torch.device | str, config: KernelConfig | None = None,
                   linear_candidates: dict[str, LinearCandidate] | None = None,
                   attention_candidates: dict[str, AttentionCandidate] | None = None) -> KernelSelection:
    """Pick one linear and one attention kernel for `device` (see module docstring). Logs each choice."""
    cfg = config or KernelConfig()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_key(device)
    lin = linear_candidates if linear_candidates is not None else default_linear_candidates()
    att = attention_candidates if attention_candidates is not None else default_attention_candidates()
    l_name, l_reason, l_res = _decide(LINEAR_OP, cfg.linear_kernel, lin, arch, device, cfg, _probe_linear)
    a_name, a_reason, a_res = _decide(ATTENTION_OP, cfg.attention_kernel, att, arch, device, cfg, _probe_attention)
    choices = [KernelChoice(LINEAR_OP, l_name, l_reason), KernelChoice(ATTENTION_OP, a_name, a_reason)]
    for c in choices:
        log.info("kernel %s -> %s: %s", c.op, c.kernel, c.reason)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return KernelSelection(device, arch, l_name, a_name, choices, {LINEAR_OP: l_res, ATTENTION_OP: a_res},
                           lin, att, cfg.compute_dtype)


def select_vsa_kernel(device: torch.device | str, compute_dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> KernelChoice:
    """The VSA kernel of `device` (minimax_h3/kernels/vsa.py): fastvideo-kernel's where it is importable, takes the
    compute dtype and matches the exact reference (REL_ERR_BOUND["vsa"]) on a small problem with FastH3's routing;
    else the reference, which runs on every device, with why fastvideo-kernel is not used."""
    from . import vsa

    device = torch.device(device)
    why = vsa.fastvideo_unavailable(device)
    if why is None and compute_dtype != torch.bfloat16:
        why = f"{vsa.PACKAGE}'s kernels take bf16; the compute dtype is {str(compute_dtype).replace('torch.', '')}"
    if why is None:
        try:
            gen = torch.Generator(device=device).manual_seed(seed)
            segments, grid = (300, 384, 414), (8, 16, 16)  # text, one keyframe, audio; 2 x 4 x 4 video cubes
            rows = sum(segments) + math.prod(grid)
            q, k, v, gate = (torch.randn(4, rows, 128, generator=gen, device=device).to(compute_dtype)
                             for _ in range(4))
            tiles = vsa.vsa_tiles(segments, grid, device)
            with torch.inference_mode():
                ref = vsa.vsa_attention(q, k, v, tiles, 0.1, gate, "reference")
                got = vsa.vsa_attention(q, k, v, tiles, 0.1, gate, "fastvideo")
            err, why = _check("fastvideo", REL_ERR_BOUND["vsa"], [(got, ref)])
        except Exception as e:
            why = _error_why(e)
    if why:
        return KernelChoice(VSA_OP, "reference", f"exact PyTorch block-sparse attention; {vsa.PACKAGE} not used: {why}")
    return KernelChoice(VSA_OP, "fastvideo", f"{vsa.PACKAGE} {_package_version(vsa.PACKAGE)} block-sparse kernel "
                                             f"(err {err:.1e} against the exact reference)")


# ---------------------------------------------------------------------------------------------------------------------
# The probe's outcome, remembered per machine
# ---------------------------------------------------------------------------------------------------------------------
PROBE_PACKAGES = ("comfy-kitchen", "nvidia-cudnn-frontend", "triton", "fa3-fwd")
KERNELS_DIR = Path(__file__).parent  # every module here, and tuning.json, is part of a record's key
PROBE_RECORD_MAX_BYTES = 64 << 10  # a record is ~2 KiB; anything longer is not one


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def kernels_code(directory: Path) -> str:
    """A digest of every module of the kernel package in `directory` and its tuning table: any edit changes it."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.iterdir() if p.suffix in (".py", ".json")):
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode() + data)
    return h.hexdigest()[:16]


def probe_fingerprint(device: torch.device | str, config: KernelConfig, linear: Sequence[str],
                      attention: Sequence[str]) -> dict:
    """Everything a probe's outcome on `device` depends on (JSON-ready)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fp = {"torch": torch.__version__, "arch": arch_key(device),
          "config": {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config)},
          "linear": sorted(linear), "attention": sorted(attention), "bounds": REL_ERR_BOUND,
          "packages": {n: _package_version(n) for n in PROBE_PACKAGES}, "code": kernels_code(KERNELS_DIR)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fp["gpu"] = {"name": props.name, "memory": props.total_memory, "capability": [props.major, props.minor],
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    return json.loads(json.dumps(fp, sort_keys=True))


def _read_record(path: Path) -> dict:
    """The JSON object in the record file at `path`. Only a regular file is read, and at most PROBE_RECORD_MAX_BYTES of
    it: a directory, a device (a link to /dev/zero) or a FIFO in its place raises ValueError without blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = fh.read(PROBE_RECORD_MAX_BYTES + 1)
    if len(data) > PROBE_RECORD_MAX_BYTES:
        raise ValueError(f"longer than {PROBE_RECORD_MAX_BYTES} bytes")
    rec = json.loads(data)
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    return rec


def _probe_result(r: object) -> ProbeResult:
    """One recorded probe result, as the probe writes them (else ValueError)."""
    if not isinstance(r, dict) or not set(r) <= {f.name for f in dataclasses.fields(ProbeResult)}:
        raise ValueError(f"a probe result {r!r} has other fields than a ProbeResult's")
    res = ProbeResult(**r)
    numbers = (res.ms, res.rel_err, res.bound)
    if (not isinstance(res.kernel, str) or not isinstance(res.ok, bool) or not isinstance(res.why, str)
            or not all(v is None or isinstance(v, (int, float)) for v in numbers) or (res.ok and res.ms is None)):
        raise ValueError(f"a probe result {r!r} is not one the probe writes")
    return res


def _recorded_selection(rec: dict, fp: dict, cfg: KernelConfig, device: torch.device, lin: dict, att: dict,
                        where: str) -> KernelSelection:
    """The selection a record holds, once it has checked out as what this registry's probe of `cfg` on this machine
    writes: the same fingerprint and architecture, results only of the candidates that probe runs, and as its kernels
    the registry's that those results make the probe pick. ValueError (or KeyError / TypeError) says what is wrong."""
    if rec["fingerprint"] != fp:
        raise ValueError("measured for another fingerprint")
    if rec["arch"] != fp["arch"]:
        raise ValueError(f"measured on {rec['arch']!r}, this device is {fp['arch']!r}")
    if not isinstance(rec["measured"], str) or not isinstance(rec["probes"], dict) \
            or set(rec["probes"]) != {LINEAR_OP, ATTENTION_OP}:
        raise ValueError("not a record the probe writes")
    probes = {op: [_probe_result(r) for r in rs] for op, rs in rec["probes"].items()}
    chosen = {}
    for op, setting, cands in ((LINEAR_OP, cfg.linear_kernel, lin), (ATTENTION_OP, cfg.attention_kernel, att)):
        name = rec[op]
        if not isinstance(name, str) or name not in cands:
            raise ValueError(f"{op} kernel {name!r} is not one of the registry's {sorted(cands)}")
        runs = {setting} if setting != AUTO else {c.name for c in _considered(cands, rec["arch"])}
        if not probes[op] or any(r.kernel not in runs for r in probes[op]):
            raise ValueError(f"its {op} results are not of the kernels the probe runs ({sorted(runs)})")
        best = _fastest(probes[op])
        if best is None or best.kernel != name:
            raise ValueError(f"{op} kernel {name!r} is not the one its results make the probe pick "
                             f"({best.kernel if best else 'none passed'})")
        chosen[op] = name
    rows = rec["choices"]
    if not isinstance(rows, list) or not all(isinstance(c, dict) and isinstance(c.get("reason"), str) for c in rows) \
            or [(c.get("op"), c.get("kernel")) for c in rows] != list(chosen.items()):
        raise ValueError(f"its Status rows are not its selection {chosen}")
    choices = [KernelChoice(c["op"], c["kernel"], f"{c['reason']} (measured {rec['measured']}, remembered in {where})")
               for c in rows]
    return KernelSelection(device, rec["arch"], chosen[LINEAR_OP], chosen[ATTENTION_OP], choices, probes, lin, att,
                           cfg.compute_dtype)


def _write_record(path: Path, rec: dict) -> None:
    """Replace whatever is at `path` with `rec` in one step (a concurrent start reads the old record or the new one,
    never half of one); an empty directory in its place goes. A record that cannot be written is logged: the next
    start measures again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(rec, indent=1))
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("kernel probe record %s not kept (%s): the next start measures again", path, e)


def select_kernels_remembered(device: torch.device | str, config: KernelConfig | None, cache_dir: Path | None,
                              select: Callable[..., KernelSelection] | None = None) -> KernelSelection:
    """`select_kernels`, measured once per machine: the outcome is kept in `cache_dir` under the hash of its
    `probe_fingerprint`, and read back by a later start whose fingerprint is the same (its reasons then say when
    and where it was measured). `cache_dir` None: measure. A record that cannot be read or is not what this registry's
    probe writes (`_recorded_selection`) is measured again and replaced."""
    cfg = config or KernelConfig()
    select = select or select_kernels
    if cache_dir is None:
        return select(device, cfg)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    lin, att = default_linear_candidates(), default_attention_candidates()
    fp = probe_fingerprint(device, cfg, list(lin), list(att))
    path = Path(cache_dir) / f"kernel_probe_{hashlib.sha256(json.dumps(fp).encode()).hexdigest()[:16]}.json"
    try:
        sel = _recorded_selection(_read_record(path), fp, cfg, device, lin, att, str(path))
        for c in sel.choices:
            log.info("kernel %s -> %s: %s", c.op, c.kernel, c.reason)
        return sel
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        log.warning("kernel probe record %s not used (%s): probing again", path, e)
    sel = select(device, cfg)
    _write_record(path, {"fingerprint": fp, "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "arch": sel.arch,
                         "linear": sel.linear, "attention": sel.attention,
                         "choices": [dataclasses.asdict(c) for c in sel.choices],
                         "probes": {op: [dataclasses.asdict(r) for r in rs] for op, rs in sel.probes.items()}})
    return sel
