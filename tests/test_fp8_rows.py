"""minimax_h3/kernels/fp8_rows.py: the plain-torch references equal the plain method's AdaLN modulation +
quantize_fp8_rowwise, silu(gate) * value + quantize_fp8_rowwise and fp8 attention's dequantize_o + out_proj's rows +
quantize_fp8_rowwise bit for bit (minimax_h3/kernels/layers.py), and an fp8 linear gives the same output from Fp8Rows as
from the bf16 rows (CPU); the Triton kernels match their references on DiT widths (GPU) and, on small shapes, in
triton's CPU interpreter (indexing, masking, scales; needs triton in the venv, which CI's CPU torch lacks:
`.venv/bin/pip install --no-deps triton`, then
`.venv/bin/python -m pytest tests/test_fp8_rows.py -k interpreter -p no:randomly`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minimax_h3.dit.model import RMSNorm
from minimax_h3.dit.ops import modulate
from minimax_h3.kernels.fp8 import FP8_SCALE_FLOOR, Fp8Rows, quantize_fp8_rowwise
from minimax_h3.kernels.fp8_attention import Fp8Attention, Fp8AttentionOptions, Fp8O, dequantize_o, e4m3_steps
from minimax_h3.kernels.fp8_rows import (add_modulate_fp8, add_modulate_fp8_reference, modulate_fp8,
                                         modulate_fp8_reference, o_rows_fp8, o_rows_fp8_reference, swiglu_fp8,
                                         swiglu_fp8_reference)
from minimax_h3.kernels.layers import PLAIN, Fp8AttentionOutput, fp8_rows_method, linear_method
from minimax_h3.kernels.registry import Fp8RowwiseLinear

from tests.triton_interp import REPO, needs_triton, run_bench_tiny, run_in_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-6
EXACT_FRACTION = 0.999  # e4m3 values bitwise equal to the reference (the kernel sums squares in another order)


def make_inputs(rows: int, c: int, m: int, device: str, seed: int = 0):
    """x as a row slice of a bigger residual, the norm gain (bf16, as the release stores it), shift / scale as
    column chunks of one AdaLN output [M * 3, 6 * C] (the model's layout), r random with repeats over all M * 3
    rows."""
    g = torch.Generator().manual_seed(seed)
    resid = torch.randn(rows + 5, c, generator=g) * 3
    weight = (torch.randn(c, generator=g) * 0.2 + 1).to(torch.bfloat16)
    mod = torch.randn(m * 3, 6 * c, generator=g) * 0.5
    r = torch.randint(0, m * 3, (rows,), generator=g)
    resid[7], mod[0, :c], r[5] = 0.0, 0.0, 0  # row 5 modulates to all zeros: the scale floor
    to = lambda t: t.to(device)  # noqa: E731
    shift, scale = to(mod).chunk(6, dim=-1)[:2]
    return to(resid)[2:2 + rows], to(weight), shift, scale, to(r)


def test_row_tiles_cover_the_row_exactly_or_pad_one_tile():
    """The modulation kernel's tiles: powers of two of at least MIN_TILE adding up to the width, largest first
    (zeros: no tile); a width that does not split so is one tile padded to a power of two."""
    from minimax_h3.kernels.fp8_rows import MIN_TILE, row_tiles

    assert row_tiles(5376) == (4096, 1024, 256) and row_tiles(6144) == (4096, 2048, 0)
    assert row_tiles(4096) == (4096, 0, 0) and row_tiles(640) == (1024, 0, 0) and row_tiles(96) == (128, 0, 0)
    for width in range(16, 20000, 16):
        tiles = row_tiles(width)
        used = [t for t in tiles if t]
        assert all(t & (t - 1) == 0 for t in used) and list(tiles[:len(used)]) == used
        if len(used) > 1:
            assert sum(used) == width and min(used) >= MIN_TILE and used == sorted(used, reverse=True)
        else:
            assert width <= used[0] < 2 * max(width, 16)


def test_reference_is_the_previous_math_bit_for_bit():
    x, w, shift, scale, r = make_inputs(37, 96, 2, "cpu")
    norm = RMSNorm(96, EPS)
    with torch.no_grad():
        norm.weight.copy_(w)
    # The plain method's AdaLN modulation (minimax_h3/kernels/layers.py), then what Fp8RowwiseLinear does with it
    h = (norm(x) * (1.0 + scale.index_select(0, r)) + shift.index_select(0, r)).to(torch.bfloat16)
    want_q, want_s = quantize_fp8_rowwise(h)
    for got in (modulate_fp8_reference(x, w, EPS, shift, scale, r), modulate_fp8(x, w, EPS, shift, scale, r)):
        assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got.scale, want_s)


def test_fp8_linear_takes_fp8_rows():
    """Fp8RowwiseLinear (emulated) gives the same output from Fp8Rows as from the bf16 rows it would quantise."""
    x, w, shift, scale, r = make_inputs(37, 96, 1, "cpu")
    lin = Fp8RowwiseLinear.from_dense(torch.randn(48, 96), torch.randn(48), emulate=True)
    assert linear_method(lin) is fp8_rows_method("cpu") and linear_method(torch.nn.Linear(2, 2)) is PLAIN
    h = modulate(x, w, EPS, shift, scale, r, torch.bfloat16)
    rows = modulate_fp8_reference(x, w, EPS, shift, scale, r)
    assert torch.equal(lin(rows), lin(h))
    with pytest.raises(ValueError, match="Fp8Rows must be"):
        lin(Fp8Rows(rows.q[:, :64], rows.scale))


def assert_rows_match(q: torch.Tensor, s: torch.Tensor, want: Fp8Rows, scale_rtol: float, max_steps: int,
                      exact_fraction: float, zero_row: bool) -> None:
    """A kernel's (q, scale) against the reference's Fp8Rows: same shapes, row scales within scale_rtol relative,
    e4m3 values at most max_steps apart and at least exact_fraction bitwise equal; zero_row: row 5 is all zeros,
    so it gets the floor scale and zero values."""
    assert q.shape == want.q.shape and q.dtype == torch.float8_e4m3fn and s.shape == (q.shape[0], 1)
    rel = ((s - want.scale).abs() / want.scale).max().item()
    assert rel <= scale_rtol, f"row scales differ by {rel:.2e} relative"
    if zero_row:
        floor = torch.tensor(FP8_SCALE_FLOOR, dtype=torch.float32).item()
        assert s[5].item() == want.scale[5].item() == floor and not q[5].float().any(), "a zero row: the floor"
    steps = e4m3_steps(q, want.q)
    assert steps.max().item() <= max_steps, f"e4m3 values up to {steps.max().item()} steps apart"
    exact = (steps == 0).float().mean().item()
    assert exact >= exact_fraction, f"only {exact:.5f} of the e4m3 values are bitwise equal"


def check_kernel(rows: int, c: int, m: int, device: str, block_rows: int = 1, num_warps: int = 8,
                 interpreted: bool = False, programs_per_sm: int | None = None) -> None:
    """Triton (minimax_h3.kernels.fp8_rows.launch) vs the reference: scales within 1e-6 relative, e4m3 values never more
    than one step apart and mostly bitwise equal. `interpreted`: triton's CPU
    interpreter casts to bf16 toward zero (a scale one bf16 ulp off) and can miss the carry into the next power of
    two when it rounds to e4m3 (a value half the reference's, 8 steps): bounds loose enough for that, tight enough
    for a wrong index."""
    scale_rtol, max_steps, exact_fraction = (2.0 ** -7, 8, 0.8) if interpreted else (1e-6, 1, EXACT_FRACTION)
    from minimax_h3.kernels.fp8_rows import launch

    x, w, shift, scale, r = make_inputs(rows, c, m, device)
    want = modulate_fp8_reference(x, w, EPS, shift, scale, r)
    q, s = launch(x, w, EPS, shift, scale, r, block_rows, num_warps, programs_per_sm)
    assert_rows_match(q, s, want, scale_rtol, max_steps, exact_fraction, zero_row=True)


@needs_cuda
@pytest.mark.parametrize("rows", [1000, 4099])
@pytest.mark.parametrize("c", [5376, 640])
def test_triton_matches_reference_on_gpu(rows, c):
    check_kernel(rows, c, 2, "cuda")


@needs_cuda
@pytest.mark.parametrize("block_rows,num_warps,programs_per_sm", [(2, 8, 0), (1, 16, 0), (1, 4, 0), (2, 16, 0),
                                                                   (1, 4, 2), (1, 8, 4), (2, 8, 1)])
def test_triton_launch_configs_on_gpu(block_rows, num_warps, programs_per_sm):
    check_kernel(1000, 5376, 1, "cuda", block_rows, num_warps, programs_per_sm=programs_per_sm)


@needs_cuda
def test_dispatcher_under_torch_compile_matches_eager():
    x, w, shift, scale, r = make_inputs(4099, 5376, 1, "cuda")

    def step(x, w, shift, scale, r):
        q, s = modulate_fp8(x * 2, w, EPS, shift, scale, r)  # ops before and after (exact ones)
        return q.float() * s * 0.5

    eager = step(x, w, shift, scale, r)
    compiled = torch.compile(step, fullgraph=True)(x, w, shift, scale, r)
    assert torch.equal(eager, compiled)


@needs_cuda
def test_block_feeds_fp8_rows_to_fp8_linears(monkeypatch):
    """A tiny DiT with fp8 qkv_proj / fc1 / fc2 on the GPU: their method hands qkv_proj / fc1 Fp8Rows from the
    modulation kernel (fc1's with the attention's gated residual add made in it: one row chunk, one rank) and fc2
    Fp8Rows from swiglu_fp8, and the output equals the one where those linears quantise the bf16 rows themselves
    (the plain method set per instance)."""
    from minimax_h3.kernels import fp8_rows

    added = []
    kernel = fp8_rows.add_modulate_fp8
    monkeypatch.setattr(fp8_rows, "add_modulate_fp8", lambda *a: added.append(1) or kernel(*a))
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.layout import build_layout
    from minimax_h3.dit.model import H3DiT

    cfg = DiTConfig.tiny()
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.bfloat16).eval()
    fp8 = [n for n in model.linear_names() if n.startswith("blocks.") and n.endswith(("qkv_proj", "fc1", "fc2"))]
    for name in fp8:
        model.swap_linear(name, Fp8RowwiseLinear.from_dense(model.get_submodule(name).weight.detach().float()))
    model.cuda()
    seen = []
    for name in fp8:
        model.get_submodule(name).register_forward_pre_hook(lambda mod, args: seen.append(type(args[0])))
    lay = build_layout(cfg, 6, 22, 64, 96, ("last",)).to("cuda")
    g = torch.Generator().manual_seed(1)
    video, audio, text = (torch.randn(n, d, generator=g).cuda() for n, d in (
        (lay.num_video_rows, cfg.video_patch_dim), (lay.num_audio_rows, cfg.audio_in_channels),
        (lay.text_len, cfg.text_dim)))
    with torch.no_grad():
        fused = model(video, audio, text, 0.3, 0.5, lay)
        assert len(seen) == len(fp8) and all(t is Fp8Rows for t in seen)
        assert len(added) == 2 * cfg.num_layers - 1  # fc1 of every block, qkv_proj of every block but the first
        for name in fp8:
            model.get_submodule(name).linear_method = PLAIN
        seen.clear()
        plain = model(video, audio, text, 0.3, 0.5, lay)
        assert len(seen) == len(fp8) and all(t is torch.Tensor for t in seen)
    for a, b in zip(fused, plain):
        assert (a - b).norm() <= 1e-2 * b.norm()


# --- Gated residual add + modulation + fp8 row quantisation ----------------------------------------------------


def make_add_inputs(rows: int, c: int, m: int, device: str, seed: int = 0):
    """`make_inputs` plus the add's gate (a third column chunk of the same AdaLN output) and part (bf16, as out_proj
    writes it, inside a wider buffer: row stride C + 8)."""
    x, w, shift, scale, r = make_inputs(rows, c, m, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    gate = (torch.randn(m * 3, 6 * c, generator=g) * 0.5).to(device)[:, 2 * c:3 * c]
    part = (torch.randn(rows, c + 8, generator=g) * 2).to(device=device, dtype=torch.bfloat16)[:, 4:4 + c]
    if rows > 5:
        part[5] = 0.0  # row 5 of x modulates to all zeros (make_inputs) and still does after the add: the scale floor
    return x, gate, part, w, shift, scale, r


def test_add_reference_is_the_previous_math_bit_for_bit():
    """The block's gated add of the out_proj rows (fp32 partial sums), then the modulation and fc1's quantiser: the
    same x and the same rows as the reference (and the dispatcher on the CPU), from the bf16 out_proj rows."""
    x, gate, part, w, shift, scale, r = make_add_inputs(37, 96, 2, "cpu")
    want_x = x.clone()
    want_x += gate.index_select(0, r) * part.float()
    want = modulate_fp8_reference(want_x, w, EPS, shift, scale, r)
    for fn in (add_modulate_fp8_reference, add_modulate_fp8):
        got_x = x.clone()
        got = fn(got_x, gate, part, w, EPS, shift, scale, r)
        assert torch.equal(got_x, want_x)
        assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)


def check_add_kernel(rows: int, c: int, m: int, device: str, block_rows: int = 1, num_warps: int = 8,
                     interpreted: bool = False, programs_per_sm: int | None = None) -> None:
    """Triton with the residual add (minimax_h3.kernels.fp8_rows.add_launch) vs the reference: x bitwise equal (one
    fp32 product and one sum per element, as torch takes them), the rows within `check_kernel`'s bounds."""
    scale_rtol, max_steps, exact_fraction = (2.0 ** -7, 8, 0.8) if interpreted else (1e-6, 1, EXACT_FRACTION)
    from minimax_h3.kernels.fp8_rows import add_launch

    x, gate, part, w, shift, scale, r = make_add_inputs(rows, c, m, device)
    want_x = x.clone()
    want = add_modulate_fp8_reference(want_x, gate, part, w, EPS, shift, scale, r)
    q, s = add_launch(x, gate, part, w, EPS, shift, scale, r, block_rows, num_warps, programs_per_sm)
    assert torch.equal(x, want_x)
    assert_rows_match(q, s, want, scale_rtol, max_steps, exact_fraction, zero_row=rows > 5)


@needs_cuda
@pytest.mark.parametrize("rows,c", [(4099, 5376), (1000, 640)])
def test_add_triton_matches_reference_on_gpu(rows, c):
    check_add_kernel(rows, c, 2, "cuda")


@needs_cuda
@pytest.mark.parametrize("block_rows,num_warps,programs_per_sm", [(1, 4, 0), (1, 16, 0), (2, 8, 0), (1, 8, 2),
                                                                   (1, 4, 4), (2, 8, 1)])
def test_add_triton_launch_configs_on_gpu(block_rows, num_warps, programs_per_sm):
    check_add_kernel(1000, 5376, 1, "cuda", block_rows, num_warps, programs_per_sm=programs_per_sm)


@needs_cuda
def test_add_dispatcher_under_torch_compile_matches_eager():
    """The op writes x: through torch.compile (as in a compiled block: x a row slice of the caller's residual) x and
    the rows come out as in eager."""
    x, gate, part, w, shift, scale, r = make_add_inputs(4099, 5376, 1, "cuda")
    resid = torch.cat([x, x[:3]])

    def step(resid, part):
        q, s = add_modulate_fp8(resid[:4099], gate, part * 2, w, EPS, shift, scale, r)  # ops before and after
        return q.float() * s * 0.5

    eager_resid, compiled_resid = resid.clone(), resid.clone()
    eager = step(eager_resid, part)
    compiled = torch.compile(step, fullgraph=True)(compiled_resid, part)
    assert torch.equal(eager, compiled) and torch.equal(eager_resid, compiled_resid)
    assert not torch.equal(eager_resid, resid)


def test_deferred_gated_adds_give_the_same_bits(monkeypatch):
    """Block.defers (a GPU, one row chunk, one rank) leaves each gated residual add to the next modulation of the
    rows: step 4's to fc1's, step 5's to the next block's qkv_proj's, the last block's made by H3DiT.forward. Forced
    on in eager CPU blocks with fp8 (emulated) and plain linears: the output is bit for bit the one of adding in
    place, and the linears' methods made every add but the last."""
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.layout import build_layout
    from minimax_h3.dit.model import Block, H3DiT
    from minimax_h3.kernels.layers import LinearMethod

    cfg = DiTConfig.tiny()
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.bfloat16).eval()
    for name in ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc1"):  # one fp8 method, one plain, at each kind of add
        model.swap_linear(name, Fp8RowwiseLinear.from_dense(model.get_submodule(name).weight.detach().float(),
                                                            emulate=True))
    lay = build_layout(cfg, 6, 22, 64, 96, ("last",))
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(n, d, generator=g) for n, d in ((lay.num_video_rows, cfg.video_patch_dim),
                                                        (lay.num_audio_rows, cfg.audio_in_channels),
                                                        (lay.text_len, cfg.text_dim))]
    made = []
    apply_added = LinearMethod.apply_added
    monkeypatch.setattr(LinearMethod, "apply_added",
                        lambda self, *a, **k: made.append(1) or apply_added(self, *a, **k))
    with torch.no_grad():
        assert not model.blocks[0].defers(torch.zeros(3, cfg.hidden))  # the CPU adds in place
        in_place = model(*args, 0.3, 0.5, lay)
        assert not made
        monkeypatch.setattr(Block, "defers", lambda self, x: True)
        deferred = model(*args, 0.3, 0.5, lay)
    assert len(made) == 2 * cfg.num_layers - 1
    assert all(torch.equal(a, b) for a, b in zip(deferred, in_place))


