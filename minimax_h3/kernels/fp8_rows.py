"""The DiT block's fused "something + fp8 row quantisation" Triton kernels (GPU), each with a plain-torch reference:
RMSNorm + AdaLN modulation before the qkv projection and fc1, the MLP's SwiGLU before fc2, and fp8 attention's O
dequantisation before out_proj.

What the modulation kernel fuses: before the qkv projection and fc1, every block turns the fp32 residual rows
x [rows, C] into `modulate(x) = (rms_norm(x, w) * (1 + scale[r]) + shift[r]).to(compute dtype)` (shift / scale: the
AdaLN rows [M * 3, C] fp32 gathered by each row's table index r). An fp8 linear (minimax_h3/kernels/registry.Fp8RowwiseLinear)
then quantises those rows per row (`quantize_fp8_rowwise`: scale = amax / 448, q = e4m3(row * bf16(1 / scale))).
This kernel reads x and the gathered AdaLN rows once (a row held as up to three power-of-two tiles, `row_tiles`) and
writes e4m3 rows plus one fp32 scale per row (`Fp8Rows`, which the fp8 linear takes as its input instead of a
tensor). It pays in eager blocks; inside a compiled block Inductor's own fusion of the same math is as fast, so the
fp8 linear's method (minimax_h3/kernels/layers.py Fp8RowsMethod) uses it only outside torch.compile
(docs/kernels.md, "Fused modulation + fp8 row quantisation").
With its ADD constant it first makes a block's deferred gated residual add, x += gate[r] * part, and writes x back
(`add_modulate_fp8`, custom op `h3stages::add_modulate_fp8_rows`; reference `add_modulate_fp8_reference` =
`gated_add`, then `modulate_fp8_reference`): x is read once where the add and the modulation each read it. That one
is no slower than Inductor's fusion of the two (faster on long sequences), so it also runs in compiled blocks.

`modulate_fp8` dispatches: the Triton kernel (the torch custom op `h3stages::modulate_fp8_rows`, opaque to
torch.compile) when x is on a CUDA device, triton imports and the arguments are ones it serves; otherwise
`modulate_fp8_reference`, which is exactly the plain method's math (minimax_h3/dit/ops.py `modulate`, which
minimax_h3/kernels/layers.py uses for bf16 rows, then `quantize_fp8_rowwise`). The kernel's fp32 arithmetic matches
the reference's operation for operation as torch runs them on CUDA (bf16 rounding of the modulated row, the
multiply by the bf16 reciprocal rounded to bf16, then e4m3) except for the order of the sum of squares, so a rare
element lands one e4m3 step away (tests/test_fp8_rows.py).

The SwiGLU kernel: the MLP computes fc2(silu(gate) * value) from fc1's bf16 output y [rows, 2F] = [gate | value];
when fc2 is an fp8 linear it quantises that bf16 product per row. `swiglu_fp8` (custom op
`h3stages::swiglu_fp8_rows`, dispatched as `modulate_fp8`; reference `swiglu_fp8_reference` = `swiglu` then
`quantize_fp8_rowwise`) reads each element of y once, a whole row per program in registers, and writes `Fp8Rows`.
Its arithmetic is the reference's as torch runs it on CUDA: silu = x / (1 + exp(-x)) in fp32 (CUDA's expf, an IEEE
division as `_div_rn` writes it out) rounded to bf16, the bf16 product rounded to bf16, then the same row
quantisation as the modulation kernel (`_row_scale`, `_store_q`). No reduction order enters the values (a max is
exact), so a difference can only come from libdevice's expf against the one torch is built with (and from gates
below -87.3, `_swiglu_fp8_kernel` says why not in practice); tests/test_fp8_rows.py bounds it as the modulation
kernel's. The fp8 fc2's method uses it in eager blocks and, as its `swiglu_in_compiled_blocks` says, in compiled
ones (there it beats Inductor's fusion of the same ops).

The O-rows kernel: fp8 attention (minimax_h3/kernels/fp8_attention.py) writes O [H, S, D], in e4m3 with a per-head
scale (cuDNN) or in bf16 with unit scales (FlashAttention-3), and the V-smoothing shift; the model dequantised it to
bf16 O = (o8 * o_scale + o_shift) in fp32, rounded to bf16, and the fp8 out_proj quantised its rows [rows, H * D]
(heads side by side) per row: two passes over a bf16 O, one of them transposing. `o_rows_fp8` (custom op
`h3stages::o_rows_fp8`, dispatched as `modulate_fp8`; reference `o_rows_fp8_reference` = `dequantize_o`, the rows,
then `quantize_fp8_rowwise`) reads each element of O once,
a whole output row (all heads) per program, and writes `Fp8Rows`; O may be a row slice of the whole O (any row and
head strides). Its arithmetic is the reference's as torch runs it on CUDA (the fp32 multiply and add, each rounded,
the bf16 rounding, then `_store_fp8_rows`), with no reduction order or library function in it: on a GPU it is
expected to match bit for bit, and tests/test_fp8_rows.py bounds it as the other kernels. fp8 attention hands O
over as its kernel wrote it to an fp8 out_proj (minimax_h3/kernels/layers.py Fp8AttentionInput /
Fp8AttentionOutput) in eager blocks and, as the out_proj method's `o_rows_in_compiled_blocks` says, in compiled ones.

Launch parameters (rows per program, warps) are per-device data: minimax_h3/kernels/tuning.json.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from minimax_h3.dit.ops import gated_add, modulate, swiglu

from .fp8 import FP8_E4M3_MAX, FP8_SCALE_FLOOR, Fp8Rows, quantize_fp8_rowwise
from .fp8_attention import dequantize_o
from .triton_ops import KernelFallback, interpreting, libdevice, log_once, tl, triton
from .tuning import launch_params

log = logging.getLogger(__name__)
_FALLBACK = KernelFallback("modulation + fp8 row quantisation", log)

MAX_CHANNELS = 16384  # a wider row would spill registers


def modulate_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor,
                           scale: torch.Tensor, r: torch.Tensor) -> Fp8Rows:
    """`modulate` in bf16, then `quantize_fp8_rowwise`: the previous two steps, in plain torch (any device)."""
    return Fp8Rows(*quantize_fp8_rowwise(modulate(x, weight, eps, shift, scale, r, torch.bfloat16)))


def unsupported(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                r: torch.Tensor) -> str | None:
    """Why the Triton kernel does not serve these arguments, or None when it does (shapes, dtypes, devices)."""
    if triton is None:
        return "triton is not installed"
    if x.dim() != 2 or x.dtype != torch.float32:
        return f"x must be fp32 [rows, C], got {x.dtype} {list(x.shape)}"
    rows, c = x.shape
    if not 16 <= c <= MAX_CHANNELS:
        return f"C must be in 16..{MAX_CHANNELS}, got {c}"
    if tuple(weight.shape) != (c,) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the norm gain must be [{c}] fp32/bf16/fp16, got {weight.dtype} {list(weight.shape)}"
    for name, t in (("shift", shift), ("scale", scale)):
        if t.dim() != 2 or t.shape[1] != c or t.dtype != torch.float32:
            return f"{name} must be fp32 [M * 3, {c}], got {t.dtype} {list(t.shape)}"
    if tuple(r.shape) != (rows,) or r.dtype not in (torch.int32, torch.int64):
        return f"r must be int32/int64 [{rows}], got {r.dtype} {list(r.shape)}"
    if any(t.device != x.device for t in (weight, shift, scale, r)):
        return "all tensors must be on x's device"
    if x.device.type != "cuda" and not interpreting(_modulate_fp8_kernel):
        return f"the kernel runs on CUDA devices (x is on {x.device})"
    return None


def modulate_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
                 r: torch.Tensor) -> Fp8Rows:
    """x [rows, C] fp32, norm gain [C], shift / scale [M * 3, C] fp32, r [rows] -> Fp8Rows (q [rows, C] e4m3,
    scale [rows, 1] fp32): the Triton kernel on CUDA where it serves the arguments, else the reference."""
    return _FALLBACK.dispatch(
        x.device, unsupported(x, weight, shift, scale, r) if x.is_cuda else "x is not on a CUDA device",
        lambda: Fp8Rows(*torch.ops.h3stages.modulate_fp8_rows(x, weight, eps, shift, scale, r)),
        lambda: modulate_fp8_reference(x, weight, eps, shift, scale, r))


@torch.library.custom_op("h3stages::modulate_fp8_rows", mutates_args=())
def modulate_fp8_rows_op(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor,
                         scale: torch.Tensor, r: torch.Tensor, block_rows: int | None = None,
                         num_warps: int | None = None,
                         programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel as a torch op (opaque to torch.compile): arguments as `launch`, returns (q, scale)."""
    return launch(x, weight, eps, shift, scale, r, block_rows, num_warps, programs_per_sm)


