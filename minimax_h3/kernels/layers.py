"""How the DiT's linears and attention compute: one method object per layer, chosen with its kernel.

The model (minimax_h3/dit/model.py) calls its layers plainly; what runs, and what a layer fuses with its
neighbour, is the business of the layer's method (the pattern of vLLM's `quant_method.apply`: the layer holds its
weights, its method's `apply` does the kernel work):

- `LinearMethod` (plain): the neighbouring op (AdaLN modulation, SwiGLU, the attention output's rows) runs in plain
  torch in the compute dtype, then the linear. Every linear module gets it unless it says otherwise
  (`linear_method`): any module computing y = x W^T (+ b) can be swapped in (H3DiT.swap_linear).
- `apply_added`: a block that defers a gated residual add (`Residual`, minimax_h3/dit/model.py Block) hands it to
  the next linear that modulates the same rows; the plain method adds, then modulates, the fp8 one does both in one
  kernel pass.
- `Fp8RowsMethod`: the method of an fp8 row-wise linear (minimax_h3/kernels/registry.py Fp8RowwiseLinear). Its input
  rows are quantised to e4m3 anyway, so the neighbouring op and that quantisation run as one Triton kernel
  (minimax_h3/kernels/fp8_rows.py) that hands the linear `Fp8Rows`: the same math as the plain method, one pass
  over the rows instead of two or three.
- Attention: the block's q, k, v go into an `AttentionInput` made for the attention kernel the start-up probe chose
  (`attention_input`): a compute-dtype buffer for any kernel, or, for fp8 attention
  (minimax_h3/kernels/fp8_attention.py) with static q/k scales, q and k written in e4m3 straight from the q/k norm kernel. Its `attend` returns an
  `AttentionOutput` whose rows go to out_proj (`project`); fp8 attention hands an fp8 out_proj O as its kernel
  wrote it (cuDNN's e4m3, FA3's bf16) with V's mean, and that linear's method takes the rows in one pass.

Which fused kernel also runs inside a torch.compile'd block is the method's choice (`Fp8RowsMethod` fields):
where Inductor's own fusion of the same plain ops is as fast, the compiled block is left to trace them
(docs/kernels.md, "Fused modulation + fp8 row quantisation (Triton)").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from minimax_h3.dit.ops import gated_add, modulate, swiglu

from . import fp8_rows
from .fp8_attention import Fp8Attention, Fp8O, Fp8QKInput, dequantize_o, static_qk_mult
from .qk_norm_rope import qk_norm_rope
from .tuning import tuned


class Modulation(NamedTuple):
    """The AdaLN modulation of some residual rows x [rows, C] fp32, as the next linear's input:
    `norm(x) * (1 + scale[index]) + shift[index]` in fp32, emitted in the compute dtype. norm: an RMSNorm (its
    `weight` [C] and `eps`); shift / scale [M * 3, C] fp32 (the AdaLN rows); index [rows] (int, the AdaLN row of each
    row)."""

    norm: nn.Module
    shift: torch.Tensor
    scale: torch.Tensor
    index: torch.Tensor


class Residual(NamedTuple):
    """A gated residual add still to be made to residual rows x [rows, C] fp32: x += gate[index] * part
    (minimax_h3/dit/ops.py `gated_add`; index: the rows' AdaLN rows, as the `Modulation` of the same rows has them).
    gate [M * 3, C] fp32 (the AdaLN gate rows); part [rows, C] (a projection's output, compute dtype or fp32)."""

    gate: torch.Tensor
    part: torch.Tensor


def modulated(x: torch.Tensor, modulation: Modulation | None, dtype: torch.dtype) -> torch.Tensor:
    """A linear's plain input: x itself, or with `modulation`, the modulation of the fp32 residual rows x in
    `dtype` (minimax_h3/dit/ops.py `modulate`)."""
    if modulation is None:
        return x
    m = modulation
    return modulate(x, m.norm.weight, m.norm.eps, m.shift, m.scale, m.index, dtype)


def o_rows(o: Fp8O, dtype: torch.dtype) -> torch.Tensor:
    """fp8 attention's O as its kernel wrote it (`Fp8O`, o8 [H, rows, D]) as out_proj's plain input: dequantised to
    `dtype`, heads side by side -> [rows, H * D]."""
    return _head_rows(dequantize_o(*o, dtype))


class LinearMethod:
    """The plain method: the neighbouring op in plain torch, then the linear (any y = x W^T (+ b) module)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, modulation: Modulation | None = None,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """layer(x) [rows, out]; with `modulation`, layer(modulation of x in `dtype`) (x: fp32 residual rows)."""
        return layer(modulated(x, modulation, dtype))

    def apply_added(self, layer: nn.Module, x: torch.Tensor, residual: Residual, modulation: Modulation,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x += gate[index] * part in place (x: fp32 residual rows), then `apply(layer, x, modulation, dtype)`."""
        gated_add(x, residual.gate, residual.part, modulation.index)
        return self.apply(layer, x, modulation, dtype)

    def apply_swiglu(self, layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """layer(silu(gate) * value) for y [rows, 2F] = [gate | value] (fc1's output) -> [rows, out]."""
        return layer(swiglu(y))

    def takes_fp8_o(self, dtype: torch.dtype) -> bool:
        """Whether fp8 attention may hand this linear its O as the kernel wrote it (`Fp8O`, `apply_fp8_o`)."""
        return False

    def apply_fp8_o(self, layer: nn.Module, o: Fp8O, dtype: torch.dtype) -> torch.Tensor:
        """layer(rows of O) for fp8 attention's `Fp8O` (o8 [H, rows, D]): dequantised to `dtype` first, heads side
        by side."""
        return layer(o_rows(o, dtype))


@dataclass(frozen=True)
class Fp8RowsMethod(LinearMethod):
    """The method of an fp8 row-wise linear: the neighbouring op fused with the e4m3 row quantisation (Triton on a
    GPU, for bf16 compute; minimax_h3/kernels/fp8_rows.py), the linear then taking `Fp8Rows`. Elsewhere the plain
    method's ops, the linear quantising its rows itself: the same math. The fields say which fused kernel also runs
    inside a torch.compile'd block, where Inductor fuses the plain ops itself: per-device data
    (`fp8_rows_method`; minimax_h3/kernels/tuning.json "fp8_rows_in_compiled_blocks", docs/kernels.md)."""

    modulate_in_compiled_blocks: bool
    add_modulate_in_compiled_blocks: bool
    swiglu_in_compiled_blocks: bool
    o_rows_in_compiled_blocks: bool

    @staticmethod
    def _use(x: torch.Tensor, dtype: torch.dtype, in_compiled_blocks: bool) -> bool:
        return (x.is_cuda and dtype == torch.bfloat16
                and (in_compiled_blocks or not torch.compiler.is_compiling()))

    def apply(self, layer, x, modulation=None, dtype=torch.bfloat16):
        if modulation is not None and self._use(x, dtype, self.modulate_in_compiled_blocks):
            m = modulation
            return layer(fp8_rows.modulate_fp8(x, m.norm.weight, m.norm.eps, m.shift, m.scale, m.index))
        return super().apply(layer, x, modulation, dtype)

    def apply_added(self, layer, x, residual, modulation, dtype=torch.bfloat16):
        if self._use(x, dtype, self.add_modulate_in_compiled_blocks):
            m = modulation
            return layer(fp8_rows.add_modulate_fp8(x, residual.gate, residual.part, m.norm.weight, m.norm.eps,
                                                   m.shift, m.scale, m.index))
        return super().apply_added(layer, x, residual, modulation, dtype)

    def apply_swiglu(self, layer, y):
        if self._use(y, y.dtype, self.swiglu_in_compiled_blocks):
            return layer(fp8_rows.swiglu_fp8(y))
        return super().apply_swiglu(layer, y)

    def takes_fp8_o(self, dtype):
        return dtype == torch.bfloat16 and (self.o_rows_in_compiled_blocks or not torch.compiler.is_compiling())

    def apply_fp8_o(self, layer, o, dtype):
        if o.o8.is_cuda:
            return layer(fp8_rows.o_rows_fp8(*o))
        return super().apply_fp8_o(layer, o, dtype)


@functools.cache
def fp8_rows_method(arch: str) -> Fp8RowsMethod:
    """The fp8 row-wise linears' method on GPU architecture `arch` ("sm_90", "cpu", ...), as tuned there."""
    return Fp8RowsMethod(**tuned("fp8_rows_in_compiled_blocks", arch))


PLAIN = LinearMethod()


def linear_method(layer: nn.Module) -> LinearMethod:
    """The method of a linear module: its `linear_method` attribute (set by the kernel that built it, or by a
    wrapper such as minimax_h3/dit/lora.py LoRALinear), else the plain one."""
    return getattr(layer, "linear_method", PLAIN)


# ---------------------------------------------------------------------------------------------------------------------
# Attention: input buffer -> attend -> output rows for out_proj
# ---------------------------------------------------------------------------------------------------------------------


def _head_rows(o: torch.Tensor) -> torch.Tensor:
    """o [H, rows, D] -> [rows, H * D] (out_proj's input: heads side by side)."""
    h, rows, d = o.shape
    return o.transpose(0, 1).reshape(rows, h * d)


class AttentionOutput:
    """Attention's output o [1, H, S, D] in the compute dtype."""

    def __init__(self, o: torch.Tensor):
        self.o = o

    def project(self, layer: nn.Module, start: int, end: int) -> torch.Tensor:
        """out_proj of the rows [start, end) -> [rows, out]."""
        return layer(_head_rows(self.o[0, :, start:end]))


class Fp8AttentionOutput(AttentionOutput):
    """fp8 attention's O as its kernel wrote it (`Fp8O`, o8 [H, S, D]), for an out_proj whose method takes it."""

    def __init__(self, o: Fp8O, dtype: torch.dtype):
        self.fp8, self.dtype = o, dtype

    def project(self, layer, start, end):
        o = self.fp8
        return linear_method(layer).apply_fp8_o(layer, Fp8O(o.o8[:, start:end], o.o_scale, o.o_shift), self.dtype)


class AttentionInput:
    """One layer's attention input for S rows: q, k, v [3, 1, H, S, D] in the compute dtype, in the attention
    kernel's layout, written a row range at a time (`write`)."""

    def __init__(self, qkv: torch.Tensor):
        self.qkv = qkv

    def write(self, start: int, end: int, y: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
              rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Rows [start, end) from the qkv projection y [rows, 3, H, D]: fp32 RMSNorm of q and k, RoPE (cos, sin
        [rows, rope_dim] or None), written in this buffer's layout (one Triton kernel on CUDA,
        minimax_h3/kernels/qk_norm_rope.py)."""
        out = self.qkv[:, :, :, start:end]
        qk_norm_rope(y, q_norm.weight, k_norm.weight, q_norm.eps, rope, out[:2], out[2])

    def pop(self) -> torch.Tensor:
        """The [3, 1, H, S, D] buffer, handed over: this input holds it no longer (sequence parallelism sends it)."""
        qkv, self.qkv = self.qkv, None
        return qkv

    def attend(self, fn, out_proj: nn.Module, dtype: torch.dtype) -> AttentionOutput:
        """fn(q, k, v) over all rows."""
        return AttentionOutput(fn(self.qkv[0], self.qkv[1], self.qkv[2]))


class Fp8AttentionInput(AttentionInput):
    """q and k in e4m3 with static scales from the layer's norm gains (`Fp8QKInput`), v in the compute dtype: a
    buffer of its own, or, with `v_in_projection` (one row range covers all rows), a view of the projection."""

    def __init__(self, qkv: Fp8QKInput, v_in_projection: bool):
        self.fp8, self.v_in_projection = qkv, v_in_projection

    def write(self, start, end, y, q_norm, k_norm, rope):
        x = self.fp8
        v = x.v[:, :, start:end] if x.v is not None else None
        qk_norm_rope(y, q_norm.weight, k_norm.weight, q_norm.eps, rope, x.qk8[:, :, :, start:end], v, x.qk_mult)
        if self.v_in_projection:  # the attention quantises v straight from the projection
            self.fp8 = x._replace(v=y[:, 2].transpose(0, 1).unsqueeze(0))  # [1, H, S, D] view

    def attend(self, fn, out_proj, dtype):
        if linear_method(out_proj).takes_fp8_o(dtype):
            return Fp8AttentionOutput(fn.attend_fp8_qk(self.fp8, keep_fp8_o=True), dtype)
        return AttentionOutput(fn.attend_fp8_qk(self.fp8))


def attention_input(fn, heads: int, s: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                    q_norm: nn.Module, k_norm: nn.Module, sequence_parallel: bool = False,
                    v_in_projection: bool = False) -> AttentionInput:
    """An uninitialised attention input for S rows and attention kernel `fn`: for fp8 attention that takes q and k
    in e4m3 at this length, `Fp8AttentionInput` (not under sequence parallelism, whose all-to-all moves
    compute-dtype q, k, v); else the compute-dtype buffer. v_in_projection: one `write` covers all S rows."""
    shape = (1, heads, s, head_dim)
    if not sequence_parallel and isinstance(fn, Fp8Attention) and fn.takes_fp8_qk(s):
        v = None if v_in_projection else torch.empty(shape, dtype=dtype, device=device)
        qk8 = torch.empty(2, *shape, dtype=torch.float8_e4m3fn, device=device)
        return Fp8AttentionInput(Fp8QKInput(qk8, v, static_qk_mult(q_norm.weight, k_norm.weight)), v_in_projection)
    return AttentionInput(torch.empty(3, *shape, dtype=dtype, device=device))