# --- SwiGLU + fp8 row quantisation ------------------------------------------------------------------------------


def make_swiglu_input(rows: int, f: int, device: str, seed: int = 0) -> torch.Tensor:
    """y [rows, 2F] bf16 = [gate | value] as a view inside a wider, taller fc1 output (row stride 2F + 10), gates
    wide enough to saturate exp both ways; row 5 (when there is one) is all zeros: the scale floor."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows + 3, 2 * f + 10, generator=g) * 3
    full[:, 4:4 + f] *= torch.rand(rows + 3, 1, generator=g) * 12  # some rows' gates reach |x| ~ 100
    full[6:7] = 0.0
    return full.to(device=device, dtype=torch.bfloat16)[1:1 + rows, 4:4 + 2 * f]


def test_swiglu_reference_is_the_previous_math_bit_for_bit():
    y = make_swiglu_input(37, 96, "cpu")
    gate, value = y.chunk(2, dim=-1)
    want_q, want_s = quantize_fp8_rowwise(F.silu(gate) * value)  # MLP.partial before the kernel, then fc2's quantiser
    for got in (swiglu_fp8_reference(y), swiglu_fp8(y)):
        assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got.scale, want_s)


def test_swiglu_division_sequence_is_ieee():
    """The SwiGLU kernel's division on CUDA (minimax_h3/kernels/fp8_rows._div_rn: approximate reciprocal, a Newton step, the
    quotient and one correction, all FMAs; the fast path nvcc emits for IEEE division) emulated here, for every
    bf16 gate over its 1 + exp(-gate) and for random bf16 numerators over b in [1, 2^126): from the correctly
    rounded reciprocal, the IEEE fp32 quotient; from one up to 2 ulps off (the hardware's approximation), a quotient
    whose bf16 rounding (all the kernel keeps) is still the IEEE one's."""
    def fma(x, y, z):
        """fp32 fma: the product is exact in fp64; the sum is rounded to odd in fp64 (its error from TwoSum), which
        the rounding to fp32 then turns into the correctly rounded result (no double rounding)."""
        p, z = x.double() * y.double(), z.double()
        s = p + z
        v = s - p
        err = (p - (s - v)) + (z - v)
        bits = s.view(torch.int64)
        fix = (err != 0) & (bits % 2 == 0)
        bits = bits + torch.where(fix, torch.where((err > 0) == (s > 0), 1, -1), 0)
        return bits.view(torch.float64).float()

    def div(a, b, ulps):
        r = ((1 / b).view(torch.int32) + ulps).view(torch.float32)
        r = fma(fma(-b, r, torch.ones_like(b)), r, r)
        q = a * r
        return fma(fma(-b, q, a), r, q)

    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    b = 1 + torch.exp(-gate)
    keep = gate.isfinite() & (gate != 0) & (b < 2.0 ** 126)
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(200_000, generator=g) * torch.exp(torch.rand(200_000, generator=g) * 40 - 20)).bfloat16().float()
    rand_b = torch.exp2(torch.rand(200_000, generator=g) * 125.9)
    a, b = torch.cat([gate[keep], a[a != 0]]), torch.cat([b[keep], rand_b[a != 0]])
    want = a / b
    assert torch.equal(div(a, b, 0).view(torch.int32), want.view(torch.int32))
    for ulps in (-2, -1, 1, 2):
        assert torch.equal(div(a, b, ulps).bfloat16().view(torch.int16), want.bfloat16().view(torch.int16)), ulps