@modulate_fp8_rows_op.register_fake
def _(x, weight, eps, shift, scale, r, block_rows=None, num_warps=None, programs_per_sm=None):
    return _empty_rows(x, x.shape[0], x.shape[1])


# --- Gated residual add + modulation + fp8 row quantisation: a block's add made in the next modulation ----------

_ADD_FALLBACK = KernelFallback("gated residual add + modulation + fp8 row quantisation", log)


def add_modulate_fp8_reference(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, weight: torch.Tensor,
                               eps: float, shift: torch.Tensor, scale: torch.Tensor, r: torch.Tensor) -> Fp8Rows:
    """`gated_add` (x += gate[r] * part, in place), then `modulate_fp8_reference` of the new x: the previous two
    steps, in plain torch (any device)."""
    gated_add(x, gate, part, r)
    return modulate_fp8_reference(x, weight, eps, shift, scale, r)


def add_unsupported(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, weight: torch.Tensor,
                    shift: torch.Tensor, scale: torch.Tensor, r: torch.Tensor) -> str | None:
    """Why the kernel with the residual add does not serve these arguments, or None when it does."""
    reason = unsupported(x, weight, shift, scale, r)
    if reason is not None:
        return reason
    if gate.dim() != 2 or gate.shape[1] != x.shape[1] or gate.dtype != torch.float32:
        return f"gate must be fp32 [M * 3, {x.shape[1]}], got {gate.dtype} {list(gate.shape)}"
    if part.shape != x.shape or part.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"part must be fp32/bf16/fp16 {list(x.shape)}, got {part.dtype} {list(part.shape)}"
    if gate.device != x.device or part.device != x.device:
        return "all tensors must be on x's device"
    return None


def add_modulate_fp8(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, eps: float,
                     shift: torch.Tensor, scale: torch.Tensor, r: torch.Tensor) -> Fp8Rows:
    """x [rows, C] fp32 += gate[r] * part in place (gate [M * 3, C] fp32, part [rows, C]), then `modulate_fp8` of
    the new x -> Fp8Rows: the Triton kernel on CUDA where it serves the arguments (one pass over x), else the
    reference. The kernel writes x only once it runs: a build or launch failure leaves x as it was, for the
    reference to add to."""
    return _ADD_FALLBACK.dispatch(
        x.device, add_unsupported(x, gate, part, weight, shift, scale, r) if x.is_cuda else "x is not on a CUDA device",
        lambda: Fp8Rows(*torch.ops.h3stages.add_modulate_fp8_rows(x, gate, part, weight, eps, shift, scale, r)),
        lambda: add_modulate_fp8_reference(x, gate, part, weight, eps, shift, scale, r))


