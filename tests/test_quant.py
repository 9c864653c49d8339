"""ConvRot int8 helpers (minimax_h3/kernels/int8.py) against the docs/model.md §8.2 facts and comfy-kitchen's own
implementation."""

import pytest
import torch

from minimax_h3.kernels.int8 import (
                                     Int8ConvRotLinear,
                                     QuantFormatError,
                                     QuantizedWeight,
                                     dequantize_convrot,
                                     encode_comfy_quant,
                                     hadamard,
                                     parse_comfy_quant,
                                     quantize_convrot,
                                     )

ck = pytest.importorskip("comfy_kitchen")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("g", [4, 16, 64, 256])
def test_hadamard_orthonormal_symmetric_involution(g):
    h = hadamard(g, dtype=torch.float64)
    eye = torch.eye(g, dtype=torch.float64)
    assert torch.allclose(h @ h.T, eye, atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, eye, atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, g**-0.5))


def test_hadamard_matches_comfy_kitchen():
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    for g in (4, 64, 256):
        assert torch.allclose(hadamard(g), _build_hadamard(g), atol=1e-7)


def test_the_activation_steps_hadamard_is_made_once_per_device():
    """The per-call activation rotation reads one device copy: no host-to-device copy per call (on a GPU one from
    pageable memory makes the host wait for the GPU, which then idles while the host launches what follows)."""
    cpu = torch.device("cpu")
    h = hadamard(64, torch.bfloat16, cpu)
    assert hadamard(64, torch.bfloat16, cpu) is h


@pytest.mark.parametrize("g", [2, 8, 32, 128, 0])
def test_hadamard_rejects_non_power_of_4(g):
    with pytest.raises(QuantFormatError, match="power of 4"):
        hadamard(g)


@pytest.mark.parametrize("g", [64, 256])
def test_quantize_bit_exact_with_comfy_kitchen(g):
    torch.manual_seed(0)
    w = torch.randn(96, 512)
    q, s = quantize_convrot(w, g)
    q_ck, s_ck = torch.ops.comfy_kitchen.quantize_int8_convrot_weight(w, g)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (96, 1)
    assert torch.equal(q, q_ck) and torch.equal(s, s_ck)
    d_ck = torch.ops.comfy_kitchen.dequantize_int8_convrot_weight(q, s, g)
    assert torch.allclose(dequantize_convrot(q, s, g, torch.float32), d_ck, atol=1e-6)


@pytest.mark.parametrize("g", [None, 16, 64, 256])
def test_quantize_dequantize_roundtrip_small(g):
    torch.manual_seed(1)
    w = torch.randn(128, 1024) / 32
    q, s = quantize_convrot(w, g)
    assert rel(dequantize_convrot(q, s, g, torch.float32), w) < 1e-2  # measured ~7.4e-3 (row-wise int8 floor)
    assert dequantize_convrot(q, s, g).dtype == torch.bfloat16


def test_convrot_absorbs_outlier_columns():
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    w[:, 3] *= 50  # one outlier input channel: row-wise int8 loses the rest of the row, ConvRot spreads it
    plain = rel(dequantize_convrot(*quantize_convrot(w, None), None, torch.float32), w)
    rot = rel(dequantize_convrot(*quantize_convrot(w, 256), 256, torch.float32), w)
    assert rot < plain


def test_dequantize_rejects_bad_inputs():
    with pytest.raises(QuantFormatError):
        dequantize_convrot(torch.zeros(4, 16), torch.ones(4, 1), 16)  # not int8
    with pytest.raises(QuantFormatError):
        dequantize_convrot(torch.zeros(4, 16, dtype=torch.int8), torch.ones(3, 1), 16)
    with pytest.raises(QuantFormatError, match="multiple"):
        dequantize_convrot(torch.zeros(4, 24, dtype=torch.int8), torch.ones(4, 1), 16)


# ---- comfy_quant -----------------------------------------------------------------------------------------------


