"""minimax_h3/kernels/qk_norm_rope.py: the plain-torch reference equals the plain q/k norm + RoPE arithmetic bit for bit
(CPU); the Triton kernel matches the reference on real DiT shapes (GPU) and, on
small shapes, in triton's CPU interpreter (indexing and masking; needs triton in the venv, which CI's CPU torch
lacks: `.venv/bin/pip install --no-deps triton`, then `.venv/bin/python -m pytest tests/test_qk_norm_rope.py -k
interpreter -p no:randomly`)."""

from __future__ import annotations

import math

import pytest
import torch

from minimax_h3.dit.model import RMSNorm
from minimax_h3.dit.ops import apply_rope, qk_norm_rope_reference
from minimax_h3.kernels.qk_norm_rope import qk_norm_rope

from tests.triton_interp import needs_triton, run_bench_tiny, run_in_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5  # the model's (docs/model.md §2)
EXACT_FRACTION = 0.999  # outputs bitwise equal to the reference (the kernel sums squares in another order)


def make_inputs(rows: int, heads: int, d: int, r: int, dtype: torch.dtype, device: str, seed: int = 0):
    """y as a strided view ([rows, 3, heads, d] of wider rows), gains, rope [rows, r] or None (r = 0), and out as a
    row slice of a NaN-filled [3, 1, heads, rows + 7, d] buffer."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, 3 * heads * d + 64, generator=g) * 2).to(dtype)
    q_weight, k_weight = (torch.randn(d, generator=g) * 0.3 + 1 for _ in range(2))
    rope = None
    if r:
        angles = torch.randn(rows, r // 2, generator=g) * 3
        rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    buf = torch.full((3, 1, heads, rows + 7, d), float("nan"), dtype=dtype)
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    rope = tuple(to(t) for t in rope) if rope else None
    y = to(wide)[:, 8:8 + 3 * heads * d].view(rows, 3, heads, d)
    return y, to(q_weight), to(k_weight), rope, to(buf)


def qk_v(out):
    """A [3, 1, heads, rows, d] buffer (or its row slice) as the kernel's two outputs: q/k [2, ...] and v [1, ...]."""
    return out[:2], out[2]


def previous_project_qkv(y, q_norm, k_norm, rope, out):
    """q/k RMSNorm + RoPE + layout write in plain torch ops (after the qkv projection), the oracle."""
    q, k, v = y.unbind(1)
    q, k = q_norm(q), k_norm(k)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    for i, t in enumerate((q, k, v)):
        out[i, 0].copy_(t.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [0, 12])
def test_reference_is_the_previous_math_bit_for_bit(dtype, r):
    y, qw, kw, rope, buf = make_inputs(rows=21, heads=3, d=16, r=r, dtype=dtype, device="cpu")
    q_norm, k_norm = RMSNorm(16, EPS), RMSNorm(16, EPS)
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        expected = buf.clone()
        previous_project_qkv(y, q_norm, k_norm, rope, expected[:, :, :, 5:26])
        qk_norm_rope_reference(y, qw, kw, EPS, rope, *qk_v(buf[:, :, :, 5:26]))
        assert torch.equal(buf.nan_to_num(7.0), expected.nan_to_num(7.0))
        qk_norm_rope(y, qw, kw, EPS, rope, *qk_v(buf[:, :, :, 5:26]))  # the dispatcher on the CPU: the reference
        assert torch.equal(buf.nan_to_num(7.0), expected.nan_to_num(7.0))


def check_kernel(rows: int, heads: int, d: int, r: int, dtype: torch.dtype, device: str,
                 block_rows: int = 32, num_warps: int = 4, exact_fraction: float = EXACT_FRACTION,
                 heads_per_program: int = 1, num_stages: int = 1) -> None:
    """Triton (minimax_h3.kernels.qk_norm_rope.launch) vs the reference: within one ulp of the value, mostly bitwise equal,
    nothing written outside out's rows."""
    from minimax_h3.kernels.qk_norm_rope import launch

    y, qw, kw, rope, buf = make_inputs(rows, heads, d, r, dtype, device)
    ref = buf.clone()
    qk_norm_rope_reference(y, qw, kw, EPS, rope, *qk_v(ref[:, :, :, 3:3 + rows]))
    cos, sin = rope if rope else (None, None)
    launch(y, qw, kw, EPS, cos, sin, *qk_v(buf[:, :, :, 3:3 + rows]), None, block_rows, num_warps, heads_per_program,
           num_stages)
    assert buf[:, :, :, :3].isnan().all() and buf[:, :, :, 3 + rows:].isnan().all(), "wrote outside out"
    got, want = buf[:, :, :, 3:3 + rows].float(), ref[:, :, :, 3:3 + rows].float()
    ulp = torch.finfo(dtype).eps
    excess = (got - want).abs() - ulp * want.abs() - 1e-6
    assert excess.max().item() <= 0, f"max abs error {(got - want).abs().max().item():.3e} exceeds one ulp"
    exact = (got == want).float().mean().item()
    assert exact >= exact_fraction, f"only {exact:.5f} of the outputs are bitwise equal"


