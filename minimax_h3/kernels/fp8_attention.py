"""8-bit (float8 e4m3) attention: cuDNN's fp8 SDPA through nvidia-cudnn-frontend, with exact error reduction.

The kernel (Hopper and newer) takes e4m3 Q, K, V with per-tensor fp32 descales, quantises the softmax numerator
P~ = exp(s - rowmax) to e4m3 with `scale_s`, and on Hopper writes an e4m3 O scaled by `scale_o`. What this module
adds around it (docs/kernels.md, "8-bit attention"):

1. Quantisation of q, k, v from the attention input (after RMSNorm + RoPE). On CUDA it runs as two Triton passes
   (per-channel statistics of q, k, v in one read, then the e4m3 write), one custom op that torch.compile leaves
   opaque; elsewhere (and when Triton is missing) as plain torch ops, which a compiled block traces and fuses, and
   which are compiled on their own otherwise. Both share the scale formulas (`fp8_scales`).
2. K smoothing (SageAttention): K minus its per-channel mean over tokens. Exact under softmax: q.(k_j - m) =
   q.k_j - q.m, and the q.m term is constant along a softmax row. It removes the shared offset that would
   otherwise spend the 3-bit mantissa of every key.
3. V smoothing: V minus its per-channel mean, added back to O. Exact because softmax rows sum to one; the fp8 O
   then carries only the deviation, so its rounding error shrinks with it.
4. Static q/k scales (`static_qk`). Where the q/k RMSNorm kernel writes q and k (minimax_h3/kernels/qk_norm_rope.py, in
   minimax_h3/dit/model.py's blocks), it writes them in e4m3 right away, with scales that need no statistics: after an
   RMSNorm over D channels every |x_i| <= sqrt(D) (the squares sum to at most D), times its gain, and RoPE rotates
   channel pairs, which keeps a pair's norm; so |q_i| <= sqrt(D) * max|gain| (`static_qk_mult`). e4m3's relative
   step is the same over its normal range, so a loose bound costs only values ~2^-14 of the largest, which the
   attention sums cannot see. The quantisation pass then reads only V. K is not smoothed there (it would need K's
   mean first); measured, smoothing K changed nothing (docs/kernels.md, "8-bit attention").
5. Per-head V (and O) scales. The kernel's descales are scalars, but O is linear in V: each head's V is scaled to
   the full e4m3 range by its own factor, the kernel is told descale_v = 1, and each head's O is divided by that
   factor afterwards. Exact, and needs nothing from cuDNN. Q and K stay per tensor: their softmax logits need
   one common descale per head pair, which the kernel does not take, and after the per-head RMSNorm (which
   normalises every head vector to unit RMS) their heads share one range anyway.

Layout: the quantiser keeps the memory layout of its input (elementwise ops preserve strides, the Triton op
allocates like its input): BHSD-contiguous q
from minimax_h3/dit/model.py's blocks gives BHSD e4m3 tensors, a [S, H, D]-backed view gives [S, H, D]-backed ones. cuDNN
reads any of them as BHSD through their strides (the plan is keyed by them), and O is allocated like q.

Everything except the cuDNN call has a CPU path: `emulate=True` replaces the kernel by an fp32 emulation of the
same arithmetic (e4m3 P and O included), for tests and for checking the quantisation math without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .fp8 import E4M3, SOFTMAX_SCALE
from .triton_ops import tl, triton  # None without Triton: the torch quantiser serves
from .tuning import launch_params

log = logging.getLogger(__name__)

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-12  # an all-zero tensor would otherwise divide by zero
# Scale of O before its e4m3 cast. O is a convex combination of V rows, so |O| <= max|V| = 448 in quantised
# units; 0.5 keeps rounding of the softmax weights' sum away from e4m3's top (a NaN in e4m3fn), and costs no
# precision (e4m3's relative step is the same across its normal range).
OUTPUT_SCALE = 0.5
MIN_CAPABILITY = (9, 0)  # cuDNN's fp8 SDPA: Hopper and newer
FP8_KERNELS = ("cudnn", "fa3")  # Fp8Attention's kernel: cuDNN's fp8 SDPA, or FlashAttention-3's (fa3_attention.py)
MIN_CUDNN_BACKEND = 90100  # 9.1.0 introduced the fp8 SDPA forward
GRAPH_CACHE_SIZE = 16  # cuDNN plans kept (one per plan_key); a job uses one or two
# The kernel's error vs fp32 may exceed its emulation's (same arithmetic, but P~ rounded against a blockwise running
# row max instead of the final one) by this factor plus this slack; a broken kernel (wrong scale, layout) is off by
# 10x or more. Their raw e4m3 outputs are not comparable element by element (each P~ rounds differently).
KERNEL_VS_EMULATION_FACTOR = 1.5
KERNEL_VS_EMULATION_SLACK = 2e-3


@dataclass(frozen=True)
class Fp8AttentionOptions:
    """How q, k, v are quantised (see the module docstring)."""

    v_scale: str = "head"  # "tensor" | "head": one scale for V (and O) or one per head
    smooth_k: bool = True  # subtract K's per-channel mean over tokens
    smooth_v: bool = True  # subtract V's per-channel mean over tokens, add it back to O
    min_seq: int = 1024  # shorter sequences (e.g. the text refiner) run the compute-dtype SDPA instead
    # q and k arrive in e4m3 from the q/k norm kernel where the model can do that (`takes_fp8_qk`; not under
    # sequence parallelism, whose all-to-all moves compute-dtype q, k, v); elsewhere quantised as above.
    static_qk: bool = False

    def __post_init__(self) -> None:
        if self.v_scale not in ("tensor", "head"):
            raise ValueError(f"v_scale must be 'tensor' or 'head', got {self.v_scale!r}")

    @property
    def label(self) -> str:
        return (f"{self.v_scale}{'+k' if self.smooth_k else ''}{'+v' if self.smooth_v else ''}"
                f"{'+static-qk' if self.static_qk else ''}")


# The options the benchmark compares (benchmarks/bench_attention.py); DEFAULT is what the registry runs.
OPTIONS = {
    "naive": Fp8AttentionOptions(v_scale="tensor", smooth_k=False, smooth_v=False),
    "head": Fp8AttentionOptions(v_scale="head", smooth_k=False, smooth_v=False),
    "head+k": Fp8AttentionOptions(v_scale="head", smooth_k=True, smooth_v=False),
    "head+kv": Fp8AttentionOptions(v_scale="head", smooth_k=True, smooth_v=True),
    "head+kv+static-qk": Fp8AttentionOptions(v_scale="head", smooth_k=True, smooth_v=True, static_qk=True),
}
DEFAULT_OPTIONS = OPTIONS["head+kv+static-qk"]


class Fp8O(NamedTuple):
    """fp8 attention's output as its kernel writes it, before O is put together (`Fp8Attention.attend_fp8_qk(...,
    keep_fp8_o=True)`): o8 [H, S, D], e4m3 from cuDNN's fp8 SDPA or bf16 from FlashAttention-3's fp8 kernel (any
    head and row strides, D contiguous), o_scale [H, 1, 1] fp32 (ones for FA3, which applies V's scale itself),
    o_shift [H, 1, D] fp32 (V's mean) or None; O = `dequantize_o(o8, o_scale, o_shift, dtype)`.
    minimax_h3/kernels/layers.py hands its rows to an fp8 out_proj in one pass (minimax_h3/kernels/fp8_rows.py
    `o_rows_fp8`) instead of writing O in the compute dtype first."""

    o8: torch.Tensor
    o_scale: torch.Tensor
    o_shift: torch.Tensor | None


class Fp8QKV(NamedTuple):
    """Quantised attention inputs. q8/k8/v8 [H, S, D] e4m3 (the input's memory layout); descale_q/descale_k [1]
    fp32 (value = descale x e4m3); o_scale [H, 1, 1] and o_shift [H, 1, D] fp32 (or None) turn the kernel's e4m3 O
    back into O."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    o_scale: torch.Tensor
    o_shift: torch.Tensor | None


# =====================================================================================================================
# Quantisation: statistics -> scales (shared) -> e4m3. Plain torch (any device) and two Triton passes (CUDA)
# =====================================================================================================================


class ChannelStats(NamedTuple):
    """Per-(head, channel) statistics over the tokens of one [H, S, D] tensor, fp32 [H, 1, D] each: max, min and
    mean (None when that tensor is not smoothed)."""

    hi: torch.Tensor
    lo: torch.Tensor
    mean: torch.Tensor | None


class Fp8Scales(NamedTuple):
    """What quantisation applies: e4m3 = clamp((x - shift) * mult, +-448). mult_q / mult_k [] fp32, mult_v
    [H, 1, 1]; shift_k / shift_v [H, 1, D] (None: not smoothed); the kernel's descale_q / descale_k [1] and the O
    dequantisation's o_scale [H, 1, 1] (its o_shift is shift_v)."""

    mult_q: torch.Tensor
    mult_k: torch.Tensor
    mult_v: torch.Tensor
    shift_k: torch.Tensor | None
    shift_v: torch.Tensor | None
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    o_scale: torch.Tensor


def _centered_amax(st: ChannelStats) -> torch.Tensor:
    """[H, 1, D] absmax after subtracting the mean (if any). Costs no pass of its own: fp32 subtraction is
    monotone, so max_j(x_j - m) == max_j(x_j) - m, and likewise for the min."""
    if st.mean is None:
        return torch.maximum(st.hi, -st.lo)
    return torch.maximum(st.hi - st.mean, st.mean - st.lo)


def fp8_scales(q_amax: torch.Tensor, k: ChannelStats, v: ChannelStats, options: Fp8AttentionOptions) -> Fp8Scales:
    """The scales from the statistics (q_amax: q's absmax, [] fp32): the one place these formulas live, used by
    both quantisers. A few tiny ops on [H, 1, D] tensors."""
    aq = q_amax.clamp(min=AMAX_FLOOR)
    ak = _centered_amax(k).amax().clamp(min=AMAX_FLOOR)
    mult_v, o_scale = v_scales(v, options)
    return Fp8Scales(E4M3_MAX / aq, E4M3_MAX / ak, mult_v, k.mean, v.mean, (aq / E4M3_MAX).reshape(1),
                     (ak / E4M3_MAX).reshape(1), o_scale)


def v_scales(v: ChannelStats, options: Fp8AttentionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """V's e4m3 multiplier and O's dequantisation scale, both [H, 1, 1] fp32, from V's statistics."""
    amv = _centered_amax(v)
    av = amv.amax(dim=(1, 2), keepdim=True) if options.v_scale == "head" else amv.amax().expand(amv.shape[0], 1, 1)
    av = av.clamp(min=AMAX_FLOOR)  # [H, 1, 1]
    # The kernel sees V in quantised units (descale_v = 1) and writes O * OUTPUT_SCALE in those units.
    return E4M3_MAX / av, av / (E4M3_MAX * OUTPUT_SCALE)


def static_qk_mult(q_weight: torch.Tensor, k_weight: torch.Tensor) -> torch.Tensor:
    """[2] fp32 e4m3 multipliers of q and k after RMSNorm (+ RoPE) with these gains [D] (module docstring, 4):
    448 / (sqrt(D) * max|gain|)."""
    bound = torch.stack([q_weight.float().abs().amax(), k_weight.float().abs().amax()]) * math.sqrt(q_weight.shape[0])
    return E4M3_MAX / bound.clamp(min=AMAX_FLOOR)


class Fp8QKInput(NamedTuple):
    """One block's attention input with q and k already in e4m3 (what `Fp8Attention.attend_fp8_qk` takes; the q/k
    norm kernel writes it): qk8 [2, 1, H, S, D] e4m3 = clamp(x * qk_mult[i], +-448) for q (i = 0) and k (i = 1),
    v [1, H, S, D] compute dtype (any strides: a buffer of its own, or a view of the qkv projection's output; None
    until the model sets it), qk_mult [2] fp32 (`static_qk_mult`)."""

    qk8: torch.Tensor
    v: torch.Tensor | None
    qk_mult: torch.Tensor


def _to_e4m3(x: torch.Tensor, shift: torch.Tensor | None, mult: torch.Tensor) -> torch.Tensor:
    if shift is not None:
        x = x - shift
    return (x * mult).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _channel_stats(x: torch.Tensor, smooth: bool) -> ChannelStats:
    """One pass of three reductions over the tokens of x [H, S, D] (fp32)."""
    return ChannelStats(x.amax(1, keepdim=True), x.amin(1, keepdim=True), x.mean(1, keepdim=True) if smooth else None)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: Fp8AttentionOptions) -> Fp8QKV:
    """q, k, v [H, S, D] (any float dtype, any strides) -> Fp8QKV. Pure torch (compiles and fuses); the reference
    for `quantize_qkv_triton`."""
    qf, kf, vf = q.float(), k.float(), v.float()
    sc = fp8_scales(qf.abs().amax(), _channel_stats(kf, options.smooth_k), _channel_stats(vf, options.smooth_v),
                    options)
    return Fp8QKV(_to_e4m3(qf, None, sc.mult_q), _to_e4m3(kf, sc.shift_k, sc.mult_k),
                  _to_e4m3(vf, sc.shift_v, sc.mult_v), sc.descale_q, sc.descale_k, sc.o_scale, sc.shift_v)


def quantize_v(v: torch.Tensor, options: Fp8AttentionOptions) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None]:
    """V alone, as `quantize_qkv` quantises it: v [H, S, D] -> (v8 [H, S, D] e4m3, o_scale [H, 1, 1], o_shift
    [H, 1, D] or None). Pure torch; the reference for `quantize_v_triton`."""
    vf = v.float()
    st = _channel_stats(vf, options.smooth_v)
    mult_v, o_scale = v_scales(st, options)
    return _to_e4m3(vf, st.mean, mult_v), o_scale, st.mean


# ---- The Triton quantiser: one statistics pass and one quantise pass over q, k, v ---------------------------------
# Both kernels run on a grid of (row block, head, section), section 0/1/2 = q/k/v, each program on [rows, D] tiles
# of one head (D contiguous: coalesced loads), fp32 math. The statistics are reduced in two deterministic stages
# rather than with float atomics: each program writes its per-channel max / min / sum over `stats_rows` rows to a
# partials buffer [3 stats, 3 sections, row blocks, H, D], and torch reduces its (short) row-block axis. With a few
# hundred to a thousand rows per program the partials are ~1 % of the input's bytes, so the second stage costs
# next to nothing, and the result does not depend on the order programs finish in (atomic_add's would).


class TritonQuantLaunch(NamedTuple):
    """Launch parameters of the two passes (benchmarks/bench_attention.py sweeps them; each device's tuned ones are
    in minimax_h3/kernels/tuning.json, `tuned`)."""

    stats_rows: int  # rows each statistics program reduces (a multiple of stats_block_r)
    stats_block_r: int  # rows per loaded tile in the statistics pass
    stats_warps: int
    quant_block_r: int  # rows per program in the quantise pass
    quant_warps: int

    @classmethod
    def tuned(cls, device: torch.device | str) -> "TritonQuantLaunch":
        return cls(**launch_params("fp8_attention_quant", device))


if triton is not None:

    @triton.jit
    def _section(sec, q, q_sh, q_ss, k, k_sh, k_ss, v, v_sh, v_ss):
        """Pointer, head stride and row stride (both int64) of section `sec` (0 q, 1 k, 2 v)."""
        ptr, sh, ss = v, v_sh.to(tl.int64), v_ss.to(tl.int64)
        if sec == 0:
            ptr, sh, ss = q, q_sh.to(tl.int64), q_ss.to(tl.int64)
        elif sec == 1:
            ptr, sh, ss = k, k_sh.to(tl.int64), k_ss.to(tl.int64)
        return ptr, sh, ss

    @triton.jit
    def _qkv_stats_kernel(q, k, v, part, S, q_sh, q_ss, k_sh, k_ss, v_sh, v_ss,
                          D: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
        """part[stat, sec, blk, h, :] = per-channel max / min / sum over rows [blk * ROWS, (blk + 1) * ROWS). A grid of
        one section (V alone) passes V as q."""
        blk, h, sec = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nblk, nh = tl.num_programs(0), tl.num_programs(1)
        ptr, sh, ss = _section(sec, q, q_sh, q_ss, k, k_sh, k_ss, v, v_sh, v_ss)
        ptr += h.to(tl.int64) * sh
        cols = tl.arange(0, D)
        # Elementwise accumulators over the tiles, reduced over rows once at the end.
        hi = tl.full([BLOCK_R, D], float("-inf"), tl.float32)
        lo = tl.full([BLOCK_R, D], float("inf"), tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for r in range(0, ROWS, BLOCK_R):
            rows = blk * ROWS + r + tl.arange(0, BLOCK_R)
            mask = (rows < S)[:, None]
            x = tl.load(ptr + rows.to(tl.int64)[:, None] * ss + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
            lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
            acc += x
        out = part + ((sec * nblk + blk) * nh + h).to(tl.int64) * D + cols
        stat = tl.num_programs(2) * nblk.to(tl.int64) * nh * D  # stride of the partials' first axis
        tl.store(out, tl.max(hi, 0))
        tl.store(out + stat, tl.min(lo, 0))
        tl.store(out + 2 * stat, tl.sum(acc, 0))

    @triton.jit
    def _qkv_quantize_kernel(q, k, v, q8, k8, v8, mult, shift, S, q_sh, q_ss, k_sh, k_ss, v_sh, v_ss,
                             q8_sh, q8_ss, k8_sh, k8_ss, v8_sh, v8_ss,
                             D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SHIFT: tl.constexpr,
                             FP8_MAX: tl.constexpr):
        """out[h, rows] = e4m3(clamp((x[h, rows] - shift[sec, h]) * mult[sec, h], +-FP8_MAX))."""
        blk, h, sec = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nh = tl.num_programs(1)
        src, sh, ss = _section(sec, q, q_sh, q_ss, k, k_sh, k_ss, v, v_sh, v_ss)
        dst, dh, ds = _section(sec, q8, q8_sh, q8_ss, k8, k8_sh, k8_ss, v8, v8_sh, v8_ss)
        cols = tl.arange(0, D)
        rows = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < S)[:, None]
        hh = h.to(tl.int64)
        x = tl.load(src + hh * sh + rows[:, None] * ss + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SHIFT:  # zero rows for the sections that are not smoothed: x - 0 is x
            x = x - tl.load(shift + (sec * nh + h) * D + cols)[None, :]
        x = x * tl.load(mult + sec * nh + h)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        tl.store(dst + hh * dh + rows[:, None] * ds + cols[None, :], x.to(tl.float8e4nv), mask=mask)


def triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None if `quantize_qkv_triton` takes these [H, S, D] tensors on this machine, else why not."""
    if triton is None:
        return "triton is not importable"
    if q.device.type != "cuda":
        return f"the Triton quantiser runs on CUDA (device is {q.device.type})"
    d = q.shape[-1]
    if d & (d - 1) or d > 256:
        return f"head_dim {d} is not a power of two <= 256"
    if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
        return "q, k, v differ in shape or dtype"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q.dtype} is not bf16 / fp16 / fp32"
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        return "head_dim is not the unit-stride dimension"
    return None


def _heads_strides(x: torch.Tensor) -> tuple[int, int]:
    """Head and row strides of x [H, S, D] for the kernels. Triton specialises an int argument on divisibility by
    16 (what lets it vectorise the loads) and turns a 1 into a constant; a size-1 dimension's stride is never used,
    so it is passed as 0 (an int, and divisible)."""
    return tuple(x.stride(i) if x.size(i) > 1 else 0 for i in (0, 1))


@torch.library.custom_op("h3stages::quantize_qkv_fp8", mutates_args=())
def _quantize_qkv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_head: bool, smooth_k: bool,
                      smooth_v: bool, launch: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """The Triton quantiser as one torch op (opaque to torch.compile). Returns q8, k8, v8, descale_q, descale_k,
    o_scale, o_shift (zeros [H, 1, D] when V is not smoothed: an op returns tensors)."""
    if triton is None:
        raise RuntimeError("the Triton fp8 quantiser needs triton (pip install triton)")
    lp = _launch(launch, q.device)
    options = Fp8AttentionOptions(v_scale="head" if v_head else "tensor", smooth_k=smooth_k, smooth_v=smooth_v)
    # Triton launches on the current device: make that q's.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _triton_quantize(q, k, v, options, lp)


def _launch(launch: list[int], device: torch.device) -> TritonQuantLaunch:
    """An op's launch argument as parameters: the given ones, or (empty) the device's tuned ones."""
    lp = TritonQuantLaunch(*launch) if launch else TritonQuantLaunch.tuned(device)
    if lp.stats_rows % lp.stats_block_r:
        raise ValueError(f"stats_rows {lp.stats_rows} is not a multiple of stats_block_r {lp.stats_block_r}")
    return lp


def _triton_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: Fp8AttentionOptions,
                     lp: TritonQuantLaunch) -> tuple[torch.Tensor, ...]:
    """The op's body: statistics pass, scales, quantise pass."""
    h, s, d = q.shape
    smooth_k, smooth_v = options.smooth_k, options.smooth_v
    f32 = dict(dtype=torch.float32, device=q.device)
    strides = (*_heads_strides(q), *_heads_strides(k), *_heads_strides(v))
    # 1. Statistics pass, then the partials' row-block axis reduced by torch (fixed order: deterministic).
    nblk = triton.cdiv(s, lp.stats_rows)
    part = torch.empty(3, 3, nblk, h, d, **f32)  # [max | min | sum, q | k | v, row block, head, channel]
    _qkv_stats_kernel[(nblk, h, 3)](q, k, v, part, s, *strides, D=d, ROWS=lp.stats_rows, BLOCK_R=lp.stats_block_r,
                                    num_warps=lp.stats_warps)
    hi, lo, mean = part[0].amax(1), part[1].amin(1), part[2].sum(1) / s  # [3, H, D] each

    def stats(i: int, smooth: bool) -> ChannelStats:
        return ChannelStats(hi[i, :, None], lo[i, :, None], mean[i, :, None] if smooth else None)

    # 2. The scales, by the same code as the torch quantiser.
    sc = fp8_scales(torch.maximum(hi[0], -lo[0]).amax(), stats(1, smooth_k), stats(2, smooth_v), options)
    mult = torch.stack([sc.mult_q.expand(h), sc.mult_k.expand(h), sc.mult_v.reshape(h)])  # [3, H]
    zeros = torch.zeros(h, 1, d, **f32)
    # A tensor of its own (not a view into `mean`): what the fake implementation promises.
    o_shift = zeros if sc.shift_v is None else sc.shift_v.clone()
    shift = torch.stack([zeros, zeros if sc.shift_k is None else sc.shift_k, o_shift])  # [3, H, 1, D]
    # 3. Quantise pass into e4m3 tensors laid out like the inputs.
    outs = [torch.empty_like(x, dtype=E4M3) for x in (q, k, v)]
    out_strides = [st for x in outs for st in _heads_strides(x)]
    _qkv_quantize_kernel[(triton.cdiv(s, lp.quant_block_r), h, 3)](
        q, k, v, *outs, mult, shift, s, *strides, *out_strides, D=d, BLOCK_R=lp.quant_block_r,
        HAS_SHIFT=smooth_k or smooth_v, FP8_MAX=E4M3_MAX, num_warps=lp.quant_warps)
    return (*outs, sc.descale_q, sc.descale_k, sc.o_scale, o_shift)


@_quantize_qkv_fp8.register_fake
def _(q, k, v, v_head, smooth_k, smooth_v, launch):
    h, _, d = q.shape
    return (*(torch.empty_like(x, dtype=E4M3) for x in (q, k, v)), q.new_empty(1, dtype=torch.float32),
            q.new_empty(1, dtype=torch.float32), q.new_empty(h, 1, 1, dtype=torch.float32),
            q.new_empty(h, 1, d, dtype=torch.float32))


def quantize_qkv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: Fp8AttentionOptions,
                        launch: TritonQuantLaunch | None = None) -> Fp8QKV:
    """`quantize_qkv` in two Triton passes (q, k, v [H, S, D] with a unit stride on D; see `triton_unsupported`):
    the same scales and, up to the summation order of the means, the same e4m3 values. Any device Triton runs on
    (CUDA; the CPU under TRITON_INTERPRET=1, for tests). launch None: the device's tuned one (resolved inside the
    op, which torch.compile leaves opaque)."""
    p = _quantize_qkv_fp8(q, k, v, options.v_scale == "head", options.smooth_k, options.smooth_v,
                          list(launch or ()))
    return Fp8QKV(*p[:6], p[6] if options.smooth_v else None)


@torch.library.custom_op("h3stages::quantize_v_fp8", mutates_args=())
def _quantize_v_fp8(v: torch.Tensor, v_head: bool, smooth_v: bool,
                    launch: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V alone through the two Triton passes (a grid of one section) as one torch op, opaque to torch.compile.
    Returns v8, o_scale, o_shift (zeros [H, 1, D] when V is not smoothed)."""
    if triton is None:
        raise RuntimeError("the Triton fp8 quantiser needs triton (pip install triton)")
    lp = _launch(launch, v.device)
    options = Fp8AttentionOptions(v_scale="head" if v_head else "tensor", smooth_v=smooth_v)
    h, s, d = v.shape
    f32 = dict(dtype=torch.float32, device=v.device)
    strides = _heads_strides(v) * 3  # the kernels' q, k, v arguments: V three times, section 0 read
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():
        nblk = triton.cdiv(s, lp.stats_rows)
        part = torch.empty(3, 1, nblk, h, d, **f32)  # [max | min | sum, V, row block, head, channel]
        _qkv_stats_kernel[(nblk, h, 1)](v, v, v, part, s, *strides, D=d, ROWS=lp.stats_rows,
                                        BLOCK_R=lp.stats_block_r, num_warps=lp.stats_warps)
        mean = part[2, 0].sum(0)[:, None] / s
        st = ChannelStats(part[0, 0].amax(0)[:, None], part[1, 0].amin(0)[:, None], mean if smooth_v else None)
        mult_v, o_scale = v_scales(st, options)
        o_shift = mean if smooth_v else torch.zeros(h, 1, d, **f32)
        v8 = torch.empty_like(v, dtype=E4M3)
        _qkv_quantize_kernel[(triton.cdiv(s, lp.quant_block_r), h, 1)](
            v, v, v, v8, v8, v8, mult_v.reshape(1, h), o_shift, s, *strides, *(_heads_strides(v8) * 3), D=d,
            BLOCK_R=lp.quant_block_r, HAS_SHIFT=smooth_v, FP8_MAX=E4M3_MAX, num_warps=lp.quant_warps)
    return v8, o_scale, o_shift


@_quantize_v_fp8.register_fake
def _(v, v_head, smooth_v, launch):
    h, _, d = v.shape
    return (torch.empty_like(v, dtype=E4M3), v.new_empty(h, 1, 1, dtype=torch.float32),
            v.new_empty(h, 1, d, dtype=torch.float32))


def quantize_v_triton(v: torch.Tensor, options: Fp8AttentionOptions,
                      launch: TritonQuantLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor | None]:
    """`quantize_v` in two Triton passes (v [H, S, D] with a unit stride on D), as `quantize_qkv_triton` does V."""
    v8, o_scale, o_shift = _quantize_v_fp8(v, options.v_scale == "head", options.smooth_v, list(launch or ()))
    return v8, o_scale, o_shift if options.smooth_v else None


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two e4m3 tensors are, elementwise (int32): the bit patterns (sign-magnitude) read
    as integers that count steps, +0 and -0 both 0. For comparing quantisers (tests, benchmarks/bench_attention.py)."""
    def order(x):
        bits = x.view(torch.uint8).int()
        return torch.where(bits >= 128, 128 - bits, bits)
    return (order(a) - order(b)).abs()


def dequantize_o(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """e4m3 O [H, S, D] from the kernel -> O [H, S, D] in `dtype` (same memory layout)."""
    o = o8.float() * o_scale
    if o_shift is not None:
        o = o + o_shift
    return o.to(dtype)


def sdpa_fp8_emulated(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                      descale_k: torch.Tensor) -> torch.Tensor:
    """fp32 emulation of the kernel on [H, S, D] e4m3 inputs (descale_v = 1, scale_o = OUTPUT_SCALE): softmax
    numerator quantised to e4m3 with SOFTMAX_SCALE, normalised by its fp32 row sum, O written as e4m3 [H, S, D].
    The kernel takes the row max blockwise (flash attention), so its P~ rounding differs slightly; the error is the
    same kind. Materialises the [H, S, S] scores: tests and small shapes only."""
    d = q8.shape[-1]
    q = q8.float() * descale_q.float()
    k = k8.float() * descale_k.float()
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    denom = p.sum(-1, keepdim=True)
    p8 = (p * SOFTMAX_SCALE).to(E4M3).float() * (1.0 / SOFTMAX_SCALE)
    o = (p8 @ v8.float()) / denom
    return (o * OUTPUT_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# =====================================================================================================================
# cuDNN (nvidia-cudnn-frontend), optional
# =====================================================================================================================


def unavailable(device: torch.device | str) -> str | None:
    """None if cuDNN fp8 SDPA can run on `device`, else why not (missing package, GPU too old, ...). Never raises:
    the registry's start-up probe calls it for every candidate."""
    device = torch.device(device)
    try:
        import cudnn
    except Exception as e:  # ImportError, or a library that fails to load (OSError / RuntimeError)
        return f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); pip install nvidia-cudnn-frontend"
    if device.type != "cuda":
        return f"cuDNN fp8 attention needs a CUDA GPU (device is {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"cuDNN fp8 attention needs compute capability >= 9.0 (Hopper), this GPU is sm_{cap[0]}{cap[1]}"
    try:
        # The frontend loads libcudnn itself (LD_LIBRARY_PATH, then the nvidia-cudnn wheel torch uses); without one
        # every backend call raises RuntimeError ("Unable to find symbol cudnnGetVersion").
        version = cudnn.backend_version()
    except Exception as e:
        return f"nvidia-cudnn-frontend found no cuDNN library ({type(e).__name__}: {e})"
    if version < MIN_CUDNN_BACKEND:
        return f"cuDNN backend {version} has no fp8 SDPA (needs >= 9.1.0)"
    return None


class _Plan(NamedTuple):
    graph: object
    tensors: dict  # port name -> the graph's tensor (inputs, scales, O, amax_s, amax_o)
    workspace_bytes: int
    amax: torch.Tensor  # [2, 1, 1, 1, 1] fp32 scratch for the kernel's amax_s / amax_o outputs (never read)


def plan_key(device: torch.device, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
             head_descales: bool) -> tuple:
    """What a plan is built for: device, heads, rows, head_dim, the four [H, S, D] stride triples, descale shape.
    A new sequence length or memory layout gets its own plan (built in ~1 s, kept; docs/performance.md)."""
    h, s, d = q8.shape
    return (device.index, h, s, d, tuple(tuple(x.stride()) for x in (q8, k8, v8, o8)), head_descales)


def declare_graph(cudnn, handle, h: int, s: int, d: int, strides: tuple, head_descales: bool = False):
    """The fp8 SDPA graph in nvidia-cudnn-frontend's graph IR, validated by the frontend, not yet built
    (no GPU needed up to here). strides: the [H, S, D] strides of q, k, v and O. Returns (graph, tensors by port).

    Facts of nvidia-cudnn-frontend 1.32.0 this relies on (its `pygraph.sdpa_fp8` and backend binding docstrings):
    every input port is required: q, k, v (dims [B, H, S, D], last stride 1), descale_q/k/v/s and scale_s/o
    (fp32 device tensors [1, 1, 1, 1]); `generate_stats=False` is inference (no softmax stats output); the call
    returns [O, Stats (None here), Amax_S, Amax_O]. O is declared e4m3 (Hopper's kernel writes fp8 O; bf16 O is
    Blackwell-only) with q's layout, and both amaxes as fp32 [1, 1, 1, 1] outputs, as cuDNN's fp8 forward graphs
    have always declared them (the backend serves such a graph; we never read them)."""
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    dims = [1, h, s, d]
    # BHSD dims over each tensor's own [H, S, D] strides (batch stride: the whole tensor).
    t = {n: graph.tensor(name=n, dim=dims, stride=[h * s * d, *st], data_type=e4m3)
         for n, st in zip(("q", "k", "v"), strides)}
    qk_dims = ([1, h, 1, 1], [h, 1, 1, 1]) if head_descales else ([1, 1, 1, 1], [1, 1, 1, 1])
    for n in ("descale_q", "descale_k"):
        t[n] = graph.tensor(name=n, dim=qk_dims[0], stride=qk_dims[1], data_type=fp32)
    for n in ("descale_v", "descale_s", "scale_s", "scale_o"):
        t[n] = graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"], attn_scale=1.0 / math.sqrt(d),
        generate_stats=False, name="sdpa_fp8")
    o.set_output(True).set_dim(dims).set_stride([h * s * d, *strides[3]]).set_data_type(e4m3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    t.update(o=o, amax_s=amax_s, amax_o=amax_o)
    graph.validate()
    return graph, t


def variant_pack(tensors: dict, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor,
                 descale_q: torch.Tensor, descale_k: torch.Tensor, consts: dict[str, torch.Tensor],
                 amax: torch.Tensor) -> dict:
    """Graph tensor -> buffer for every port of `declare_graph`'s graph (a missing one fails the execute).
    q4/k4/v4/o4 [1, H, S, D] e4m3 views with the declared geometry; descales [1, 1, 1, 1] or [1, H, 1, 1] fp32."""
    t = tensors
    return {t["q"]: q4, t["k"]: k4, t["v"]: v4, t["o"]: o4, t["descale_q"]: descale_q, t["descale_k"]: descale_k,
            t["descale_v"]: consts["one"], t["descale_s"]: consts["descale_s"], t["scale_s"]: consts["scale_s"],
            t["scale_o"]: consts["scale_o"], t["amax_s"]: amax[0], t["amax_o"]: amax[1]}


def scale_constants(device: torch.device | str) -> dict[str, torch.Tensor]:
    """The fixed scale tensors ([1, 1, 1, 1] fp32 on `device`): descale_v = 1 (V arrives in quantised units), the
    softmax numerator's scale_s / descale_s and O's scale_o (module constants above)."""
    def scalar(v):
        return torch.full((1, 1, 1, 1), v, dtype=torch.float32, device=device)
    return {"one": scalar(1.0), "scale_s": scalar(SOFTMAX_SCALE), "descale_s": scalar(1.0 / SOFTMAX_SCALE),
            "scale_o": scalar(OUTPUT_SCALE)}


class CudnnFp8Sdpa:
    """cuDNN fp8 SDPA plans, built on first use per `plan_key` and kept (LRU).

    One cuDNN handle per device, created on that device. Calls are serialised by a lock (a cuDNN handle must not
    be driven from two threads at once); each call points the handle at the caller's current CUDA stream first
    (`cudnn.set_stream`, a no-op when unchanged), so the kernel runs in stream order with the ops around it."""

    def __init__(self, cache_size: int = GRAPH_CACHE_SIZE):
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._handles: dict[int, object] = {}
        self._consts: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._cache_size = cache_size

    def _handle(self, device: torch.device):
        import cudnn

        if device.index not in self._handles:
            with torch.cuda.device(device):
                self._handles[device.index] = cudnn.create_handle()
        return self._handles[device.index]

    def _build(self, device: torch.device, key: tuple) -> _Plan:
        import cudnn

        _, h, s, d, strides, head_descales = key
        try:
            graph, tensors = declare_graph(cudnn, self._handle(device), h, s, d, strides, head_descales)
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            workspace = graph.get_workspace_size()
        except Exception as e:
            msg = (f"cuDNN {cudnn.backend_version_string()} (frontend {cudnn.__version__}) has no fp8 SDPA plan for "
                   f"heads={h} rows={s} head_dim={d} strides={strides}: {type(e).__name__}: {e}")
            log.warning("%s", msg)
            raise RuntimeError(msg) from e
        log.info("built cuDNN fp8 SDPA plan for heads=%d rows=%d head_dim=%d strides=%s (%d B workspace)", h, s, d,
                 strides, workspace)
        # At least one byte: a zero-size buffer has no address to hand over.
        return _Plan(graph, tensors, max(1, workspace), torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device))

    def _plan(self, device: torch.device, key: tuple) -> _Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build(device, key)
            while len(self._plans) > self._cache_size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor) -> torch.Tensor:
        """[H, S, D] e4m3 q8/k8/v8 (any layout with a unit stride on D; V in quantised units: descale_v = 1),
        descales [1] fp32 (or [H]: per-head descales, if this cuDNN accepts them) -> e4m3 O [H, S, D], laid out
        like q8, = softmax(q k^T / sqrt(D)) v * OUTPUT_SCALE."""
        import cudnn

        h, s, d = q8.shape
        device = q8.device
        q8, k8, v8 = (x if x.stride(-1) == 1 and _dense(x) else x.contiguous() for x in (q8, k8, v8))
        out = torch.empty_like(q8)  # keeps q8's (dense) layout, as the fake implementation does
        head_descales = descale_q.numel() > 1
        key = plan_key(device, q8, k8, v8, out, head_descales)
        shape = (1, h, 1, 1) if head_descales else (1, 1, 1, 1)
        with self._lock:
            if device.index not in self._consts:
                self._consts[device.index] = scale_constants(device)
            plan = self._plan(device, key)
            ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)
            # 4-D views with exactly the declared BHSD geometry (batch stride: the whole tensor).
            q4, k4, v4, o4 = (torch.as_strided(x, (1, h, s, d), (h * s * d, *x.stride())) for x in (q8, k8, v8, out))
            pack = variant_pack(plan.tensors, q4, k4, v4, o4, descale_q.float().reshape(shape),
                                descale_k.float().reshape(shape), self._consts[device.index], plan.amax)
            handle = self._handle(device)
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
            plan.graph.execute(pack, ws, handle=handle)
        return out


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (some permutation of a contiguous tensor): what empty_like keeps as is."""
    order = sorted(range(x.dim()), key=lambda i: x.stride(i))
    expect = 1
    for i in order:
        if x.size(i) != 1 and x.stride(i) != expect:
            return False
        expect *= x.size(i)
    return True


# One plan cache per process: the custom op below cannot carry Python state, and plans are per device/shape.
_CUDNN = CudnnFp8Sdpa()


@torch.library.custom_op("h3stages::sdpa_fp8", mutates_args=())
def sdpa_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
             descale_k: torch.Tensor) -> torch.Tensor:
    """cuDNN fp8 SDPA as a torch op (opaque to torch.compile, which fuses the quantisation around it)."""
    return _CUDNN(q8, k8, v8, descale_q, descale_k)


@sdpa_fp8.register_fake
def _(q8, k8, v8, descale_q, descale_k):
    return torch.empty_like(q8 if q8.stride(-1) == 1 and _dense(q8) else q8.contiguous())


# =====================================================================================================================
# The attention callable
# =====================================================================================================================


class Fp8Attention:
    """AttentionFn (minimax_h3/dit/model.py): (q, k, v) [1, H, S, D] -> o [1, H, S, D] in q's dtype, non-causal, 1/sqrt(D).

    On CUDA with Triton the quantisation is the two-pass Triton op (`quantize_qkv_triton`; one opaque op inside a
    compiled block too). Otherwise, and with `emulate=True` (the fp32 emulation of the kernel, any device), it is
    `quantize_qkv`. `compile_quant=True` compiles the torch quantisation (when used) and the dequantisation on
    their own (for eager models; inside a compiled block they are traced and fused with the surrounding ops).

    With `options.static_qk` the model may instead hand over q and k already in e4m3 (`takes_fp8_qk`,
    `attend_fp8_qk`); then only V is quantised here (module docstring, 4), and O may come back still in e4m3
    (`Fp8O`) for an fp8 out_proj to take its rows from (minimax_h3/kernels/fp8_rows.py `o_rows_fp8`).

    `kernel`: "cudnn" (cuDNN's fp8 SDPA, below) or "fa3" (FlashAttention-3's fp8 forward,
    minimax_h3/kernels/fa3_attention.py): the same quantised inputs; FA3 takes V's per-head scales as descales and
    writes O in bf16, which `Fp8O` carries with unit scales."""

    def __init__(self, options: Fp8AttentionOptions = DEFAULT_OPTIONS, emulate: bool = False,
                 compile_quant: bool = False, kernel: str = "cudnn"):
        if kernel not in FP8_KERNELS:
            raise ValueError(f"fp8 attention kernel must be one of {FP8_KERNELS}, got {kernel!r}")
        self.options = options
        self.emulate = emulate
        self.kernel = kernel
        self._quantize, self._quantize_v, self._dequantize = quantize_qkv, quantize_v, dequantize_o
        if compile_quant:
            # Dynamic shapes from the start: the start-up probe's sequence length is not a job's.
            self._quantize = torch.compile(quantize_qkv, dynamic=True)
            self._quantize_v = torch.compile(quantize_v, dynamic=True)
            self._dequantize = torch.compile(dequantize_o, dynamic=True)
        self.__name__ = (f"fp8_attention[{options.label}{', fa3' if kernel == 'fa3' else ''}"
                         f"{', emulated' if emulate else ''}]")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] < self.options.min_seq:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        tracing = torch.compiler.is_compiling()  # inside a compiled block: trace the plain ops and fuse them there
        q0, k0, v0 = q[0], k[0], v[0]
        if not self.emulate and triton_unsupported(q0, k0, v0) is None:
            p = quantize_qkv_triton(q0, k0, v0, self.options)
        else:
            p = self._run(quantize_qkv if tracing else self._quantize, quantize_qkv, q0, k0, v0, self.options)
        return self._attend(p, q.dtype)

    def block_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
        """The call a DiT block makes on these inputs [1, H, S, D], for the start-up probe to time: where the blocks
        hand q and k over in e4m3 (`takes_fp8_qk`), they are quantised here once with unit-gain static scales, as
        the q/k norm kernel writes them, and each call quantises V alone and keeps O as the kernel wrote it for an
        fp8 out_proj (`attend_fp8_qk`); otherwise the whole call."""
        if not self.takes_fp8_qk(q.shape[2]):
            return lambda: self(q, k, v)
        ones = torch.ones(q.shape[-1], device=q.device)
        mult = static_qk_mult(ones, ones)
        x = Fp8QKInput(_to_e4m3(torch.stack([q, k]).float(), None, mult.view(2, 1, 1, 1, 1)), v, mult)
        return lambda: self.attend_fp8_qk(x, keep_fp8_o=True)

    def takes_fp8_qk(self, rows: int) -> bool:
        """Whether a sequence of `rows` rows may come as `Fp8QKInput` (to `attend_fp8_qk`)."""
        return self.options.static_qk and rows >= self.options.min_seq

    def attend_fp8_qk(self, x: Fp8QKInput, keep_fp8_o: bool = False) -> torch.Tensor | Fp8O:
        """x: q, k in e4m3 with static multipliers, v [1, H, S, D] (compute dtype) -> o [1, H, S, D] in v's dtype,
        or (keep_fp8_o) the kernel's O with its scales and V's mean, not yet put together (`Fp8O`, o8 [H, S, D])."""
        v0 = x.v[0]
        if not self.emulate and triton_unsupported(v0, v0, v0) is None:
            v8, o_scale, o_shift = quantize_v_triton(v0, self.options)
        else:
            fn = quantize_v if torch.compiler.is_compiling() else self._quantize_v
            v8, o_scale, o_shift = self._run(fn, quantize_v, v0, self.options)
        descale = (1.0 / x.qk_mult).reshape(2, 1)
        p = Fp8QKV(x.qk8[0, 0], x.qk8[1, 0], v8, descale[0], descale[1], o_scale, o_shift)
        return self._attend(p, x.v.dtype, keep_fp8_o)

    def _attend(self, p: Fp8QKV, dtype: torch.dtype, keep_fp8_o: bool = False) -> torch.Tensor | Fp8O:
        """The kernel (or its emulation) on quantised inputs, then O back to `dtype`, [1, H, S, D] (or, keep_fp8_o,
        the kernel's O with its scales and V's mean as they are: `Fp8O`)."""
        dequantize = dequantize_o if torch.compiler.is_compiling() else self._dequantize
        if self.kernel == "fa3":
            from .fa3_attention import fa3_fp8, fa3_fp8_emulated

            o = (fa3_fp8_emulated if self.emulate else fa3_fp8)(p.q8, p.k8, p.v8, p.descale_q, p.descale_k,
                                                                 p.o_scale * OUTPUT_SCALE)  # = V's descale
            if p.o_shift is None and not keep_fp8_o:
                return o.to(dtype).unsqueeze(0)
            # V's mean back on, in fp32 as for cuDNN's O; FA3 applied V's scale already.
            o_scale = torch.ones(o.shape[0], 1, 1, dtype=torch.float32, device=o.device)
        else:
            o = (sdpa_fp8_emulated if self.emulate else sdpa_fp8)(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)
            o_scale = p.o_scale
        if keep_fp8_o:
            return Fp8O(o, o_scale, p.o_shift)
        return self._run(dequantize, dequantize_o, o, o_scale, p.o_shift, dtype).unsqueeze(0)

    def _run(self, fn, eager, *args):
        """fn(*args); if a standalone compilation fails, warn once and stay eager (same math, unfused)."""
        if fn is eager:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:  # a compiler failure on this machine must not take attention down
            log.warning("fp8 attention: compiling the q/k/v quantisation failed (%s: %s); running it eagerly",
                        type(e).__name__, str(e)[:300])
            self._quantize, self._quantize_v, self._dequantize = quantize_qkv, quantize_v, dequantize_o
            return eager(*args)