def _u8(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


@pytest.mark.parametrize(
    "text",
    [
        '{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 64}',
        '{"format": "int8_tensorwise", "params": {"convrot": true, "convrot_groupsize": 64}}',
        '{"params": {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 64}}',
    ],
)
def test_parse_comfy_quant_flat_and_nested(text):
    spec = parse_comfy_quant(_u8(text))
    assert spec.format == "int8_tensorwise" and spec.convrot and spec.groupsize == 64


def test_parse_comfy_quant_defaults_and_plain_int8():
    assert parse_comfy_quant(b'{"format":"int8_tensorwise","convrot":true}').groupsize == 256
    assert parse_comfy_quant('{"format":"int8_tensorwise"}').groupsize is None
    assert parse_comfy_quant(_u8('{"format":"int8_tensorwise","convrot":true}\x00\x00')).convrot  # padded blob


@pytest.mark.parametrize("nested", [False, True])
def test_encode_parse_roundtrip(nested):
    assert parse_comfy_quant(encode_comfy_quant(64, nested=nested)).groupsize == 64
    assert encode_comfy_quant(256).dtype == torch.uint8


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"format": "float8_e4m3fn"}', "unsupported"),
        ('{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 128}', "power of 4"),
        ("not json", "JSON"),
        ("[1, 2]", "object"),
    ],
)
def test_parse_comfy_quant_errors(text, match):
    with pytest.raises(QuantFormatError, match=match):
        parse_comfy_quant(_u8(text))


# ---- Int8ConvRotLinear -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [64, 256])
def test_linear_kernel_vs_dequant_agree(dtype, g):
    torch.manual_seed(3)
    w, b = torch.randn(384, 512) / 512**0.5, torch.randn(384) * 0.1
    x = torch.randn(2, 77, 512)
    x[..., 5] *= 30  # activation outlier channel, as in DiT activations
    ref = torch.nn.functional.linear(x, w, b)
    kern = Int8ConvRotLinear.from_float(w, b, groupsize=g, mode="kernel", compute_dtype=dtype)
    deq = Int8ConvRotLinear.from_float(w, b, groupsize=g, mode="dequant", compute_dtype=dtype)
    y_k, y_d = kern(x.to(dtype)), deq(x.to(dtype))
    assert y_k.shape == y_d.shape == (2, 77, 384) and y_k.dtype == y_d.dtype == dtype
    # measured on CPU: kernel ~1.1e-2, dequant ~7.5e-3 vs fp32; int8 activations add the difference
    assert rel(y_d, ref) < 1.5e-2
    assert rel(y_k, ref) < 2.5e-2
    assert rel(y_k, y_d) < 2.5e-2


def test_linear_state_dict_uses_comfy_names_and_checks_comfy_quant():
    torch.manual_seed(4)
    src = Int8ConvRotLinear.from_float(torch.randn(32, 64), groupsize=16, mode="dequant")
    sd = src.state_dict()
    assert set(sd) == {"weight", "weight_scale"} and sd["weight"].dtype == torch.int8
    dst = Int8ConvRotLinear(64, 32, groupsize=16, mode="dequant")
    dst(torch.randn(1, 64))  # build the dequant cache, which loading must invalidate
    dst.load_state_dict({**sd, "comfy_quant": encode_comfy_quant(16)})
    x = torch.randn(3, 64)
    assert torch.equal(dst(x), src(x))
    with pytest.raises(RuntimeError, match="group size"):
        Int8ConvRotLinear(64, 32, groupsize=64).load_state_dict({**sd, "comfy_quant": encode_comfy_quant(16)})


def test_linear_from_quantized_weight():
    torch.manual_seed(5)
    w = torch.randn(16, 64)
    qw = QuantizedWeight(*quantize_convrot(w, 64), 64)
    layer = Int8ConvRotLinear.from_quantized(qw, mode="dequant", compute_dtype=torch.float32)
    assert torch.equal(layer.materialize(), qw.dequantize(torch.float32))
    assert rel(layer.materialize(), w) < 1e-2


def test_linear_rejects_bad_config():
    with pytest.raises(ValueError, match="mode"):
        Int8ConvRotLinear(64, 8, mode="fast")
    with pytest.raises(ValueError, match="multiple"):
        Int8ConvRotLinear(96, 8, groupsize=64)
