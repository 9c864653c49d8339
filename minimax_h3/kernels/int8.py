"""Int8 ConvRot weights as shipped in the ComfyUI / comfy-kitchen checkpoints (docs/model.md §8.2).

Storage, per quantized linear `P` (out features N, in features K):
  `P.weight`        int8 [N, K]  -- W rotated group-wise on the input side by H_g, then row-wise int8
  `P.weight_scale`  fp32 [N, 1]  -- absmax(W_rot[row]) / 127
  `P.comfy_quant`   uint8 [n]    -- UTF-8 JSON: {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}
                                    (fields possibly nested under "params")

Because H_g is symmetric and orthonormal (H_g @ H_g = I), the same group-wise right-multiplication both rotates
and un-rotates, and x_rot @ W_rot^T == x @ W^T -- which is why the int8 kernel only has to rotate activations.

This module is shared by the DiT and the text encoder: it has no model knowledge.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from stagekit.checkpoints import FLOAT, CheckpointError, HeaderEntry, TensorReader, TensorSpec
from stagekit.errors import FailedPrecondition

from . import int8_gemv
from .int8_gemv import GEMV_MAX_ROWS

log = logging.getLogger(__name__)

INT8_QMAX = 127  # symmetric int8 grid used by comfy-kitchen: scale = absmax / 127, values clamped to [-128, 127]
SCALE_FLOOR = 1e-30  # comfy-kitchen clamps the row scale so all-zero rows do not divide by zero
DEFAULT_CONVROT_GROUPSIZE = 256  # DiT block linears; the unpruned AdaLN uses 64 (2688 = 42 * 64)
COMFY_INT8_FORMAT = "int8_tensorwise"  # ComfyUI's name for the int8 family, per-row scale included

# comfy-kitchen's torch.ops int8_linear takes an output dtype code instead of a dtype.
_CK_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

Int8Mode = Literal["kernel", "dequant"]


class QuantFormatError(FailedPrecondition):
    """A comfy_quant descriptor or an int8 tensor pair that this code cannot interpret: a weight file on the server
    (the operator replaces it)."""


# ----------------------------------------------------------------------------------------------------------------
# Hadamard rotation
# ----------------------------------------------------------------------------------------------------------------

_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))  # the "regular" symmetric Hadamard of order 4


def is_power_of_4(n: int) -> bool:
    return n >= 4 and (n & (n - 1)) == 0 and (n.bit_length() - 1) % 2 == 0


@functools.lru_cache(maxsize=None)
def hadamard(
    groupsize: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """H_g = H4^{(x) log4 g} / sqrt(g): symmetric, orthonormal, hence an involution. Made once per group size,
    dtype and device, and shared, so callers only read it: the activation step asks for it on every call, and
    built there it would be copied from pageable host memory each time, a copy the host waits on until the GPU has
    caught up, which leaves the GPU idle while the host launches what follows."""
    if not is_power_of_4(groupsize):
        raise QuantFormatError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, 1024), got {groupsize}")
    h4 = torch.tensor(_H4, dtype=torch.float64)
    h = h4
    while h.shape[0] < groupsize:
        h = torch.kron(h, h4)
    return (h / groupsize**0.5).to(dtype=dtype, device=device)


def rotate_groups(w: torch.Tensor, groupsize: int) -> torch.Tensor:
    """Right-multiply every contiguous group of `groupsize` input columns by H_g (= H_g^T). Computed in fp32."""
    n_out, n_in = w.shape
    if n_in % groupsize != 0:
        raise QuantFormatError(f"in_features {n_in} is not a multiple of the ConvRot group size {groupsize}")
    h = hadamard(groupsize, dtype=torch.float32, device=w.device)
    return (w.float().reshape(n_out, n_in // groupsize, groupsize) @ h).reshape(n_out, n_in)


# ----------------------------------------------------------------------------------------------------------------
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------------------------


def quantize_convrot(
    w: torch.Tensor, groupsize: int | None = DEFAULT_CONVROT_GROUPSIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (int8 [N, K], fp32 scale [N, 1]). groupsize None = plain row-wise int8 without rotation.

    Used to build test / random checkpoints; matches comfy-kitchen's `quantize_int8_convrot_weight`
    (round half to even, scale floor 1e-30).
    """
    if w.ndim != 2:
        raise QuantFormatError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    w_rot = rotate_groups(w, groupsize) if groupsize else w.float()
    scale = (w_rot.abs().amax(dim=1, keepdim=True) / INT8_QMAX).clamp(min=SCALE_FLOOR)
    q = torch.round(w_rot / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def _hadamard_sums(x: torch.Tensor, groupsize: int) -> torch.Tensor:
    """x [N, K] (fp32 holding integers) right-multiplied group-wise by the *unnormalised* H4^{(x) k}, g = 4^k.

    H_g is a Kronecker power of H4, so the product is k passes of the 4-point transform, one per base-4 digit of the
    column index within the group, written as additions: on integers below 2^24 every partial sum is exact in fp32,
    so the result is the same on every device and under any matmul precision setting (TF32 would round the inputs
    of a matmul)."""
    n, kdim = x.shape
    k = groupsize.bit_length() // 2
    y = x.reshape(n * kdim // groupsize, *(4,) * k)
    for axis in range(1, k + 1):
        a, b, c, d = y.unbind(axis)
        y = torch.stack((a + b + c - d, a + b - c + d, a - b + c + d, b + c + d - a), dim=axis)
    return y.reshape(n, kdim)


def dequantize_convrot(
    q: torch.Tensor, scale: torch.Tensor, groupsize: int | None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(int8 [N, K], fp32 [N, 1] or [N]) -> W [N, K] in `dtype`, un-rotated when groupsize is set.

    Exact: the rotation is linear and the scale is per row, so W = scale * (q @ H4^{(x) k}) / 2^k (sqrt(g) = 2^k).
    The integer sums are exact (`_hadamard_sums`), the product with the scale rounds once and the power of two is
    exact, so the fp32 result is the correctly rounded W, bit for bit the same on the CPU and on any GPU; `dtype`
    then rounds it once more."""
    if q.dtype != torch.int8 or q.ndim != 2:
        raise QuantFormatError(f"expected an int8 [N, K] weight, got {q.dtype} {tuple(q.shape)}")
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float()
    if scale.numel() not in (1, q.shape[0]):
        raise QuantFormatError(f"weight_scale has {scale.numel()} values for {q.shape[0]} rows")
    if not groupsize:
        return (q.float() * scale).to(dtype)
    if not is_power_of_4(groupsize):
        raise QuantFormatError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, 1024), got {groupsize}")
    if q.shape[1] % groupsize:
        raise QuantFormatError(f"in_features {q.shape[1]} is not a multiple of the ConvRot group size {groupsize}")
    w = _hadamard_sums(q.float(), groupsize) * scale
    return (w * 2.0 ** -(groupsize.bit_length() // 2)).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# comfy_quant descriptor
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    """What a `comfy_quant` tensor says about one weight."""

    format: str
    convrot: bool
    convrot_groupsize: int | None  # None when convrot is False

    @property
    def groupsize(self) -> int | None:
        return self.convrot_groupsize if self.convrot else None


def parse_comfy_quant(blob: torch.Tensor | bytes | str | dict) -> QuantSpec:
    """Parse the U8 JSON tensor. Accepts flat `{"format":..,"convrot":..}` and `{"format":..,"params":{..}}`."""
    if isinstance(blob, torch.Tensor):
        blob = bytes(blob.to(torch.uint8).flatten().tolist())
    if isinstance(blob, (bytes, bytearray)):
        try:
            blob = blob.decode("utf-8")
        except UnicodeDecodeError as e:
            raise QuantFormatError(f"comfy_quant tensor is not UTF-8 text: {e}") from e
    if isinstance(blob, str):
        try:
            blob = json.loads(blob.rstrip("\x00"))
        except json.JSONDecodeError as e:
            raise QuantFormatError(f"comfy_quant tensor is not valid JSON: {e}") from e
    if not isinstance(blob, dict):
        raise QuantFormatError(f"comfy_quant must be a JSON object, got {type(blob).__name__}")
    params = blob.get("params") or {}
    if not isinstance(params, dict):
        raise QuantFormatError(f"comfy_quant params must be a JSON object, got {type(params).__name__}")
    fields = dict(params)
    fields.update({k: v for k, v in blob.items() if k != "params"})  # top-level wins on conflicts
    fmt = fields.get("format")
    if fmt != COMFY_INT8_FORMAT:
        raise QuantFormatError(f"unsupported comfy_quant format {fmt!r}; only {COMFY_INT8_FORMAT!r} is supported")
    convrot = bool(fields.get("convrot", False))
    try:
        groupsize = int(fields.get("convrot_groupsize", DEFAULT_CONVROT_GROUPSIZE)) if convrot else None
    except (TypeError, ValueError) as e:
        raise QuantFormatError(f"comfy_quant convrot_groupsize is not an integer: {e}") from e
    if convrot and not is_power_of_4(groupsize):
        raise QuantFormatError(f"comfy_quant convrot_groupsize {groupsize} is not a power of 4")
    return QuantSpec(format=fmt, convrot=convrot, convrot_groupsize=groupsize)


def encode_comfy_quant(groupsize: int | None, nested: bool = False) -> torch.Tensor:
    """The U8 tensor ComfyUI stores next to an int8 weight (used when writing test checkpoints)."""
    params = {"convrot": True, "convrot_groupsize": groupsize} if groupsize else {}
    doc = {"format": COMFY_INT8_FORMAT, "params": params} if nested else {"format": COMFY_INT8_FORMAT, **params}
    return torch.tensor(list(json.dumps(doc).encode("utf-8")), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# A loaded int8 weight
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class QuantizedWeight:
    """int8 weight + fp32 per-row scale + ConvRot group size, as read from a checkpoint (possibly a TP slice)."""

    qdata: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N, 1]
    groupsize: int | None

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_convrot(self.qdata, self.scale, self.groupsize, dtype)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.qdata.to(device), self.scale.to(device), self.groupsize)


# ----------------------------------------------------------------------------------------------------------------
# nn.Module
# ----------------------------------------------------------------------------------------------------------------


def _comfy_kitchen_int8_op():
    """torch.ops.comfy_kitchen.int8_linear (compile-friendly; dispatches cuda -> triton -> eager by registry)."""
    try:
        import comfy_kitchen  # noqa: F401  (registers torch.ops.comfy_kitchen)
    except ImportError as e:
        raise RuntimeError("mode='kernel' needs the comfy-kitchen package; install it or use mode='dequant'") from e
    return torch.ops.comfy_kitchen.int8_linear


def comfy_int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype, groupsize: int | None) -> torch.Tensor:
    """comfy-kitchen's int8 linear: x [M, K] (rotated group-wise when `groupsize`, quantised per row) times the
    int8 weight [N, K] (scales [N, 1]), plus the bias (out_dtype) -> [M, N] out_dtype."""
    return _comfy_kitchen_int8_op()(x, weight, weight_scale, bias, _CK_DTYPE_CODE[out_dtype],
                                    convrot=bool(groupsize), convrot_groupsize=groupsize or DEFAULT_CONVROT_GROUPSIZE)


def comfy_backend(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, groupsize: int | None) -> str:
    """The comfy-kitchen backend ("cuda", "triton", "eager", ...) that `comfy_int8_linear` on these arguments
    runs. Passing the full kwargs matters: without them the registry skips its device/dtype validation."""
    from comfy_kitchen.registry import registry

    kwargs = dict(
        x=x, weight=weight, weight_scale=weight_scale, bias=bias, out_dtype=out_dtype, convrot=bool(groupsize),
        convrot_groupsize=groupsize or DEFAULT_CONVROT_GROUPSIZE, input_act=None, input_act_weight=None,
        input_act_eps=0.0, residual=None, residual_scale=None,
    )
    return registry.get_capable_backend("int8_linear", kwargs=kwargs)


_BACKENDS: dict[tuple, str] = {}


def _comfy_backend_cached(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype, groupsize: int | None) -> str:
    """`comfy_backend`, asked once per device, dtypes and shapes (a registry walk per call would cost more than the
    AdaLN's kernel)."""
    key = (x.device, x.dtype, x.shape[1], tuple(weight.shape), bias is None, out_dtype, groupsize)
    if key not in _BACKENDS:
        _BACKENDS[key] = comfy_backend(x, weight, weight_scale, bias, out_dtype, groupsize)
    return _BACKENDS[key]


def quantize_activation(x: torch.Tensor, groupsize: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]): comfy-kitchen's Triton int8 linear's own activation step
    (the group-wise Hadamard rotation when `groupsize`, then its per-row int8 quantiser)."""
    from comfy_kitchen.backends.triton import quantization as ck

    if groupsize:
        return ck.triton_quantize_and_rotate_rowwise(x, hadamard(groupsize, x.dtype, x.device), groupsize)
    return ck.triton_quantize_rowwise(x.contiguous())  # its kernel walks rows as contiguous


@torch.library.custom_op("h3stages::int8_linear_few_rows", mutates_args=())
def int8_linear_few_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype, groupsize: int) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) through the int8 ConvRot linear (weight [N, K] int8, weight_scale [N, 1], bias
    [N] in out_dtype or None, groupsize 0: no rotation) -> [M, N] out_dtype, as one op (opaque to torch.compile):
    where the device's tuning enables minimax_h3/kernels/int8_gemv.py's kernel, comfy-kitchen runs the call on its
    Triton backend and the kernel serves the arguments, comfy-kitchen's activation step and then that kernel (the
    same bits); otherwise comfy-kitchen's op."""

    def comfy() -> torch.Tensor:
        return comfy_int8_linear(x, weight, weight_scale, bias, out_dtype, groupsize)

    def kernel() -> torch.Tensor:
        x_int8, x_scale = quantize_activation(x, groupsize)
        return int8_gemv.launch(x_int8, x_scale, weight, weight_scale, bias, out_dtype)

    if not int8_gemv.enabled(x.device) or _comfy_backend_cached(x, weight, weight_scale, bias, out_dtype,
                                                                 groupsize) != "triton":
        return comfy()
    reason = int8_gemv.unsupported(x, weight, weight_scale, bias, out_dtype)
    return int8_gemv.FALLBACK.dispatch(x.device, reason, kernel, comfy)


@int8_linear_few_rows.register_fake
def _(x, weight, weight_scale, bias, out_dtype, groupsize):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


class Int8ConvRotLinear(nn.Module):
    """Linear layer holding a ConvRot int8 weight (`weight` int8 [N, K], `weight_scale` fp32 [N, 1]).

    mode="kernel":  comfy-kitchen int8 GEMM; activations are rotated and quantized per token on the fly.
    mode="dequant": the weight is dequantised once (first forward or `materialize()`) to `compute_dtype` and the
                    layer runs as a dense F.linear -- same math as a bf16 checkpoint. The int8 copy stays (state_dict),
                    so this holds 1 + 2 bytes per weight; where memory matters, dequantise at load instead
                    (minimax_h3.dit.checkpoint.load_dit_weights(quant_mode="dequant")) and use a plain linear.
    State-dict keys are `weight`, `weight_scale` (and `bias` if present), i.e. the ComfyUI names; a `comfy_quant`
    entry in a loaded state dict is checked against this layer's group size and otherwise ignored.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        groupsize: int | None = DEFAULT_CONVROT_GROUPSIZE,
        mode: Int8Mode = "kernel",
        compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("kernel", "dequant"):
            raise ValueError(f"mode must be 'kernel' or 'dequant', got {mode!r}")
        if groupsize and in_features % groupsize != 0:
            raise ValueError(f"in_features {in_features} is not a multiple of the ConvRot group size {groupsize}")
        self.in_features, self.out_features = in_features, out_features
        self.groupsize = groupsize
        self.mode = mode
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self._dense: torch.Tensor | None = None  # dequant-mode cache, not part of the state dict
        if mode == "kernel":
            _comfy_kitchen_int8_op()  # fails here, at build time, without comfy-kitchen

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None, **kwargs) -> "Int8ConvRotLinear":
        n_out, n_in = qw.qdata.shape
        layer = cls(n_in, n_out, bias=bias is not None, groupsize=qw.groupsize, device=qw.qdata.device, **kwargs)
        layer.weight.copy_(qw.qdata)
        layer.weight_scale.copy_(qw.scale.reshape(n_out, 1))
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    @classmethod
    def from_float(
        cls, w: torch.Tensor, bias: torch.Tensor | None = None,
        groupsize: int | None = DEFAULT_CONVROT_GROUPSIZE, **kwargs,
    ) -> "Int8ConvRotLinear":
        q, s = quantize_convrot(w, groupsize)
        return cls.from_quantized(QuantizedWeight(q, s, groupsize), bias, **kwargs)

    def materialize(self) -> torch.Tensor:
        """Dequantise once and cache (dequant mode)."""
        if self._dense is None:
            self._dense = dequantize_convrot(self.weight, self.weight_scale, self.groupsize, self.compute_dtype)
        return self._dense

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        error_msgs = args[-1]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        blob = state_dict.pop(prefix + "comfy_quant", None)
        if blob is not None:
            spec = parse_comfy_quant(blob)
            if spec.groupsize != self.groupsize:
                error_msgs.append(
                    f"{prefix}comfy_quant group size {spec.groupsize} != layer group size {self.groupsize}"
                )
        self._dense = None  # new weights invalidate the dequantised copy
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn, recurse=True):
        self._dense = None  # .to()/.cuda() would leave a stale cache on the old device
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dequant":
            w = self.materialize()
            bias = None if self.bias is None else self.bias.to(w.dtype)
            return nn.functional.linear(x.to(w.dtype), w, bias)
        out_dtype = x.dtype if x.dtype in _CK_DTYPE_CODE else self.compute_dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # the CUDA backend wants >= 2-D
        bias = None if self.bias is None else self.bias.to(out_dtype)
        if x2.shape[0] <= GEMV_MAX_ROWS and x2.is_cuda:  # a few rows (the AdaLN's): one op, opaque to torch.compile
            y = int8_linear_few_rows(x2, self.weight, self.weight_scale, bias, out_dtype, self.groupsize or 0)
        else:
            y = comfy_int8_linear(x2, self.weight, self.weight_scale, bias, out_dtype, self.groupsize)
        return y.reshape(*lead, self.out_features)

    def kernel_backend(self, x: torch.Tensor) -> str:
        """The comfy-kitchen backend ("cuda", "triton", "eager", ...) that a kernel-mode call on `x` would use."""
        out_dtype = x.dtype if x.dtype in _CK_DTYPE_CODE else self.compute_dtype
        return comfy_backend(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias, out_dtype,
                             self.groupsize)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, groupsize={self.groupsize}, mode={self.mode}"


def int8_linear_specs(prefix: str, n_out: int, n_in: int, make=TensorSpec) -> dict:
    """The tensors one int8 linear `prefix` stores, as `make(shape, dtypes, store)` specs (TensorSpec or a subclass
    that records the stored dtype): the int8 weight, its per-row fp32 scale and the U8 JSON descriptor."""
    return {f"{prefix}.weight": make((n_out, n_in), frozenset({"I8"}), "I8"),
            f"{prefix}.weight_scale": make((n_out, 1), FLOAT, "F32"),
            f"{prefix}.comfy_quant": make(None, frozenset({"U8"}), "U8")}  # JSON bytes, any length


def read_quant_spec(reader: TensorReader, entries: Mapping[str, HeaderEntry], weight_key: str,
                    descriptor: dict | None = None, source: str | None = None) -> QuantSpec:
    """The `comfy_quant` descriptor of an int8 weight, checked against the weight: valid JSON of a known format,
    and a ConvRot group that divides the weight's in_features. `descriptor`: the layer's entry of a file's
    `_quantization_metadata` (ComfyUI's older form, named `source` in errors) instead of the U8 tensor. Raises
    CheckpointError naming file and tensor."""
    prefix = weight_key[: -len(".weight")]
    qkey = f"{prefix}.comfy_quant"
    e = entries.get(qkey)
    file = entries[weight_key].file
    try:
        if descriptor is not None:
            spec = parse_comfy_quant(descriptor)
        elif e is None:
            raise CheckpointError(file, "int8 weight without its comfy_quant descriptor: cannot tell whether it is "
                                        "ConvRot-rotated", qkey)
        else:
            file = e.file
            spec = parse_comfy_quant(reader.whole(qkey))
    except QuantFormatError as exc:
        raise CheckpointError(file, f"{source}: {exc}" if descriptor is not None else str(exc), qkey) from exc
    in_features = entries[weight_key].shape[-1]
    if spec.groupsize and in_features % spec.groupsize:
        raise CheckpointError(file, f"ConvRot group size {spec.groupsize} does not divide the weight's "
                                    f"in_features {in_features}", qkey)
    return spec