def check_kernel_fp8(rows: int, heads: int, d: int, r: int, device: str, max_steps: int, block_rows: int = 32,
                     num_warps: int = 4, with_v: bool = True, heads_per_program: int = 1) -> None:
    """The kernel writing e4m3 q/k with static multipliers (fp8 attention) vs the reference: q/k at most
    `max_steps` e4m3 steps apart, v bitwise equal (with_v=False: no v written at all), nothing written outside the
    rows."""
    from minimax_h3.kernels.fp8_attention import e4m3_steps, static_qk_mult
    from minimax_h3.kernels.qk_norm_rope import launch

    y, qw, kw, rope, buf = make_inputs(rows, heads, d, r, torch.bfloat16, device)
    mult = static_qk_mult(qw, kw)
    qk = torch.full((2, 1, heads, rows + 7, d), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    v = buf[2]
    ref_qk, ref_v = qk.clone(), v.clone()
    if with_v:
        qk_norm_rope_reference(y, qw, kw, EPS, rope, ref_qk[:, :, :, 3:3 + rows], ref_v[:, :, 3:3 + rows], mult)
    else:
        qk_norm_rope_reference(y, qw, kw, EPS, rope, ref_qk[:, :, :, 3:3 + rows], None, mult)
    cos, sin = rope if rope else (None, None)
    launch(y, qw, kw, EPS, cos, sin, qk[:, :, :, 3:3 + rows], v[:, :, 3:3 + rows] if with_v else None, mult,
           block_rows, num_warps, heads_per_program, 2)
    assert torch.equal(qk.view(torch.uint8)[:, :, :, :3], ref_qk.view(torch.uint8)[:, :, :, :3])
    assert torch.equal(qk.view(torch.uint8)[:, :, :, 3 + rows:], ref_qk.view(torch.uint8)[:, :, :, 3 + rows:])
    steps = e4m3_steps(qk[:, :, :, 3:3 + rows], ref_qk[:, :, :, 3:3 + rows])
    assert steps.max().item() <= max_steps, f"q/k {steps.max().item()} e4m3 steps off the reference"
    assert torch.equal(v.nan_to_num(7.0), ref_v.nan_to_num(7.0))


def test_static_qk_scales_bound_normed_roped_rows():
    """static_qk_mult's bound is tight and never exceeded: a row with all its energy in the channel of the largest
    gain (the worst case) reaches 448 in e4m3 units, RoPE included (angle 0 and a quarter turn), and random rows
    stay inside."""
    from minimax_h3.kernels.fp8_attention import E4M3_MAX, static_qk_mult

    heads, d, r = 2, 32, 16
    gains = torch.linspace(0.5, 2.0, d)  # largest gain in the last channel
    for j in (d - 1, r // 2 - 1):  # a pass-through channel, then a rope channel whose partner gets the energy
        w = gains.clone()
        w[j] = 3.0
        mult = static_qk_mult(w, w)
        y = torch.zeros(4, 3, heads, d)
        y[:2, :2, :, j] = 1e3
        y[2:, :2] = torch.randn(2, 2, heads, d) * 5
        angles = torch.tensor([[0.0], [math.pi / 2], [0.3], [2.0]]).expand(4, r // 2)
        rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
        qk, v = torch.empty(2, 1, heads, 4, d), torch.empty(1, heads, 4, d)
        qk_norm_rope_reference(y, w, w, EPS, rope, qk, v)
        scaled = qk.abs() * mult.view(2, 1, 1, 1, 1)
        assert scaled.max().item() <= E4M3_MAX * (1 + 1e-6)
        assert scaled[:, :, :, :2].amax().item() >= E4M3_MAX * 0.999  # the bound is reached: nothing looser


@needs_cuda
@pytest.mark.parametrize("rows,heads", [(1000, 56), (4099, 28)])
@pytest.mark.parametrize("r", [96, 0])
@pytest.mark.parametrize("with_v", [True, False])
def test_triton_fp8_qk_matches_reference_on_gpu(rows, heads, r, with_v):
    check_kernel_fp8(rows, heads, 128, r, "cuda", max_steps=1, with_v=with_v)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,heads", [(1000, 56), (4099, 28)])
@pytest.mark.parametrize("r", [96, 0])
def test_triton_matches_reference_on_gpu(rows, heads, r, dtype):
    check_kernel(rows, heads, 128, r, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("block_rows,num_warps,heads_per_program,num_stages", [(16, 2, 1, 1), (64, 8, 1, 1),
                                                                              (16, 4, 7, 2), (32, 4, 24, 3)])
def test_triton_launch_configs_on_gpu(block_rows, num_warps, heads_per_program, num_stages):
    check_kernel(1000, 8, 128, 96, torch.bfloat16, "cuda", block_rows, num_warps,
                 heads_per_program=heads_per_program, num_stages=num_stages)


@needs_cuda
def test_dispatcher_under_torch_compile_matches_eager():
    y, qw, kw, rope, buf = make_inputs(4099, 28, 128, 96, torch.bfloat16, "cuda")

    def step(y, qw, kw, cos, sin):
        out = torch.empty(3, 1, 28, y.shape[0], 128, dtype=y.dtype, device=y.device)
        qk_norm_rope(y * 2, qw, kw, EPS, (cos, sin), *qk_v(out))
        return out.float() * 0.5  # ops before and after (exact ones: an Inductor sum would reorder its terms)

    eager = step(y, qw, kw, *rope)
    compiled = torch.compile(step, fullgraph=True)(y, qw, kw, *rope)
    assert torch.equal(eager, compiled)


def interpreter_main() -> None:
    """The kernel's indexing and masking in triton's CPU interpreter (TRITON_INTERPRET=1 set before triton is
    imported; run by the test below in a child process). The interpreter computes in numpy and casts to bf16
    toward zero, so only the one-ulp bound is checked here, not the bitwise-equal fraction."""
    for rows, heads, d, r, dtype, block_rows in [(37, 3, 32, 24, torch.bfloat16, 16), (5, 2, 16, 16, torch.float16, 8),
                                                 (19, 2, 32, 0, torch.bfloat16, 32)]:
        check_kernel(rows, heads, d, r, dtype, "cpu", block_rows, exact_fraction=0.0)
    # Several (section, head) pairs per program: a program's range crossing from k into v, and one ending early.
    check_kernel(37, 3, 32, 24, torch.bfloat16, "cpu", 16, exact_fraction=0.0, heads_per_program=4, num_stages=2)
    check_kernel(19, 2, 32, 0, torch.bfloat16, "cpu", 8, exact_fraction=0.0, heads_per_program=5)
    # e4m3 q/k: the interpreter can miss a carry when it rounds to e4m3 (tests/test_fp8_rows.py), hence 8 steps.
    check_kernel_fp8(37, 3, 32, 24, "cpu", max_steps=8, block_rows=16)
    check_kernel_fp8(19, 2, 32, 0, "cpu", max_steps=8)
    check_kernel_fp8(21, 3, 32, 24, "cpu", max_steps=8, block_rows=8, with_v=False)
    check_kernel_fp8(21, 3, 32, 24, "cpu", max_steps=8, block_rows=8, with_v=False, heads_per_program=4)
    # The custom op through torch.compile's graph capture (aot_eager: no C++ compile on the CPU).
    y, qw, kw, (cos, sin), buf = make_inputs(9, 2, 16, 8, torch.bfloat16, "cpu")

    def step(y):
        out = torch.zeros(3, 1, 2, 9, 16, dtype=y.dtype)
        torch.ops.h3stages.qk_norm_rope_(y, qw, kw, EPS, cos, sin, *qk_v(out))
        return out * 2

    assert torch.equal(step(y), torch.compile(step, backend="aot_eager", fullgraph=True)(y))
    print("interpreter ok")


@needs_triton
def test_triton_kernel_in_the_interpreter():
    """interpreter_main in Triton's CPU interpreter (tests/triton_interp.py says how to run it without a GPU)."""
    run_in_interpreter("from tests.test_qk_norm_rope import interpreter_main as m; m()", expect="interpreter ok")


def test_bench_tiny_runs_on_the_cpu(tmp_path):
    """benchmarks/bench_qk_norm_rope.py --tiny: the dry run writes its JSON (the kernel too where triton is installed)."""
    result = run_bench_tiny("bench_qk_norm_rope.py", tmp_path)["qk_norm_rope.json"]
    assert [s["rows"] for s in result["shapes"]] == [37, 100]
    assert all("reference eager" in s["variants"] for s in result["shapes"])


def test_dispatcher_traces_whole_on_the_cpu():
    """torch.compile of a block calls the dispatcher: on the CPU it traces the reference without a graph break."""
    y, qw, kw, rope, _ = make_inputs(9, 2, 16, 8, torch.bfloat16, "cpu")

    def step(y, cos, sin):
        out = torch.empty(3, 1, 2, 9, 16, dtype=y.dtype)
        qk_norm_rope(y, qw, kw, EPS, (cos, sin), *qk_v(out))
        return out * 2

    assert torch.equal(step(y, *rope), torch.compile(step, backend="aot_eager", fullgraph=True)(y, *rope))