@torch.library.custom_op("h3stages::add_modulate_fp8_rows", mutates_args=("x",))
def add_modulate_fp8_rows_op(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, weight: torch.Tensor,
                             eps: float, shift: torch.Tensor, scale: torch.Tensor, r: torch.Tensor,
                             block_rows: int | None = None, num_warps: int | None = None,
                             programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel with the residual add as a torch op that writes x (opaque to torch.compile): arguments as
    `add_launch`."""
    return add_launch(x, gate, part, weight, eps, shift, scale, r, block_rows, num_warps, programs_per_sm)


@add_modulate_fp8_rows_op.register_fake
def _(x, gate, part, weight, eps, shift, scale, r, block_rows=None, num_warps=None, programs_per_sm=None):
    return _empty_rows(x, x.shape[0], x.shape[1])


def add_launch(x: torch.Tensor, gate: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, eps: float,
               shift: torch.Tensor, scale: torch.Tensor, r: torch.Tensor, block_rows: int | None = None,
               num_warps: int | None = None,
               programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the kernel with the residual add: as `launch`, with gate [M * 3, C] fp32 and part [rows, C] (any
    strides); x (any strides) is updated in place. Raises ValueError for arguments it does not serve
    (`add_unsupported`)."""
    reason = add_unsupported(x, gate, part, weight, shift, scale, r)
    if reason is not None:
        raise ValueError("the Triton gated residual add + modulation + fp8 quantisation kernel does not serve this "
                         f"call: {reason}")
    return _launch_modulate(x, weight, eps, shift, scale, r, (gate, part), "add_modulate_fp8_rows",
                            _ADD_FALLBACK.what, block_rows, num_warps, programs_per_sm)


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
           r: torch.Tensor, block_rows: int | None = None, num_warps: int | None = None,
           programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the kernel: x [rows, C] fp32 (any strides), gain [C], shift / scale [M * 3, C] fp32 (any strides, e.g.
    column chunks of the AdaLN output), r [rows] -> (q [rows, C] e4m3, scale [rows, 1] fp32), both new and
    contiguous. Raises ValueError for arguments it does not serve (`unsupported`); block_rows (rows per program, a
    power of two), num_warps and programs_per_sm (0: one program per row block; k: at most k programs per SM, each
    going through row blocks with the next block's loads in flight) tune the launch (`_grid`; None: the device's,
    minimax_h3/kernels/tuning.json)."""
    reason = unsupported(x, weight, shift, scale, r)
    if reason is not None:
        raise ValueError(f"the Triton modulation + fp8 quantisation kernel does not serve this call: {reason}")
    return _launch_modulate(x, weight, eps, shift, scale, r, None, "modulate_fp8_rows", _FALLBACK.what, block_rows,
                            num_warps, programs_per_sm)


def _launch_modulate(x, weight, eps, shift, scale, r, residual: tuple[torch.Tensor, torch.Tensor] | None, name: str,
                     what: str, block_rows: int | None, num_warps: int | None,
                     programs_per_sm: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The modulation kernel's launch, with the gated residual add (gate, part) first or without it (None)."""
    rows, c = x.shape
    gate, part = residual if residual is not None else (shift, x)  # (pointers the kernel never reads without ADD)
    return _launch_rows(_modulate_fp8_kernel, name, what, (x, weight, shift, scale, r, gate, part), rows, c,
                        (c, 1.0 / c, eps, *x.stride(), weight.stride(0), *shift.stride(), *scale.stride(),
                         r.stride(0), *gate.stride(), *part.stride()), block_rows, num_warps, tiled=True,
                        persistent=True, programs_per_sm=programs_per_sm, ADD=residual is not None)


def _sm_count(device: torch.device) -> int:
    """The device's SMs (one on the CPU, where Triton interprets)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


MIN_TILE = 256  # the narrowest tile a row is split into: one element per thread at 8 warps


def row_tiles(width: int) -> tuple[int, int, int]:
    """The tiles a kernel holds a row of `width` channels in: up to three power-of-two widths of at least MIN_TILE
    that add up to the row exactly, largest first (5376 = 4096 + 1024 + 256, 6144 = 4096 + 2048 + 0), where one
    power-of-two tile pads the row (5376 in 8192 lanes: a third of the registers a kernel keeps rows in hold
    nothing, and fewer rows are in flight per SM; docs/kernels.md, "Rows as three tiles"). A width that does not
    split so is one tile padded to a power of two: (1024, 0, 0) for 640."""
    tiles, rest = [], width
    while rest >= MIN_TILE and len(tiles) < 3:
        tiles.append(1 << (rest.bit_length() - 1))
        rest -= tiles[-1]
    if rest or not tiles:
        return 1 << (max(width, 16) - 1).bit_length(), 0, 0
    return tuple(tiles + [0] * (3 - len(tiles)))


def _launch_rows(kernel, name: str, what: str, inputs: tuple, rows: int, width: int, args: tuple,
                 block_rows: int | None, num_warps: int | None, tiled: bool = False, persistent: bool = False,
                 programs_per_sm: int | None = None, **meta) -> tuple[torch.Tensor, torch.Tensor]:
    """The three row kernels' launch: allocates their outputs (`_empty_rows` [rows, width], on the first input's
    device) and runs `kernel(*inputs, q, q_scale, rows, *args)` over `_grid` with the shared constants (e4m3 range,
    scale floor, BLOCK_R = block_rows; `tiled`: the row's tiles T0 / T1 / T2 = `row_tiles(width)`, else BLOCK_C =
    width padded to a power of two) and `meta`. `persistent`: the kernel has a PERSISTENT launch, taken where
    programs_per_sm > 0 (at most that many programs per SM, each looping over row blocks). block_rows / num_warps /
    programs_per_sm None: the device's tuned ones (tuning.json entry `name`). No FMA contraction
    (enable_fp_fusion=False): products and sums round as the references' separate ops do."""
    like = inputs[0]
    tuned = launch_params(name, like.device)
    block_rows = tuned["block_rows"] if block_rows is None else block_rows
    num_warps = tuned["num_warps"] if num_warps is None else num_warps
    if persistent:
        programs_per_sm = tuned["programs_per_sm"] if programs_per_sm is None else programs_per_sm
        if programs_per_sm < 0:
            raise ValueError(f"programs_per_sm must be >= 0, got {programs_per_sm}")
        meta["PERSISTENT"] = programs_per_sm > 0
    q, q_scale = _empty_rows(like, rows, width)
    if rows == 0:
        return q, q_scale
    grid = _grid(rows, block_rows)
    if persistent and programs_per_sm > 0:
        grid = (min(grid[0], programs_per_sm * _sm_count(like.device)),)
    log_once(log, f"{what}: Triton kernel ({block_rows} rows x {num_warps} warps per program"
                  f"{f', {grid[0]} programs looping over the rows' if meta.get('PERSISTENT') else ''})")
    if tiled:
        meta.update(zip(("T0", "T1", "T2"), row_tiles(width)))
    else:
        meta["BLOCK_C"] = triton.next_power_of_2(width)
    with torch.cuda.device(like.device) if like.is_cuda else contextlib.nullcontext():  # Triton: the current device
        kernel[grid](*inputs, q, q_scale, rows, *args, FP8_MAX=FP8_E4M3_MAX, INV_FP8_MAX=1.0 / FP8_E4M3_MAX,
                     SCALE_FLOOR=FP8_SCALE_FLOOR, BLOCK_R=block_rows, num_warps=num_warps, enable_fp_fusion=False,
                     **meta)
    return q, q_scale