def check_swiglu_kernel(rows: int, f: int, device: str, block_rows: int = 1, num_warps: int = 32,
                        interpreted: bool = False) -> None:
    """Triton (minimax_h3.kernels.fp8_rows.swiglu_launch) vs the reference, bounds as `check_kernel`; in the interpreter
    both bf16 roundings (silu, then the product) truncate, so a scale may be up to two bf16 ulps off."""
    scale_rtol, max_steps, exact_fraction = (2.0 ** -6, 8, 0.8) if interpreted else (1e-6, 1, EXACT_FRACTION)
    from minimax_h3.kernels.fp8_rows import swiglu_launch

    y = make_swiglu_input(rows, f, device)
    want = swiglu_fp8_reference(y)
    q, s = swiglu_launch(y, block_rows, num_warps)
    assert want.q.shape == (rows, f)
    assert_rows_match(q, s, want, scale_rtol, max_steps, exact_fraction, zero_row=rows > 5)


@needs_cuda
@pytest.mark.parametrize("rows,f", [(4099, 14336), (1001, 1792), (37, 640)])
def test_swiglu_triton_matches_reference_on_gpu(rows, f):
    check_swiglu_kernel(rows, f, "cuda")


@needs_cuda
@pytest.mark.parametrize("block_rows,num_warps", [(1, 16), (2, 16), (4, 16), (2, 32)])
def test_swiglu_triton_launch_configs_on_gpu(block_rows, num_warps):
    check_swiglu_kernel(1000, 14336, "cuda", block_rows, num_warps)


