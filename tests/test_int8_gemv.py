"""The int8 linear for a few rows (minimax_h3/kernels/int8_gemv.py): the Triton kernel against the exact integer
product in Triton's CPU interpreter (needs triton in the venv, which CI's CPU torch lacks:
`.venv/bin/python -m pytest tests/test_int8_gemv.py -k interpreter -p no:randomly`), and against comfy-kitchen's own
int8 linear bit for bit on a GPU, eager and inside torch.compile."""

from __future__ import annotations

import pytest
import torch

from minimax_h3.kernels.int8 import Int8ConvRotLinear, comfy_int8_linear
from minimax_h3.kernels.int8_gemv import GEMV_MAX_ROWS, unsupported
from tests.triton_interp import needs_triton, run_in_interpreter

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def exact_reference(x_int8, x_scale, weight, weight_scale, bias, out_dtype) -> torch.Tensor:
    """comfy-kitchen's Triton kernel's math in plain torch: the exact integer sum (on the CPU: CUDA has no int64
    matmul), then its epilogue op for op on the inputs' device."""
    acc = (x_int8.cpu().long() @ weight.cpu().long().T).float().to(x_int8.device)
    y = acc * (x_scale.reshape(-1, 1) * weight_scale.reshape(1, -1))
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def check_launch(device: str, m: int, n: int, k: int, out_dtype: torch.dtype, with_bias: bool, block_n: int,
                 block_k: int, interpreted: bool = False) -> None:
    """`launch` vs `exact_reference`: bitwise equal, except that the interpreter rounds fp32 -> bf16 toward zero
    and a GPU compiler may fuse the product and the bias into one FMA (as it does in comfy-kitchen's kernel, which
    `test_same_bits_as_comfy_kitchen_on_gpu` holds the kernel to): there, within one step of the output
    dtype of the product's and the output's magnitudes."""
    from minimax_h3.kernels.int8_gemv import launch

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x_int8 = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(device)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    x_scale = (torch.rand(m, 1, generator=g) * 1e-2 + 1e-4).to(device)
    weight_scale = (torch.rand(n, 1, generator=g) * 1e-2 + 1e-4).to(device)
    bias = (torch.randn(n, generator=g) * 3).to(out_dtype).to(device) if with_bias else None
    got = launch(x_int8, x_scale, weight, weight_scale, bias, out_dtype, block_n=block_n, block_k=block_k,
                 num_warps=4, num_stages=2)
    want = exact_reference(x_int8, x_scale, weight, weight_scale, bias, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype
    fused = with_bias and not interpreted
    if not fused and (out_dtype == torch.float32 or not interpreted):
        assert torch.equal(got, want), f"max abs difference {(got.float() - want.float()).abs().max().item():.3e}"
    else:
        product = want.float() - (bias.float() if with_bias else 0.0)
        step = torch.finfo(out_dtype).eps * (want.float().abs() + product.abs())
        assert ((got.float() - want.float()).abs() <= step).all()


def check_launch_cases(device: str, interpreted: bool = False) -> None:
    """Ragged N and K (not multiples of the blocks), 1..16 rows, with and without a bias, fp32 and bf16 out."""
    for m, n, k, out_dtype, with_bias in ((1, 70, 96, torch.float32, True), (3, 200, 320, torch.float32, False),
                                          (GEMV_MAX_ROWS, 33, 64, torch.bfloat16, True),
                                          (2, 130, 544, torch.bfloat16, False)):
        check_launch(device, m, n, k, out_dtype, with_bias, block_n=32, block_k=64, interpreted=interpreted)
    print("launch cases ok")


@needs_triton
def test_kernel_under_the_interpreter():
    """The kernel's indexing, masking, int32 sum and epilogue on the CPU through Triton's interpreter."""
    run_in_interpreter("from tests.test_int8_gemv import check_launch_cases as c; c('cpu', interpreted=True)",
                       expect="launch cases ok")


def test_unsupported_names_what_it_needs():
    """Arguments the kernel does not serve get a reason a person can act on (the caller then runs comfy-kitchen's
    op); the few-row limit is the kernel's one MMA row block."""
    w = torch.zeros(8, 64, dtype=torch.int8)
    ws = torch.ones(8, 1)
    assert "rows" in unsupported(torch.zeros(GEMV_MAX_ROWS + 1, 64), w, ws, None, torch.float32)
    assert "weight must be int8" in unsupported(torch.zeros(2, 64), w.float(), ws, None, torch.float32)
    assert "weight_scale" in unsupported(torch.zeros(2, 64), w, torch.ones(4, 1), None, torch.float32)
    assert "bias" in unsupported(torch.zeros(2, 64), w, ws, torch.zeros(8), torch.bfloat16)


def test_the_few_row_path_is_a_tuned_choice():
    """Whether the layer's few-row path runs the kernel is tuning.json data per architecture (`int8_gemv.enabled`),
    with the kernel's launch parameters beside it; the CPU gets the default entry's."""
    from minimax_h3.kernels import int8_gemv
    from minimax_h3.kernels.tuning import launch_params

    params = launch_params("int8_gemv", "cpu")
    assert int8_gemv.enabled(torch.device("cpu")) is bool(params["enabled"])
    assert {"block_n", "block_k", "num_warps", "num_stages"} <= set(params)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_few_rows_on_the_cpu_run_comfy_kitchens_op():
    """On the CPU a few rows go through comfy-kitchen's op unchanged (the kernel is a GPU path)."""
    pytest.importorskip("comfy_kitchen")
    layer = Int8ConvRotLinear.from_float(torch.randn(48, 64), torch.randn(48), groupsize=16)
    x = torch.randn(3, 64)
    want = comfy_int8_linear(x, layer.weight, layer.weight_scale, layer.bias.float(), torch.float32, 16)
    assert torch.equal(layer(x), want)


@needs_gpu
def test_launch_cases_on_gpu():
    check_launch_cases("cuda")


@needs_gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_same_bits_as_comfy_kitchen_on_gpu(out_dtype, monkeypatch):
    """The AdaLN's form (fp32 rows, ConvRot group 64, a bias) through the layer with the few-row kernel enabled:
    bitwise comfy-kitchen's op, in eager and compiled calls, for 1..16 rows (when comfy-kitchen runs its Triton
    backend here, the kernel serves them: it must not have fallen back)."""
    from minimax_h3.kernels import int8_gemv

    monkeypatch.setattr(int8_gemv, "enabled", lambda device: True)
    torch.manual_seed(0)
    layer = Int8ConvRotLinear.from_float(torch.randn(3000, 2688, device="cuda") * 0.02,
                                         torch.randn(3000, device="cuda"), groupsize=64)
    compiled = torch.compile(layer, fullgraph=True)
    for m in (1, 3, GEMV_MAX_ROWS):
        x = torch.randn(m, 2688, device="cuda").to(out_dtype)
        want = comfy_int8_linear(x, layer.weight, layer.weight_scale, layer.bias.to(out_dtype), out_dtype, 64)
        assert torch.equal(layer(x), want)
        assert torch.equal(compiled(x), want)
    assert int8_gemv.FALLBACK.reason(torch.device("cuda", torch.cuda.current_device())) is None