def _empty_rows(like: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every kernel's outputs, new and contiguous on like's device: q [rows, width] e4m3 and scale [rows, 1] fp32
    (`Fp8Rows`); also what the ops' fake implementations return."""
    return (like.new_empty((rows, width), dtype=torch.float8_e4m3fn),
            like.new_empty((rows, 1), dtype=torch.float32))


def _grid(rows: int, block_rows: int) -> tuple[int]:
    """The kernels' launch grid: one program per block of `block_rows` rows (a power of two)."""
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    return (triton.cdiv(rows, block_rows),)


# --- SwiGLU + fp8 row quantisation: the MLP's silu(gate) * value, handed to an fp8 fc2 -----------------------------

_SWIGLU_FALLBACK = KernelFallback("SwiGLU + fp8 row quantisation", log)


def swiglu_fp8_reference(y: torch.Tensor) -> Fp8Rows:
    """`swiglu` in y's dtype (bf16), then `quantize_fp8_rowwise`: the previous two steps, in plain torch."""
    return Fp8Rows(*quantize_fp8_rowwise(swiglu(y)))


def swiglu_unsupported(y: torch.Tensor) -> str | None:
    """Why the Triton SwiGLU kernel does not serve y, or None when it does (shape, dtype, strides, device)."""
    if triton is None:
        return "triton is not installed"
    if y.dim() != 2 or y.dtype != torch.bfloat16 or y.shape[1] % 2:
        return f"y must be bf16 [rows, 2F], got {y.dtype} {list(y.shape)}"
    if not 16 <= y.shape[1] // 2 <= MAX_CHANNELS:
        return f"F must be in 16..{MAX_CHANNELS}, got {y.shape[1] // 2}"
    if y.stride(1) != 1:
        return f"y's columns must be contiguous (column stride 1), got strides {list(y.stride())}"
    if y.device.type != "cuda" and not interpreting(_swiglu_fp8_kernel):
        return f"the kernel runs on CUDA devices (y is on {y.device})"
    return None


def swiglu_fp8(y: torch.Tensor) -> Fp8Rows:
    """y [rows, 2F] bf16 = [gate | value] -> Fp8Rows of silu(gate) * value (q [rows, F] e4m3, scale [rows, 1]
    fp32): the Triton kernel on CUDA where it serves y, else the reference."""
    return _SWIGLU_FALLBACK.dispatch(
        y.device, swiglu_unsupported(y) if y.is_cuda else "y is not on a CUDA device",
        lambda: Fp8Rows(*torch.ops.h3stages.swiglu_fp8_rows(y)), lambda: swiglu_fp8_reference(y))


@torch.library.custom_op("h3stages::swiglu_fp8_rows", mutates_args=())
def swiglu_fp8_rows_op(y: torch.Tensor, block_rows: int | None = None,
                       num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton SwiGLU kernel as a torch op (opaque to torch.compile): arguments as `swiglu_launch`."""
    return swiglu_launch(y, block_rows, num_warps)


@swiglu_fp8_rows_op.register_fake
def _(y, block_rows=None, num_warps=None):
    return _empty_rows(y, y.shape[0], y.shape[1] // 2)


def swiglu_launch(y: torch.Tensor, block_rows: int | None = None,
                  num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the kernel: y [rows, 2F] bf16 (any row stride, e.g. a view; contiguous columns) -> (q [rows, F] e4m3,
    scale [rows, 1] fp32), both new and contiguous. Raises ValueError for arguments it does not serve
    (`swiglu_unsupported`); block_rows and num_warps tune the launch (`_grid`)."""
    reason = swiglu_unsupported(y)
    if reason is not None:
        raise ValueError(f"the Triton SwiGLU + fp8 quantisation kernel does not serve this call: {reason}")
    rows, f = y.shape[0], y.shape[1] // 2
    return _launch_rows(_swiglu_fp8_kernel, "swiglu_fp8_rows", _SWIGLU_FALLBACK.what, (y,), rows, f,
                        (f, y.stride(0)), block_rows, num_warps, CUDA=not interpreting(_swiglu_fp8_kernel))


if triton is not None:

    @triton.jit
    def _div_rn(a, b, CUDA: tl.constexpr):
        """a / b as torch's CUDA kernels divide (IEEE, round to nearest even), for b in [1, 2^126) and a finite,
        nonzero a (callers handle the rest). On CUDA: the instruction sequence of the fast path that IEEE division
        (`div.rn`) compiles to (approximate reciprocal, one Newton step, the quotient and one correction, all FMAs)
        without the range check and slow-path call around it, which operands in that range never take. That call,
        one per element, took the SwiGLU kernel from 32 to 96 registers per thread at 1x16 (sm_90,
        benchmarks/kernel_registers.py): one row in flight per SM instead of four. tests/test_fp8_rows.py checks the
        sequence against IEEE division over that range. In the CPU interpreter (CUDA False): div_rn."""
        if CUDA:
            r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b], dtype=tl.float32,
                                          is_pure=True, pack=1)
            r = tl.fma(tl.fma(-b, r, 1.0), r, r)
            q = a * r
            q = tl.fma(tl.fma(-b, q, a), r, q)
        else:
            q = tl.math.div_rn(a, b)
        return q

    @triton.jit
    def _row_block(blk, rows, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """The one-tile kernels' row block `blk`: its BLOCK_R rows (int64 indices) and the BLOCK_C channels, with
        their bounds: row_ok [BLOCK_R], c_ok [BLOCK_C] and mask [BLOCK_R, BLOCK_C]."""
        row = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        ch = tl.arange(0, BLOCK_C)
        row_ok = row < rows
        c_ok = ch < C
        return row.to(tl.int64), ch, row_ok, c_ok, row_ok[:, None] & c_ok[None, :]

    @triton.jit
    def _row_scale(amax, INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr):
        """Rows' fp8 scales from their fp32 amax [BLOCK_R], `quantize_fp8_rowwise` op for op: scale = max(amax /
        448, floor) (torch's CUDA division by a Python number multiplies by its fp32 reciprocal) and the multiplier
        bf16(1 / scale) (an IEEE reciprocal rounded to bf16), as fp32."""
        q_scale = tl.maximum(amax * INV_FP8_MAX, SCALE_FLOOR)
        inv = tl.math.div_rn(tl.full(q_scale.shape, 1.0, tl.float32), q_scale).to(tl.bfloat16).to(tl.float32)
        return q_scale, inv

    @triton.jit
    def _store_q(y, inv, mask, row, ch, C, q_ptr, FP8_MAX: tl.constexpr):
        """e4m3(clamp(bf16(y * inv))) of bf16 rows y [BLOCK_R, W] into q [rows, C] (contiguous) at channels ch."""
        p = (y.to(tl.float32) * inv[:, None]).to(tl.bfloat16).to(tl.float32)
        p = tl.minimum(tl.maximum(p, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row[:, None] * C + ch[None, :], p.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _store_fp8_rows(y, mask, row, row_ok, ch, C, q_ptr, qs_ptr, FP8_MAX: tl.constexpr,
                        INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr):
        """The epilogue of the one-tile kernels (SwiGLU, O rows), `quantize_fp8_rowwise` of bf16 rows op for op: y
        [BLOCK_R, BLOCK_C] bf16 (kept in bf16 until here: half the registers of fp32 across the row reduction), row /
        row_ok [BLOCK_R] (int64 row indices), ch [BLOCK_C] -> e4m3 rows q [rows, C] (contiguous) and their fp32
        scales qs [rows]."""
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1).to(tl.float32)  # the bf16 max is exact
        q_scale, inv = _row_scale(amax, INV_FP8_MAX, SCALE_FLOOR)
        _store_q(y, inv, mask, row, ch, C, q_ptr, FP8_MAX)
        tl.store(qs_ptr + row, q_scale, mask=row_ok)

    @triton.jit
    def _store_q_tile(y, inv, row, row_ok, C, q_ptr, OFF: tl.constexpr, W: tl.constexpr, FP8_MAX: tl.constexpr):
        """`_store_q` of one tile: bf16 rows y [BLOCK_R, W] at channels [OFF, OFF + W)."""
        ch = OFF + tl.arange(0, W)
        _store_q(y, inv, row_ok[:, None] & (ch < C)[None, :], row, ch, C, q_ptr, FP8_MAX)

    @triton.jit
    def _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R: tl.constexpr,
                       OFF: tl.constexpr, W: tl.constexpr, ADD: tl.constexpr):
        """Channels [OFF, OFF + W) of the rows: x, and with ADD part in its own dtype; W = 0 (no such tile) or no
        ADD: an unused [BLOCK_R, 1] zero. Both stream through once (evict_first)."""
        x = tl.zeros((BLOCK_R, 1), tl.float32)
        part = tl.zeros((BLOCK_R, 1), tl.float32)
        if W > 0:
            ch = OFF + tl.arange(0, W)
            mask = row_ok[:, None] & (ch < C)[None, :]
            x = tl.load(x_ptr + row[:, None] * x_s_row + ch[None, :] * x_s_c, mask=mask, other=0.0,
                        eviction_policy="evict_first")
            if ADD:
                part = tl.load(part_ptr + row[:, None] * p_s_row + ch[None, :] * p_s_c, mask=mask, other=0.0,
                               eviction_policy="evict_first")
        return x, part

    @triton.jit
    def _modulate_load_block(x_ptr, part_ptr, blk, rows, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R: tl.constexpr,
                             T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, ADD: tl.constexpr):
        """The three tiles of row block `blk` (`_modulate_load` each; a block past the last: masked, nothing read)."""
        row = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = row < rows
        row = row.to(tl.int64)
        x0, p0 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R, 0, T0, ADD)
        x1, p1 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R, T0, T1,
                                ADD)
        x2, p2 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R, T0 + T1,
                                T2, ADD)
        return x0, p0, x1, p1, x2, p2

    @triton.jit
    def _modulate_tile_x(x, part, x_ptr, gate_ptr, row, row_ok, ada, C, x_s_row, x_s_c, g_s_row, g_s_c,
                         OFF: tl.constexpr, W: tl.constexpr, ADD: tl.constexpr):
        """A loaded tile (`_modulate_load`; with ADD, after the gated residual add x += gate[r] * part, written
        back: the fp32 product, part being exact in fp32, then the fp32 sum) and its sum of squares per row. The
        AdaLN rows every program gathers stay cached (evict_last): otherwise the streaming rows push them out of L1
        and each program fetches them again from L2 (docs/kernels.md, "With the gated residual add")."""
        if ADD:
            ch = OFF + tl.arange(0, W)
            mask = row_ok[:, None] & (ch < C)[None, :]
            gate = tl.load(gate_ptr + ada * g_s_row + ch[None, :] * g_s_c, mask=mask, other=0.0,
                           eviction_policy="evict_last")
            x = x + gate * part.to(tl.float32)
            tl.store(x_ptr + row[:, None] * x_s_row + ch[None, :] * x_s_c, x, mask=mask)
        return x, tl.sum(x * x, axis=1)

    @triton.jit
    def _modulate_tile_y(x, rstd, w_ptr, shift_ptr, scale_ptr, row_ok, ada, C, w_s, sh_s_row, sh_s_c, sc_s_row,
                         sc_s_c, OFF: tl.constexpr, W: tl.constexpr):
        """The same channels modulated, rms_norm(x) * (1 + scale[r]) + shift[r] rounded to bf16 as the reference
        emits it, and their absolute maximum per row."""
        ch = OFF + tl.arange(0, W)
        c_ok = ch < C
        mask = row_ok[:, None] & c_ok[None, :]
        gain = tl.load(w_ptr + ch * w_s, mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        shift = tl.load(shift_ptr + ada * sh_s_row + ch[None, :] * sh_s_c, mask=mask, other=0.0,
                        eviction_policy="evict_last")
        scale = tl.load(scale_ptr + ada * sc_s_row + ch[None, :] * sc_s_c, mask=mask, other=0.0,
                        eviction_policy="evict_last")
        y = (x * rstd * gain * (1.0 + scale) + shift).to(tl.bfloat16)
        return y, tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)

    @triton.jit
    def _modulate_rows(x0, p0, x1, p1, x2, p2, blk, x_ptr, w_ptr, shift_ptr, scale_ptr, r_ptr, gate_ptr, part_ptr,
                       q_ptr, qs_ptr, rows, C, inv_c, eps, x_s_row, x_s_c, w_s, sh_s_row, sh_s_c, sc_s_row, sc_s_c,
                       r_s, g_s_row, g_s_c, p_s_row, p_s_c, ADD: tl.constexpr, FP8_MAX: tl.constexpr,
                       INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr,
                       T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, LOADED: tl.constexpr):
        """Row block `blk`: every step is one op of the reference (`modulate_fp8_reference`, with ADD
        `add_modulate_fp8_reference`), in its order. LOADED: its tiles are x0 / p0 ... (`_modulate_load`); else
        each tile is loaded as step 0 reaches it (fewer registers live at once)."""
        row = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = row < rows
        row = row.to(tl.int64)
        ada = tl.load(r_ptr + row * r_s, mask=row_ok, other=0).to(tl.int64)[:, None]  # AdaLN table row
        # 0. The gated residual add (ADD), tile by tile, and each tile's sum of squares. A width of zero: no such
        #    tile (compiled out).
        if not LOADED:
            x0, p0 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R, 0, T0,
                                    ADD)
        x0, sumsq = _modulate_tile_x(x0, p0, x_ptr, gate_ptr, row, row_ok, ada, C, x_s_row, x_s_c, g_s_row, g_s_c,
                                     0, T0, ADD)
        if T1 > 0:
            if not LOADED:
                x1, p1 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R, T0,
                                        T1, ADD)
            x1, s1 = _modulate_tile_x(x1, p1, x_ptr, gate_ptr, row, row_ok, ada, C, x_s_row, x_s_c, g_s_row,
                                      g_s_c, T0, T1, ADD)
            sumsq = sumsq + s1
        if T2 > 0:
            if not LOADED:
                x2, p2 = _modulate_load(x_ptr, part_ptr, row, row_ok, C, x_s_row, x_s_c, p_s_row, p_s_c, BLOCK_R,
                                        T0 + T1, T2, ADD)
            x2, s2 = _modulate_tile_x(x2, p2, x_ptr, gate_ptr, row, row_ok, ada, C, x_s_row, x_s_c, g_s_row,
                                      g_s_c, T0 + T1, T2, ADD)
            sumsq = sumsq + s2
        # 1. RMSNorm in fp32 (`rms_norm`: x * rsqrt(mean(x^2) + eps) * gain; the mean as torch's CUDA reduction
        #    takes it, sum * fp32(1 / C)), then the modulation, rounded to bf16, and the row's absolute maximum.
        rstd = tl.math.rsqrt(sumsq * inv_c + eps)[:, None]
        y0, amax = _modulate_tile_y(x0, rstd, w_ptr, shift_ptr, scale_ptr, row_ok, ada, C, w_s, sh_s_row, sh_s_c,
                                    sc_s_row, sc_s_c, 0, T0)
        if T1 > 0:
            y1, a1 = _modulate_tile_y(x1, rstd, w_ptr, shift_ptr, scale_ptr, row_ok, ada, C, w_s, sh_s_row, sh_s_c,
                                      sc_s_row, sc_s_c, T0, T1)
            amax = tl.maximum(amax, a1)
        if T2 > 0:
            y2, a2 = _modulate_tile_y(x2, rstd, w_ptr, shift_ptr, scale_ptr, row_ok, ada, C, w_s, sh_s_row, sh_s_c,
                                      sc_s_row, sc_s_c, T0 + T1, T2)
            amax = tl.maximum(amax, a2)
        # 2. The row quantisation (the bf16 max is exact), tile by tile.
        q_scale, inv = _row_scale(amax.to(tl.float32), INV_FP8_MAX, SCALE_FLOOR)
        _store_q_tile(y0, inv, row, row_ok, C, q_ptr, 0, T0, FP8_MAX)
        if T1 > 0:
            _store_q_tile(y1, inv, row, row_ok, C, q_ptr, T0, T1, FP8_MAX)
        if T2 > 0:
            _store_q_tile(y2, inv, row, row_ok, C, q_ptr, T0 + T1, T2, FP8_MAX)
        tl.store(qs_ptr + row, q_scale, mask=row_ok)

    @triton.jit
    def _modulate_fp8_kernel(x_ptr, w_ptr, shift_ptr, scale_ptr, r_ptr, gate_ptr, part_ptr, q_ptr, qs_ptr, rows, C,
                             inv_c, eps, x_s_row, x_s_c, w_s, sh_s_row, sh_s_c, sc_s_row, sc_s_c, r_s, g_s_row,
                             g_s_c, p_s_row, p_s_c, ADD: tl.constexpr, FP8_MAX: tl.constexpr,
                             INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr,
                             T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, PERSISTENT: tl.constexpr):
        """BLOCK_R whole rows at a time, each with its own AdaLN rows (gathered by r), held as tiles of T0, T1 and
        T2 channels (`row_tiles`; 0: no such tile). ADD: the gated residual add first, written back to x.
        PERSISTENT: a program takes row blocks pid, pid + programs, ... and loads the next block's tiles before it
        works on the current one, so its loads are in flight while it computes and stores; else one program per
        row block."""
        pid = tl.program_id(0)
        if PERSISTENT:
            programs = tl.num_programs(0)
            x0, p0, x1, p1, x2, p2 = _modulate_load_block(x_ptr, part_ptr, pid, rows, C, x_s_row, x_s_c, p_s_row,
                                                          p_s_c, BLOCK_R, T0, T1, T2, ADD)
            for blk in range(pid, tl.cdiv(rows, BLOCK_R), programs):
                c0, d0, c1, d1, c2, d2 = x0, p0, x1, p1, x2, p2
                x0, p0, x1, p1, x2, p2 = _modulate_load_block(x_ptr, part_ptr, blk + programs, rows, C, x_s_row,
                                                              x_s_c, p_s_row, p_s_c, BLOCK_R, T0, T1, T2, ADD)
                _modulate_rows(c0, d0, c1, d1, c2, d2, blk, x_ptr, w_ptr, shift_ptr, scale_ptr, r_ptr, gate_ptr,
                               part_ptr, q_ptr, qs_ptr, rows, C, inv_c, eps, x_s_row, x_s_c, w_s, sh_s_row, sh_s_c,
                               sc_s_row, sc_s_c, r_s, g_s_row, g_s_c, p_s_row, p_s_c, ADD, FP8_MAX, INV_FP8_MAX,
                               SCALE_FLOOR, BLOCK_R, T0, T1, T2, True)
        else:
            unused = tl.zeros((BLOCK_R, 1), tl.float32)
            _modulate_rows(unused, unused, unused, unused, unused, unused, pid, x_ptr, w_ptr, shift_ptr, scale_ptr,
                           r_ptr, gate_ptr, part_ptr, q_ptr, qs_ptr, rows, C, inv_c, eps, x_s_row, x_s_c, w_s,
                           sh_s_row, sh_s_c, sc_s_row, sc_s_c, r_s, g_s_row, g_s_c, p_s_row, p_s_c, ADD, FP8_MAX,
                           INV_FP8_MAX, SCALE_FLOOR, BLOCK_R, T0, T1, T2, False)

    @triton.jit
    def _swiglu_fp8_kernel(y_ptr, q_ptr, qs_ptr, rows, C, y_s_row, FP8_MAX: tl.constexpr,
                           INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr, CUDA: tl.constexpr):
        """One program: BLOCK_R whole rows of y = [gate | value] (C = F channels each), each element read once.
        Every step is one op of `swiglu_fp8_reference` as torch runs it on CUDA, in its order."""
        row, ch, row_ok, _, mask = _row_block(tl.program_id(0), rows, C, BLOCK_R, BLOCK_C)
        at = y_ptr + row[:, None] * y_s_row + ch[None, :]
        gate = tl.load(at, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        value = tl.load(at + C, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # 1. F.silu on bf16: x / (1 + exp(-x)) in fp32 (CUDA's expf, as libdevice has it; tl.exp would be the
        #    approximate ex2 instruction; the CPU interpreter has no libdevice), an IEEE division, rounded to bf16;
        #    then the product of two bf16 values, rounded to bf16. Outside `_div_rn`'s range, x * 0 (a zero of x's
        #    sign): exact for x = +-0; for x < -87.3 (1 + exp(-x) >= 2^126) torch's silu is below 1.2e-36 in
        #    magnitude, whose product quantises to an e4m3 zero of the same sign unless its value exceeds 1e20.
        #    (Handling those exactly cost 8 registers per thread and 16 % more instructions.)
        if CUDA:
            e = libdevice.exp(-gate)
        else:
            e = tl.exp(-gate)
        d = 1.0 + e
        silu = tl.where((d < 8.507059173023462e37) & (gate != 0.0), _div_rn(gate, d, CUDA), gate * 0.0)
        silu = silu.to(tl.bfloat16).to(tl.float32)
        y = (silu * value).to(tl.bfloat16)
        # 2. The row quantisation.
        _store_fp8_rows(y, mask, row, row_ok, ch, C, q_ptr, qs_ptr, FP8_MAX, INV_FP8_MAX, SCALE_FLOOR)


# --- O dequantisation + fp8 row quantisation: fp8 attention's O, handed to an fp8 out_proj ------------------------

_O_ROWS_FALLBACK = KernelFallback("O dequantisation + fp8 row quantisation", log)


def o_rows_fp8_reference(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None) -> Fp8Rows:
    """The previous three steps in plain torch (any device): fp8 attention's `dequantize_o` to bf16, the rows of
    all heads side by side (minimax_h3/kernels/layers.py, the plain method's `apply_fp8_o`), then
    `quantize_fp8_rowwise`.
    o8 [H, rows, D] e4m3 or bf16, o_scale [H, 1, 1] fp32, o_shift [H, 1, D] fp32 or None -> Fp8Rows (q [rows,
    H * D])."""
    h, rows, d = o8.shape
    o = dequantize_o(o8, o_scale, o_shift, torch.bfloat16)
    return Fp8Rows(*quantize_fp8_rowwise(o.transpose(0, 1).reshape(rows, h * d)))


def o_rows_unsupported(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None) -> str | None:
    """Why the Triton O-rows kernel does not serve these arguments, or None when it does (shapes, dtypes, strides,
    devices)."""
    if triton is None:
        return "triton is not installed"
    if o8.dim() != 3 or o8.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        return f"o8 must be e4m3 or bf16 [H, rows, D], got {o8.dtype} {list(o8.shape)}"
    h, _, d = o8.shape
    if not 16 <= h * d <= MAX_CHANNELS:
        return f"H * D must be in 16..{MAX_CHANNELS}, got {h} * {d}"
    if o8.stride(2) != 1:
        return f"o8's last dimension must be contiguous (stride 1), got strides {list(o8.stride())}"
    if tuple(o_scale.shape) != (h, 1, 1) or o_scale.dtype != torch.float32:
        return f"o_scale must be fp32 [{h}, 1, 1], got {o_scale.dtype} {list(o_scale.shape)}"
    if o_shift is not None and (tuple(o_shift.shape) != (h, 1, d) or o_shift.dtype != torch.float32):
        return f"o_shift must be None or fp32 [{h}, 1, {d}], got {o_shift.dtype} {list(o_shift.shape)}"
    if any(t is not None and t.device != o8.device for t in (o_scale, o_shift)):
        return "all tensors must be on o8's device"
    if o8.device.type != "cuda" and not interpreting(_o_rows_fp8_kernel):
        return f"the kernel runs on CUDA devices (o8 is on {o8.device})"
    return None


def o_rows_fp8(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None) -> Fp8Rows:
    """o8 [H, rows, D] e4m3 or bf16 (fp8 attention's O, or a row slice of it), o_scale [H, 1, 1], o_shift
    [H, 1, D] or None -> Fp8Rows (q [rows, H * D] e4m3, scale [rows, 1] fp32) of the dequantised bf16 O's rows,
    heads side by side: the Triton kernel on CUDA where it serves the arguments, else the reference."""
    return _O_ROWS_FALLBACK.dispatch(
        o8.device, o_rows_unsupported(o8, o_scale, o_shift) if o8.is_cuda else "o8 is not on a CUDA device",
        lambda: Fp8Rows(*torch.ops.h3stages.o_rows_fp8(o8, o_scale, o_shift)),
        lambda: o_rows_fp8_reference(o8, o_scale, o_shift))


@torch.library.custom_op("h3stages::o_rows_fp8", mutates_args=())
def o_rows_fp8_op(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None,
                  block_rows: int | None = None, num_warps: int | None = None,
                  programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton O-rows kernel as a torch op (opaque to torch.compile): arguments as `o_rows_launch`."""
    return o_rows_launch(o8, o_scale, o_shift, block_rows, num_warps, programs_per_sm)


@o_rows_fp8_op.register_fake
def _(o8, o_scale, o_shift, block_rows=None, num_warps=None, programs_per_sm=None):
    h, rows, d = o8.shape
    return _empty_rows(o8, rows, h * d)


def o_rows_launch(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None,
                  block_rows: int | None = None, num_warps: int | None = None,
                  programs_per_sm: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the kernel: o8 [H, rows, D] e4m3 or bf16 (any head and row strides, e.g. a row slice of the whole O;
    contiguous D), o_scale [H, 1, 1] / o_shift [H, 1, D] fp32 (any strides) or None -> (q [rows, H * D] e4m3,
    scale [rows, 1] fp32), both new and contiguous. Raises ValueError for arguments it does not serve
    (`o_rows_unsupported`); block_rows, num_warps and programs_per_sm tune the launch as `launch`'s do."""
    reason = o_rows_unsupported(o8, o_scale, o_shift)
    if reason is not None:
        raise ValueError(f"the Triton O dequantisation + fp8 quantisation kernel does not serve this call: {reason}")
    h, rows, d = o8.shape
    # The head scales repeated over each head's D columns ([H, D], 28 KiB at the DiT's width; one small copy): the
    # kernel loads them like the shift, contiguous along D. A per-head gather instead gets a layout of its own that
    # the GPU image's Triton 3.6 converts through shared memory, 24 % more instructions at 1x8 (sm_90 SASS).
    col_scale = o_scale.reshape(h, 1).expand(h, d).contiguous()
    shift = col_scale[:, None] if o_shift is None else o_shift  # (a pointer the kernel never reads without a shift)
    return _launch_rows(_o_rows_fp8_kernel, "o_rows_fp8", _O_ROWS_FALLBACK.what, (o8, col_scale, shift), rows, h * d,
                        (h * d, o8.stride(0), o8.stride(1), shift.stride(0), shift.stride(2)), block_rows, num_warps,
                        persistent=True, programs_per_sm=programs_per_sm, D=d, HAS_SHIFT=o_shift is not None)


if triton is not None:

    @triton.jit
    def _o_rows_load(o8_ptr, blk, rows, C, o_s_h, o_s_row, D: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        """Row block `blk` of O as its kernel wrote it (e4m3 or bf16), output columns ch = head * D + d."""
        row, ch, _, _, mask = _row_block(blk, rows, C, BLOCK_R, BLOCK_C)
        head = (ch // D).to(tl.int64)[None, :]
        return tl.load(o8_ptr + head * o_s_h + row[:, None] * o_s_row + (ch % D)[None, :], mask=mask, other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def _o_rows_block(o8, blk, sc_ptr, sh_ptr, q_ptr, qs_ptr, rows, C, sh_s_h, sh_s_d, D: tl.constexpr,
                      HAS_SHIFT: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                      SCALE_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Row block `blk` from its loaded O (`_o_rows_load`). Every step is one op of `o_rows_fp8_reference` as
        torch runs it on CUDA, in its order."""
        row, ch, row_ok, c_ok, mask = _row_block(blk, rows, C, BLOCK_R, BLOCK_C)
        # Output column ch = head * D + d. The scales and the shift are loaded as [1, BLOCK_C] tiles, in the layout
        # of the rows they serve (loaded as vectors, each took a layout conversion through shared memory).
        head = (ch // D).to(tl.int64)[None, :]
        d = (ch % D)[None, :]
        c_ok = c_ok[None, :]
        # 1. `dequantize_o`: e4m3 or bf16 -> fp32 (exact), times the head's scale (fp32), plus the shift (fp32), each
        #    rounded on its own, then rounded to bf16. The per-head scale and shift rows serve all BLOCK_R rows.
        o_scale = tl.load(sc_ptr + ch[None, :], mask=c_ok, other=0.0)
        o = o8.to(tl.float32) * o_scale
        if HAS_SHIFT:
            o = o + tl.load(sh_ptr + head * sh_s_h + d * sh_s_d, mask=c_ok, other=0.0)
        # 2. The row quantisation.
        _store_fp8_rows(o.to(tl.bfloat16), mask, row, row_ok, ch, C, q_ptr, qs_ptr, FP8_MAX, INV_FP8_MAX,
                        SCALE_FLOOR)

    @triton.jit
    def _o_rows_fp8_kernel(o8_ptr, sc_ptr, sh_ptr, q_ptr, qs_ptr, rows, C, o_s_h, o_s_row, sh_s_h, sh_s_d,
                           D: tl.constexpr, HAS_SHIFT: tl.constexpr, FP8_MAX: tl.constexpr,
                           INV_FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr, PERSISTENT: tl.constexpr):
        """BLOCK_R whole output rows at a time, C = H * D channels (head-major, as out_proj's input columns), each
        element of O read once; sc_ptr: each column's head scale, [C] contiguous. PERSISTENT: a program takes row
        blocks pid, pid + programs, ... and loads the next block before it works on the current one (as the
        modulation kernel's persistent launch); else one program per row block."""
        pid = tl.program_id(0)
        if PERSISTENT:
            programs = tl.num_programs(0)
            o8 = _o_rows_load(o8_ptr, pid, rows, C, o_s_h, o_s_row, D, BLOCK_R, BLOCK_C)
            for blk in range(pid, tl.cdiv(rows, BLOCK_R), programs):
                cur = o8
                o8 = _o_rows_load(o8_ptr, blk + programs, rows, C, o_s_h, o_s_row, D, BLOCK_R, BLOCK_C)
                _o_rows_block(cur, blk, sc_ptr, sh_ptr, q_ptr, qs_ptr, rows, C, sh_s_h, sh_s_d, D, HAS_SHIFT, FP8_MAX,
                              INV_FP8_MAX, SCALE_FLOOR, BLOCK_R, BLOCK_C)
        else:
            o8 = _o_rows_load(o8_ptr, pid, rows, C, o_s_h, o_s_row, D, BLOCK_R, BLOCK_C)
            _o_rows_block(o8, pid, sc_ptr, sh_ptr, q_ptr, qs_ptr, rows, C, sh_s_h, sh_s_d, D, HAS_SHIFT, FP8_MAX,
                          INV_FP8_MAX, SCALE_FLOOR, BLOCK_R, BLOCK_C)