@needs_cuda
def test_swiglu_dispatcher_under_torch_compile_matches_eager():
    y = make_swiglu_input(4099, 14336, "cuda")

    def step(y):
        q, s = swiglu_fp8(y * 2)  # ops before and after (exact ones)
        return q.float() * s * 0.5

    assert torch.equal(step(y), torch.compile(step, fullgraph=True)(y))


# --- O dequantisation + fp8 row quantisation -------------------------------------------------------------------


def make_o_input(h: int, rows: int, d: int, device: str, layout: str = "hsd", shift: bool = True,
                 seed: int = 0, whole: bool = False, fa3: bool = False) -> Fp8O:
    """fp8 attention's O as `Fp8O`, o8 = rows [2, 2 + rows) (what one row chunk's out_proj takes) of a bigger O
    [h, rows + 5, d] e4m3 (returned instead with `whole`), laid out [H, S, D] ("hsd", the kernel's own) or
    [S, H, D]-backed ("shd", strided heads); heads with scales 1e-4 .. 1e-2 (a row's amax comes from a few heads);
    the shift [h, 1, d] or None. When there are 6+ rows, row 5 of o8 is all zeros (without a shift: the floor).
    fa3: FlashAttention-3's O instead, bf16 in the layout asked for (its own is "shd"), heads 1e-4 .. 1e-2 in size,
    unit scales."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows + 5, h, d, generator=g) * 150).clamp(-448, 448)
    full[7:8] = 0.0
    o_scale = torch.exp(torch.rand(h, 1, 1, generator=g) * -4.6) * 1e-2
    if fa3:
        full, o_scale = (full * o_scale.reshape(1, h, 1)).bfloat16(), torch.ones(h, 1, 1)
    else:
        full = full.to(torch.float8_e4m3fn)
    o8 = full.permute(1, 0, 2) if layout == "shd" else full.permute(1, 0, 2).contiguous()
    o_shift = torch.randn(h, 1, d, generator=g) * 0.05 if shift else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    o = Fp8O(to(o8), to(o_scale), to(o_shift))
    return o if whole else Fp8O(o.o8[:, 2:2 + rows], o.o_scale, o.o_shift)


@pytest.mark.parametrize("shift,fa3", [(True, False), (False, False), (True, True)])
def test_o_rows_reference_is_the_previous_math_bit_for_bit(shift, fa3):
    """The plain path: fp8 attention dequantises all of O ([1, H, S, D] bf16), out_proj takes a chunk's rows, heads
    side by side, and the fp8 out_proj quantises them."""
    o, whole = (make_o_input(3, 11, 32, "cpu", "shd" if fa3 else "hsd", shift=shift, whole=w, fa3=fa3)
                for w in (False, True))
    o_all = dequantize_o(*whole, torch.bfloat16).unsqueeze(0)[:, :, 2:13]
    want_q, want_s = quantize_fp8_rowwise(o_all[0].transpose(0, 1).reshape(11, 3 * 32))
    for got in (o_rows_fp8_reference(*o), o_rows_fp8(*o)):
        assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got.scale, want_s)


def check_o_rows_kernel(h: int, rows: int, d: int, device: str, block_rows: int = 1, num_warps: int = 16,
                        interpreted: bool = False, layout: str = "hsd", shift: bool = True, fa3: bool = False,
                        programs_per_sm: int | None = None) -> None:
    """Triton (minimax_h3.kernels.fp8_rows.o_rows_launch) vs the reference, bounds as `check_kernel` (one bf16 rounding
    before the row quantisation, as there)."""
    scale_rtol, max_steps, exact_fraction = (2.0 ** -7, 8, 0.8) if interpreted else (1e-6, 1, EXACT_FRACTION)
    from minimax_h3.kernels.fp8_rows import o_rows_launch

    o = make_o_input(h, rows, d, device, layout, shift, fa3=fa3)
    want = o_rows_fp8_reference(*o)
    q, s = o_rows_launch(*o, block_rows, num_warps, programs_per_sm)
    assert want.q.shape == (rows, h * d)
    assert_rows_match(q, s, want, scale_rtol, max_steps, exact_fraction, zero_row=rows > 5 and not shift)


@needs_cuda
@pytest.mark.parametrize("layout,shift,fa3", [("hsd", True, False), ("shd", True, False), ("hsd", False, False),
                                              ("shd", True, True), ("shd", False, True)])
def test_o_rows_triton_matches_reference_on_gpu(layout, shift, fa3):
    check_o_rows_kernel(56, 4099, 128, "cuda", layout=layout, shift=shift, fa3=fa3)


@needs_cuda
@pytest.mark.parametrize("block_rows,num_warps,programs_per_sm", [(1, 8, 0), (2, 16, 0), (1, 32, 0), (4, 16, 0),
                                                                   (1, 4, 2), (1, 8, 1), (2, 8, 2)])
def test_o_rows_triton_launch_configs_on_gpu(block_rows, num_warps, programs_per_sm):
    check_o_rows_kernel(56, 1001, 128, "cuda", block_rows, num_warps, programs_per_sm=programs_per_sm)
    if programs_per_sm:  # FA3's bf16 O in its [S, H, D] layout, as the model hands it over
        check_o_rows_kernel(56, 1001, 128, "cuda", block_rows, num_warps, layout="shd", fa3=True,
                            programs_per_sm=programs_per_sm)


@needs_cuda
def test_o_rows_dispatcher_under_torch_compile_matches_eager():
    o = make_o_input(56, 4099, 128, "cuda")

    def step(o8, o_scale, o_shift):
        q, s = o_rows_fp8(o8, o_scale * 2, o_shift)  # ops before and after (exact ones)
        return q.float() * s * 0.5

    assert torch.equal(step(*o), torch.compile(step, fullgraph=True)(*o))


def _tiny_fp8_out_proj_model(device: str, kernel: str = "cudnn"):
    """A tiny bf16 DiT whose blocks' out_proj are fp8 linears (emulated on the CPU) and whose attention is fp8
    (emulated: cuDNN's or FA3's arithmetic, `kernel`, any device) on every sequence, with a hook recording what
    out_proj gets."""
    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.layout import build_layout
    from minimax_h3.dit.model import H3DiT

    cfg = DiTConfig.tiny()
    torch.manual_seed(0)
    model = H3DiT(cfg, compute_dtype=torch.bfloat16, chunk_rows=40).eval()
    names = [n for n in model.linear_names() if n.startswith("blocks.") and n.endswith("out_proj")]
    for name in names:
        model.swap_linear(name, Fp8RowwiseLinear.from_dense(model.get_submodule(name).weight.detach().float(),
                                                            emulate=device == "cpu"))
    model.set_attention_fn(Fp8Attention(Fp8AttentionOptions(min_seq=0, static_qk=True), emulate=True,
                                        kernel=kernel))
    model.to(device)
    seen = []
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(lambda mod, args: seen.append(type(args[0])))
    lay = build_layout(cfg, 3, 22, 64, 64).to(device)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, d, generator=g).to(device) for n, d in (
        (lay.num_video_rows, cfg.video_patch_dim), (lay.num_audio_rows, cfg.audio_in_channels),
        (lay.text_len, cfg.text_dim))]
    return model, names, seen, (*inputs, 0.3, 0.5, lay)


@pytest.mark.parametrize("kernel", ["cudnn", "fa3"])
def test_model_hands_fp8_o_to_an_fp8_out_proj_on_the_cpu(kernel):
    """Attention.attend hands an fp8 out_proj fp8 attention's O as the kernel wrote it (Fp8AttentionOutput: cuDNN's
    e4m3, FA3's bf16); on the CPU its method dequantises each row chunk of it, which gives the bits the plain path
    (dequantise all of O, then chunk) gives: with out_proj's plain method set per instance, attend dequantises O
    itself."""
    from minimax_h3.dit.model import Attention

    model, names, seen, args = _tiny_fp8_out_proj_model("cpu", kernel)
    kept = []
    for mod in model.modules():
        if isinstance(mod, Attention):  # records its outputs
            mod.attend = (lambda f: lambda *a: kept.append(f(*a)) or kept[-1])(mod.attend)
    with torch.no_grad():
        fused = model(*args)
        assert any(isinstance(o, Fp8AttentionOutput) for o in kept)
        for name in names:
            model.get_submodule(name).linear_method = PLAIN
        kept.clear()
        plain = model(*args)
        assert kept and not any(isinstance(o, Fp8AttentionOutput) for o in kept)
    assert all(t is torch.Tensor for t in seen)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("kernel", ["cudnn", "fa3"])
def test_model_feeds_o_rows_to_an_fp8_out_proj_on_gpu(kernel):
    """The same tiny model on the GPU: out_proj gets Fp8Rows from the O-rows kernel, and the output is the one where
    out_proj quantises the bf16 O rows itself, up to the rare e4m3 step."""
    model, names, seen, args = _tiny_fp8_out_proj_model("cuda", kernel)
    with torch.no_grad():
        fused = model(*args)
        assert seen and all(t is Fp8Rows for t in seen)
        for name in names:
            model.get_submodule(name).linear_method = PLAIN
        seen.clear()
        plain = model(*args)
        assert seen and all(t is torch.Tensor for t in seen)
    for a, b in zip(fused, plain):
        assert (a - b).norm() <= 1e-2 * b.norm()


def interpreter_main() -> None:
    """The kernel's indexing and masking in triton's CPU interpreter (TRITON_INTERPRET=1 set before triton is
    imported; run by the test below in a child process). The interpreter computes in numpy, and its bf16 / e4m3
    casts round differently (see check_kernel)."""
    for rows, c, m, block_rows in [(13, 96, 2, 1), (9, 40, 1, 4), (6, 64, 3, 2)]:
        check_kernel(rows, c, m, "cpu", block_rows, interpreted=True)
    # Programs that loop over the row blocks (one SM on the CPU: 2 or 3 programs), the next block's loads ahead.
    for rows, c, m, block_rows, per_sm in [(13, 96, 2, 1, 2), (9, 40, 1, 2, 3), (11, 1280, 1, 1, 2)]:
        check_kernel(rows, c, m, "cpu", block_rows, interpreted=True, programs_per_sm=per_sm)
    from minimax_h3.kernels.fp8_rows import launch

    x, w, shift, scale, r = make_inputs(21, 40, 1, "cpu")
    want = launch(x, w, EPS, shift, scale, r)
    q, s = launch(x.t().contiguous().t(), w, EPS, shift, scale, r)  # column stride 21: the same rows
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        launch(x, w, EPS, shift, scale, r, block_rows=3)
    # The custom op through torch.compile's graph capture (aot_eager: no C++ compile on the CPU).
    x, w, shift, scale, r = make_inputs(9, 40, 1, "cpu")

    def step(x):
        q, s = torch.ops.h3stages.modulate_fp8_rows(x, w, EPS, shift, scale, r)
        return q.float() * s

    assert torch.equal(step(x), torch.compile(step, backend="aot_eager", fullgraph=True)(x))
    # With the residual add: x updated in place (also a row slice of a bigger residual, through graph capture).
    for rows, c, m, block_rows in [(13, 96, 2, 1), (9, 40, 1, 4)]:
        check_add_kernel(rows, c, m, "cpu", block_rows, 4, interpreted=True)
    for rows, c, m, block_rows, per_sm in [(13, 96, 2, 1, 2), (9, 1280, 1, 2, 3)]:
        check_add_kernel(rows, c, m, "cpu", block_rows, 4, interpreted=True, programs_per_sm=per_sm)
    x, gate, part, w, shift, scale, r = make_add_inputs(9, 40, 1, "cpu")
    resid = torch.cat([x, x[:2]])

    def add_step(resid):
        q, s = torch.ops.h3stages.add_modulate_fp8_rows(resid[:9], gate, part, w, EPS, shift, scale, r)
        return q.float() * s

    eager_resid, compiled_resid = resid.clone(), resid.clone()
    out = add_step(eager_resid)
    assert torch.equal(out, torch.compile(add_step, backend="aot_eager", fullgraph=True)(compiled_resid))
    assert torch.equal(eager_resid, compiled_resid) and not torch.equal(eager_resid, resid)
    # SwiGLU: odd row counts, power-of-two and other F, strided views (make_swiglu_input), several rows per program.
    for rows, f, block_rows in [(13, 96, 1), (9, 40, 4), (6, 64, 2), (1, 16, 1)]:
        check_swiglu_kernel(rows, f, "cpu", block_rows, 4, interpreted=True)
    y = make_swiglu_input(9, 40, "cpu")

    def swiglu_step(y):
        q, s = torch.ops.h3stages.swiglu_fp8_rows(y)
        return q.float() * s

    assert torch.equal(swiglu_step(y), torch.compile(swiglu_step, backend="aot_eager", fullgraph=True)(y))
    # O rows: row slices of a bigger O in both memory layouts, H * D a power of two or not, odd row counts, with
    # and without the V-smoothing shift, several rows per program.
    for h, rows, d, block_rows, layout, shift in [(3, 13, 32, 1, "hsd", True), (5, 9, 16, 4, "shd", True),
                                                  (2, 6, 64, 2, "hsd", False), (7, 1, 16, 1, "shd", False)]:
        check_o_rows_kernel(h, rows, d, "cpu", block_rows, 4, interpreted=True, layout=layout, shift=shift)
    check_o_rows_kernel(5, 9, 16, "cpu", 2, 4, interpreted=True, layout="shd", fa3=True)  # FA3's bf16 O
    # Programs that loop over the row blocks (one SM on the CPU), the next block's O loaded ahead.
    for h, rows, d, block_rows, layout, fa3, per_sm in [(3, 13, 32, 1, "hsd", False, 2),
                                                         (5, 9, 16, 2, "shd", True, 3)]:
        check_o_rows_kernel(h, rows, d, "cpu", block_rows, 4, interpreted=True, layout=layout, fa3=fa3,
                            programs_per_sm=per_sm)
    for shift in (True, False):  # (the op's optional shift: None through the graph too)
        o = make_o_input(3, 9, 32, "cpu", shift=shift)

        def o_rows_step(o8, o_scale, o_shift):
            q, s = torch.ops.h3stages.o_rows_fp8(o8, o_scale, o_shift)
            return q.float() * s

        assert torch.equal(o_rows_step(*o), torch.compile(o_rows_step, backend="aot_eager", fullgraph=True)(*o))
    print("interpreter ok")


@needs_triton
def test_triton_kernel_in_the_interpreter():
    """interpreter_main in Triton's CPU interpreter (tests/triton_interp.py says how to run it without a GPU)."""
    run_in_interpreter("from tests.test_fp8_rows import interpreter_main as m; m()", expect="interpreter ok")


@needs_triton
def test_kernel_registers_compiles_for_sm90():
    """benchmarks/kernel_registers.py: the SwiGLU, O-rows and modulation-with-add kernels at their sm_90 launches
    (tuning.json) compile for sm_90 on the CPU and do not spill (a per-element slow-path division, say, would show
    here)."""
    from minimax_h3.kernels.tuning import arch_entry

    for op, kernel in (("swiglu", "swiglu_fp8_rows"), ("orows", "o_rows_fp8"), ("addmod", "add_modulate_fp8_rows")):
        config = f"{arch_entry('sm_90')[kernel]['block_rows']}x{arch_entry('sm_90')[kernel]['num_warps']}"
        run = subprocess.run([sys.executable, "benchmarks/kernel_registers.py", "--ops", op, "--configs", config],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and " 0 B spilled" in run.stdout, run.stdout + run.stderr


def test_bench_tiny_runs_on_the_cpu(tmp_path):
    """benchmarks/bench_fp8_rows.py --tiny: the dry run writes one JSON per op (the kernels too where triton is
    installed)."""
    results = run_bench_tiny("bench_fp8_rows.py", tmp_path)
    assert sorted(results) == ["add_modulate_fp8.json", "fp8_rows.json", "o_rows_fa3.json", "o_rows_fp8.json",
                               "swiglu_fp8.json"]
    for result in results.values():
        assert [s["rows"] for s in result["shapes"]] == [37, 100]
        assert all("reference eager" in s["variants"] for s in result["shapes"])
