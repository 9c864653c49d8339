"""fp8 attention (minimax_h3/kernels/fp8_attention.py): quantisation math, K/V smoothing and per-head V scales on CPU through
the kernel's fp32 emulation, the registry's fallback without nvidia-cudnn-frontend, and (GPU only) cuDNN's kernel
against the emulation."""

import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.ops import qk_norm_rope_reference
from minimax_h3.kernels.fp8_attention import (
                                              DEFAULT_OPTIONS,
                                              E4M3,
                                              E4M3_MAX,
                                              KERNEL_VS_EMULATION_FACTOR,
                                              KERNEL_VS_EMULATION_SLACK,
                                              OPTIONS,
                                              OUTPUT_SCALE,
                                              SOFTMAX_SCALE,
                                              Fp8Attention,
                                              Fp8AttentionOptions,
                                              Fp8QKInput,
                                              TritonQuantLaunch,
                                              declare_graph,
                                              dequantize_o,
                                              e4m3_steps,
                                              plan_key,
                                              quantize_qkv,
                                              quantize_qkv_triton,
                                              quantize_v,
                                              quantize_v_triton,
                                              scale_constants,
                                              sdpa_fp8_emulated,
                                              static_qk_mult,
                                              triton,
                                              unavailable,
                                              variant_pack,
                                              )
from minimax_h3.kernels.registry import (
                                         REL_ERR_BOUND,
                                         AttentionCandidate,
                                         KernelConfig,
                                         KernelError,
                                         default_attention_candidates,
                                         rel_err,
                                         select_kernels,
                                         )
from tests.dit_ranks import random_inputs
from tests.triton_interp import needs_triton, run_in_interpreter

ALL_ROWS = Fp8AttentionOptions(min_seq=0)  # the default options, also on the short test sequences
# The registry probe at CPU-test size (the selection logic, not the speed, is what these tests check).
TINY_PROBE = KernelConfig(linear_shapes=((64, 256, 128),), attention_shape=(1, 2, 64, 32), probe_iters=1,
                          compute_dtype=torch.float32)


def _ref(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double())


def _qkv(h=4, s=512, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g) for _ in range(3)]


def _emulated(options, **kw):
    return Fp8Attention(Fp8AttentionOptions(**{**options.__dict__, "min_seq": 0, **kw}), emulate=True)


def test_quantize_layout_scales_and_roundtrip():
    q, k, v = (t[0] for t in _qkv(h=3, s=200, d=32))  # [H, S, D]
    v = v * torch.tensor([1e-2, 1.0, 30.0])[:, None, None] + 2.0
    p = quantize_qkv(q, k, v, DEFAULT_OPTIONS)
    for t in (p.q8, p.k8, p.v8):
        assert t.dtype == E4M3 and t.shape == (3, 200, 32) and t.is_contiguous()
    # q, k per tensor: the absmax lands on 448; v per head: every head reaches 448 after its mean is removed.
    assert p.q8.float().abs().max() == E4M3_MAX and p.k8.float().abs().max() == E4M3_MAX
    assert torch.equal(p.v8.float().abs().amax(dim=(1, 2)), torch.full((3,), E4M3_MAX))
    # Dequantised q and centred k / v are within e4m3 rounding (2^-4 relative, plus the subnormal step).
    k_c = k - k.mean(1, keepdim=True)
    assert ((p.q8.float() * p.descale_q - q).abs() <= q.abs() * 2**-4 + p.descale_q * 2**-9).all()
    assert ((p.k8.float() * p.descale_k - k_c).abs() <= k_c.abs() * 2**-4 + p.descale_k * 2**-9).all()
    v_back = p.v8.float() * (p.o_scale * OUTPUT_SCALE) + p.o_shift  # o_scale carries 1 / OUTPUT_SCALE
    assert rel_err(v_back, v) < 3e-2
    # The O dequantisation applies the per-head scale and adds the V mean back.
    o8 = (torch.ones(3, 200, 32) * 96).to(E4M3)  # 96 is exact in e4m3
    o = dequantize_o(o8, p.o_scale, p.o_shift, torch.float32)
    assert torch.allclose(o, 96 * p.o_scale + p.o_shift)


def test_error_within_the_registry_bound_on_random_data():
    q, k, v = _qkv()
    for name, opt in OPTIONS.items():
        o = _emulated(opt)(q, k, v)
        assert o.shape == q.shape and o.dtype == q.dtype
        err = rel_err(o, _ref(q, k, v))
        assert 1e-3 < err < REL_ERR_BOUND["fp8_attention"], name  # quantised, but within the bound


def test_k_smoothing_removes_the_shared_key_offset():
    q, k, v = _qkv(seed=1)
    offset = 6.0 * torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(2))
    k = 0.5 * k + offset  # a per-channel key offset: constant along every softmax row, so exactly removable
    ref = _ref(q, k, v)
    plain = rel_err(_emulated(OPTIONS["head"])(q, k, v), ref)
    smooth = rel_err(_emulated(OPTIONS["head+k"])(q, k, v), ref)
    assert smooth < 0.5 * plain


def test_v_smoothing_and_per_head_v_scales():
    q, k, v = _qkv(seed=3)
    mean = 4.0 * torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(4))
    v = (v + mean) * torch.tensor([1e-4, 1e-3, 1.0, 10.0]).view(1, 4, 1, 1)
    ref = _ref(q, k, v)

    def head_errs(name):
        o = _emulated(OPTIONS[name])(q, k, v)
        return [rel_err(o[:, h], ref[:, h]) for h in range(4)]

    naive, head, head_kv = head_errs("naive"), head_errs("head"), head_errs("head+kv")
    # One V scale for all heads pushes the quiet heads into e4m3's subnormals; per-head scales fix that.
    assert naive[0] > 0.2 and head[0] < 0.1
    # Removing V's mean leaves O only the deviation to round: a large gain when V has an offset.
    assert all(hk < 0.5 * h for hk, h in zip(head_kv, head))


def test_quantize_v_is_what_quantize_qkv_does_to_v():
    q, k, v = (t[0] for t in _qkv(h=3, s=300, d=32, seed=5))
    v = (v + 2.0) * torch.tensor([1e-2, 1.0, 30.0])[:, None, None]
    for name in ("naive", "head+kv"):
        p = quantize_qkv(q, k, v, OPTIONS[name])
        v8, o_scale, o_shift = quantize_v(v, OPTIONS[name])
        assert torch.equal(v8.view(torch.uint8), p.v8.view(torch.uint8)) and torch.equal(o_scale, p.o_scale)
        assert (o_shift is None and p.o_shift is None) or torch.equal(o_shift, p.o_shift)


def _normed_qkv(h=4, s=512, d=64, r=32, seed=6):
    """q, k as the model's blocks make them (RMSNorm with gains, RoPE) and v, [1, H, S, D] fp32 each, plus the
    gains: what the static q/k scales are for."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(s, 3, h, d, generator=g) * 2
    y[:, 1] += 3.0 * torch.randn(1, h, d, generator=g)  # a key offset, as real keys have
    gains = [torch.rand(d, generator=g) * 1.5 + 0.25 for _ in range(2)]
    angles = torch.rand(s, r // 2, generator=g) * 6.3
    rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    qk, v = torch.empty(2, 1, h, s, d), torch.empty(1, h, s, d)
    qk_norm_rope_reference(y, *gains, 1e-5, rope, qk, v)
    return qk[0], qk[1], v, gains


def test_static_qk_scales_lose_nothing_measurable():
    """Fp8Attention.attend_fp8_qk (q, k in e4m3 with the static scales the q/k norm kernel applies; V quantised
    here) against the same attention on q/k/v quantised with measured scales: both within the registry bound of
    exact attention, and the static scales' error no more than a tenth above (K unsmoothed, a looser q/k range)."""
    q, k, v, gains = _normed_qkv()
    ref = _ref(q, k, v)
    fn = _emulated(DEFAULT_OPTIONS)
    mult = static_qk_mult(*gains)
    qk8 = (torch.stack([q, k]) * mult.view(2, 1, 1, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    static = fn.attend_fp8_qk(Fp8QKInput(qk8, v, mult))
    measured = fn(q, k, v)
    assert static.shape == q.shape and static.dtype == v.dtype
    err_static, err_measured = rel_err(static, ref), rel_err(measured, ref)
    assert 1e-3 < err_static < REL_ERR_BOUND["fp8_attention"]
    assert err_static <= 1.1 * err_measured, (err_static, err_measured)


def test_short_sequences_run_plain_sdpa():
    q, k, v = _qkv(s=64)
    o = Fp8Attention(DEFAULT_OPTIONS, emulate=True)(q, k, v)  # default min_seq 1024 > 64
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v))


def test_cudnn_path_traces_with_fake_tensors():
    """The GPU path (quantise -> cuDNN op -> dequantise) has the right shapes, dtypes and layout: checked through
    the op's fake implementation, as torch.compile sees it."""
    with FakeTensorMode():
        q = torch.empty(1, 6, 2048, 64, dtype=torch.bfloat16)  # BHSD, as the model's blocks lay it out
        o = Fp8Attention(DEFAULT_OPTIONS)(q, q, q)
        assert o.shape == q.shape and o.dtype == torch.bfloat16 and o.is_contiguous()
        rows = torch.empty(2048, 6, 64, dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)  # [S, H, D] memory
        o = Fp8Attention(DEFAULT_OPTIONS)(rows, rows, rows)
        assert o.shape == rows.shape and o.stride() == rows.stride()  # the layout is kept, no transposes


def test_emulated_kernel_matches_exact_attention_without_rounding_loss():
    # Quantised inputs that are exactly representable and a one-hot softmax: the emulation is exact.
    h, s, d = 1, 8, 16
    q8 = torch.zeros(h, s, d)
    q8[0, :, 0] = 64.0
    k8 = torch.zeros(h, s, d)
    k8[0, :, 0] = 64.0 * torch.arange(s).float() / s
    v8 = torch.arange(s * d).float().reshape(h, s, d) % 16
    one = torch.ones(1)
    o8 = sdpa_fp8_emulated(q8.to(E4M3), k8.to(E4M3), v8.to(E4M3), one, one)
    ref = F.scaled_dot_product_attention(*(t[None].double() for t in (q8, k8, v8)))
    assert rel_err(o8.float() / OUTPUT_SCALE, ref[0]) < 4e-2


def test_registry_falls_back_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    why = unavailable("cpu")
    assert "nvidia-cudnn-frontend is not importable" in why
    cands = default_attention_candidates()
    fp8 = cands["fp8"]
    assert fp8.archs is not None and "sm_90" in fp8.archs and "sm_80" not in fp8.archs and "cpu" not in fp8.archs
    # Consider it on this (CPU) machine too: it is skipped with its reason and the fallback wins.
    cands["fp8"] = AttentionCandidate("fp8", fp8.make_fn, fp8.rel_err_bound, fp8.unavailable, archs=("cpu",))
    sel = select_kernels("cpu", TINY_PROBE, attention_candidates=cands)
    assert sel.attention == "math"
    assert "fp8 skipped (nvidia-cudnn-frontend is not importable" in sel.status_rows()[1][2]
    with pytest.raises(KernelError, match="nvidia-cudnn-frontend"):
        select_kernels("cpu", KernelConfig(**{**TINY_PROBE.__dict__, "attention_kernel": "fp8"}))


def test_emulated_fp8_passes_the_registry_probe():
    cands = {"math": default_attention_candidates()["math"],
             "fp8emu": AttentionCandidate("fp8emu", lambda: Fp8Attention(ALL_ROWS, emulate=True),
                                          REL_ERR_BOUND["fp8_attention"], archs=("cpu",))}
    small = KernelConfig(linear_shapes=((64, 256, 128),), attention_shape=(1, 4, 256, 64), probe_iters=1,
                         compute_dtype=torch.float32)
    sel = select_kernels("cpu", small, attention_candidates=cands)
    res = {r.kernel: r for r in sel.probes["attention"]}
    assert res["fp8emu"].ok and 1e-3 < res["fp8emu"].rel_err < REL_ERR_BOUND["fp8_attention"]


def test_the_probe_times_fp8_attention_as_the_blocks_call_it(monkeypatch):
    """With static q/k scales the blocks hand q and k over in e4m3 and the attention quantises V alone: the probe
    checks the whole call's error once and times `block_call`, which takes that path (`attend_fp8_qk`) and whose
    O is the attention's within fp8's bound."""
    options = Fp8AttentionOptions(**{**DEFAULT_OPTIONS.__dict__, "min_seq": 0})
    assert options.static_qk
    calls = {"whole": 0, "fp8_qk": 0}
    whole, fp8_qk = Fp8Attention.__call__, Fp8Attention.attend_fp8_qk

    def count(name, fn):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return counted

    monkeypatch.setattr(Fp8Attention, "__call__", count("whole", whole))
    monkeypatch.setattr(Fp8Attention, "attend_fp8_qk", count("fp8_qk", fp8_qk))
    cands = {"fp8emu": AttentionCandidate("fp8emu", lambda: Fp8Attention(options, emulate=True),
                                          REL_ERR_BOUND["fp8_attention"], archs=("cpu",))}
    small = KernelConfig(linear_shapes=((64, 256, 128),), attention_shape=(1, 4, 256, 64), probe_iters=3,
                         compute_dtype=torch.float32)
    sel = select_kernels("cpu", small, attention_candidates=cands)
    assert sel.attention == "fp8emu" and sel.probes["attention"][0].ms > 0
    assert calls == {"whole": 1, "fp8_qk": 1 + 3}  # the check; a warm-up call and one per round
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 64, generator=g) for _ in range(3))
    o = Fp8Attention(options, emulate=True).block_call(q, k, v)()
    got = dequantize_o(o.o8, o.o_scale, o.o_shift, torch.float32)
    assert rel_err(got.unsqueeze(0), F.scaled_dot_product_attention(q, k, v)) < REL_ERR_BOUND["fp8_attention"]
    # Where the blocks hand over q, k and v as they are (no static scales), the probe times that call.
    plain = Fp8Attention(ALL_ROWS, emulate=True)
    calls.update(whole=0, fp8_qk=0)
    plain.block_call(q, k, v)()
    assert calls == {"whole": 1, "fp8_qk": 0}


def test_model_velocity_with_fp8_attention():
    """The blocks with fp8 attention, q/k quantised by the q/k norm kernel with static scales (the default) or by the
    attention's own pass (static_qk off): both near the exact model, and not the same (the static path was taken)."""
    cfg = DiTConfig.tiny()
    lay = build_layout(cfg, 3, 22, 64, 64)
    v, a, t = random_inputs(cfg, lay, seed=0)
    model = H3DiT(cfg, compute_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        ref = model(v, a, t, 0.3, 0.5, lay)
        outs = {}
        for static_qk in (True, False):
            options = Fp8AttentionOptions(**{**ALL_ROWS.__dict__, "static_qk": static_qk})
            model.set_attention_fn(Fp8Attention(options, emulate=True))
            outs[static_qk] = model(v, a, t, 0.3, 0.5, lay)
    for out in outs.values():
        for x, y in zip(out, ref):
            assert torch.isfinite(x).all()
            assert 1e-5 < rel_err(x, y) < 5e-2
    assert not torch.equal(outs[True][0], outs[False][0])


# ---- GPU only: cuDNN's kernel (needs nvidia-cudnn-frontend and sm_90+) -------------------------------------------
def _cuda_fp8_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return unavailable("cuda")


@pytest.mark.skipif(_cuda_fp8_reason() is not None, reason=str(_cuda_fp8_reason()))
def test_cudnn_kernel_matches_the_emulation_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    h, s, d = 8, 2048, 128
    q, k, v = (torch.randn(1, h, s, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    v = v + 2.0
    p = quantize_qkv(q[0], k[0], v[0], DEFAULT_OPTIONS)
    o8 = torch.ops.h3stages.sdpa_fp8(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)
    assert o8.dtype == E4M3 and o8.shape == (h, s, d) and o8.is_contiguous()
    emu = sdpa_fp8_emulated(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)
    ref = _ref(q, k, v)
    # Same arithmetic, but P~ rounds against a blockwise row max in the kernel: compare what each gets wrong.
    err_kernel = rel_err(dequantize_o(o8, p.o_scale, p.o_shift, torch.float32), ref[0])
    err_emulation = rel_err(dequantize_o(emu, p.o_scale, p.o_shift, torch.float32), ref[0])
    assert err_kernel <= KERNEL_VS_EMULATION_FACTOR * err_emulation + KERNEL_VS_EMULATION_SLACK, \
        (err_kernel, err_emulation)
    outs = []
    for compile_quant in (False, True):
        o = Fp8Attention(DEFAULT_OPTIONS, compile_quant=compile_quant)(q, k, v)
        assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
        assert rel_err(o, ref) < REL_ERR_BOUND["fp8_attention"]
        outs.append(o)
    # [S, H, D]-backed inputs (another plan, strided over the same values) give the same attention.
    rows = [t[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    o = Fp8Attention(DEFAULT_OPTIONS)(*rows)
    assert o.stride() == rows[0].stride() and rel_err(o, outs[0]) < 1e-2
    sel = select_kernels("cuda", KernelConfig(attention_kernel="fp8", linear_kernel="bf16"))
    assert sel.attention == "fp8"


def test_a_failing_quantiser_compile_falls_back_to_eager():
    q, k, v = _qkv(s=256)
    fn = Fp8Attention(ALL_ROWS, emulate=True)

    def broken(*args):
        raise RuntimeError("no C compiler")

    fn._quantize = fn._dequantize = broken  # what a compile error on first call looks like
    o = fn(q, k, v)
    assert torch.equal(o, Fp8Attention(ALL_ROWS, emulate=True)(q, k, v))
    assert fn._quantize is quantize_qkv and fn._dequantize is dequantize_o


# ---- CPU checks of the cuDNN path: everything up to the GPU ----------------------------------------------------------
def test_unavailable_never_raises(monkeypatch):
    """A package that imports but finds no cuDNN library (backend calls raise RuntimeError) is a reason, not a crash:
    the registry probe calls this for every candidate at start-up."""
    def no_library():
        raise RuntimeError("Unable to find symbol cudnnGetVersion")

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(backend_version=no_library))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    why = unavailable(torch.device("cuda", 0))
    assert why.startswith("nvidia-cudnn-frontend found no cuDNN library") and "cudnnGetVersion" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability >= 9.0" in unavailable(torch.device("cuda", 0))
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(backend_version=lambda: 90000))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "has no fp8 SDPA" in unavailable(torch.device("cuda", 0))


def test_a_raising_availability_check_rejects_only_that_candidate():
    def broken(device):
        raise OSError("libcudnn.so.9: cannot open shared object file")

    cands = {"math": default_attention_candidates()["math"],
             "fp8": AttentionCandidate("fp8", lambda: None, REL_ERR_BOUND["fp8_attention"], broken, archs=("cpu",))}
    sel = select_kernels("cpu", TINY_PROBE, attention_candidates=cands)
    assert sel.attention == "math"
    assert "fp8 skipped (availability check failed: OSError: libcudnn.so.9" in sel.status_rows()[1][2]
    with pytest.raises(KernelError, match="availability check failed: OSError"):
        select_kernels("cpu", KernelConfig(**{**TINY_PROBE.__dict__, "attention_kernel": "fp8"}),
                       attention_candidates=cands)


def test_plan_key_and_scale_constants():
    dev = torch.device("cpu")
    bhsd = torch.empty(4, 300, 64, dtype=E4M3)
    rows = torch.empty(300, 4, 64, dtype=E4M3).transpose(0, 1)  # [S, H, D] memory
    key = plan_key(dev, bhsd, bhsd, bhsd, bhsd, False)
    assert key == (None, 4, 300, 64, ((19200, 64, 1),) * 4, False)
    assert key == plan_key(dev, *[torch.empty_like(bhsd)] * 4, False)  # same geometry, same plan
    assert key != plan_key(dev, rows, rows, rows, rows, False)  # the layout is part of the plan
    assert key != plan_key(dev, *[torch.empty(4, 301, 64, dtype=E4M3)] * 4, False)
    assert key != plan_key(dev, bhsd, bhsd, bhsd, bhsd, True)
    c = scale_constants("cpu")
    for t in c.values():
        assert t.shape == (1, 1, 1, 1) and t.dtype == torch.float32
    assert c["one"].item() == 1.0 and c["scale_o"].item() == OUTPUT_SCALE
    assert c["scale_s"].item() * c["descale_s"].item() == 1.0  # a power of two: exact both ways
    # P~ <= 1 scaled by scale_s and |O| <= 448 scaled by scale_o stay finite in e4m3 (no NaN from overflow).
    assert SOFTMAX_SCALE <= E4M3_MAX and torch.tensor(SOFTMAX_SCALE).to(E4M3).float().item() == SOFTMAX_SCALE
    assert torch.tensor(E4M3_MAX * OUTPUT_SCALE).to(E4M3).float().item() == E4M3_MAX * OUTPUT_SCALE


def _frontend():
    """The real nvidia-cudnn-frontend: optional for the product, installed by scripts/setup.sh for the tests, so its
    absence fails these checks rather than skipping them."""
    try:
        import cudnn
    except Exception as e:
        pytest.fail(f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); the fp8 graph checks need it: "
                    "run scripts/setup.sh (or .venv/bin/python -m pip install --no-deps nvidia-cudnn-frontend==1.32.0)")
    return cudnn


def _binding_params(cudnn) -> set[str]:
    """Keyword names of the backend's sdpa_fp8 binding, from its signature line."""
    first = cudnn._pybind_module.backend_graph.sdpa_fp8.__doc__.splitlines()[0]
    return set(re.findall(r"(\w+): ", first.split("(", 1)[1]))


@pytest.mark.parametrize("layout", ["bhsd", "rows"])
@pytest.mark.parametrize("heads,seq", [(56, 14882), (28, 37748), (14, 1024)])  # TP1, TP2 / SP2, TP4 x SP
def test_graph_declares_what_the_frontend_accepts(layout, heads, seq):
    """Our fp8 SDPA graph against nvidia-cudnn-frontend's own graph IR and validator (no GPU needed): ports, dims,
    strides, dtypes; every argument we pass is one the backend binding takes; the variant pack fills every port."""
    cudnn = _frontend()
    d = 128
    if layout == "bhsd":
        st = (seq * d, d, 1)
    else:
        st = (d, heads * d, 1)
    graph, t = declare_graph(cudnn, None, heads, seq, d, (st,) * 4)
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    for n in ("q", "k", "v", "o"):
        assert list(t[n].dim) == [1, heads, seq, d] and list(t[n].stride) == [heads * seq * d, *st]
        assert t[n].data_type == e4m3
    assert not t["o"].is_virtual and not t["amax_s"].is_virtual and not t["amax_o"].is_virtual
    for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o", "amax_s", "amax_o"):
        assert list(t[n].dim) == [1, 1, 1, 1] and t[n].data_type == fp32
    (node,) = graph.nodes
    assert node.node_type.name == "SDPA_FP8"
    assert node.params["generate_stats"] is False and "Stats" not in node.outputs  # inference: no stats output
    assert node.params["attn_scale"] == pytest.approx(d ** -0.5)
    # What lowering hands the backend: the node's ports and params by keyword, plus name and compute type.
    passed = set(node.inputs) | set(node.params) | {"name", "compute_data_type"}
    assert passed <= _binding_params(cudnn), passed - _binding_params(cudnn)
    # Every port of the node gets a buffer, and nothing else is in the pack.
    bufs = {n: torch.empty(1) for n in ("q", "k", "v", "o")}
    pack = variant_pack(t, bufs["q"], bufs["k"], bufs["v"], bufs["o"], torch.ones(1, 1, 1, 1),
                        torch.ones(1, 1, 1, 1), scale_constants("cpu"), torch.zeros(2, 1, 1, 1, 1))
    ports = {x.uid for x in [*node.inputs.values(), *node.outputs.values()] if x is not None}
    assert {x.uid for x in pack} == ports and len(pack) == len(ports) == 12


def test_per_head_descale_graph_declares():
    cudnn = _frontend()
    graph, t = declare_graph(cudnn, None, 8, 2048, 128, ((2048 * 128, 128, 1),) * 4, head_descales=True)
    assert list(t["descale_q"].dim) == [1, 8, 1, 1] and list(t["descale_q"].stride) == [8, 1, 1, 1]


# ---- The Triton quantiser against quantize_qkv ----------------------------------------------------------------------
# Small launch blocks so that the interpreter run covers several row blocks per program and a ragged last block.
SMALL_LAUNCH = TritonQuantLaunch(stats_rows=64, stats_block_r=16, stats_warps=4, quant_block_r=32, quant_warps=4)


def compare_triton_quantiser(device: str, heads: int, seq: int, dim: int, interpreter: bool = False,
                             launch: TritonQuantLaunch | None = None) -> None:
    """quantize_qkv_triton vs quantize_qkv on bf16 q, k, v [H, S, D]: views of one [3, 1, H, S, D] buffer (the model's
    layout) and [S, H, D]-backed views. Scales within 1e-6; e4m3 values equal in >= 99.9 % of elements and at
    most one e4m3 step apart (the means' summation order differs). Triton's interpreter rounds fp32 -> e4m3 its own
    way (it can drop the carry into the exponent, halving a value): there the check is that values agree up to
    that, which still catches any indexing, masking or reduction error (those scramble most elements)."""
    g = torch.Generator(device=device).manual_seed(heads + seq)
    buf = torch.randn(3, 1, heads, seq, dim, generator=g, device=device)
    buf[1] += 3.0 * torch.randn(heads, 1, dim, generator=g, device=device)  # key offsets: smoothing has work to do
    buf[2] = (buf[2] + 2.0) * torch.logspace(-2, 1, heads, device=device)[:, None, None]
    buf = buf.to(torch.bfloat16)
    rows = buf[:, 0].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # [3, H, S, D] over [S, H, D] memory
    for qkv in (buf[:, 0], rows):
        for name in ("naive", "head+kv"):
            ref = quantize_qkv(*qkv, OPTIONS[name])
            got = quantize_qkv_triton(*qkv, OPTIONS[name], launch)
            for field, a, b in zip(ref._fields, ref, got):
                what = f"{name} {field} {tuple(qkv[0].stride())}"
                if a is None:
                    assert b is None, what
                    continue
                assert b.shape == a.shape and b.dtype == a.dtype and b.stride() == a.stride(), what
                if a.dtype != E4M3:
                    assert (a - b).abs().max() <= 1e-6 * a.abs().max(), what
                elif interpreter:
                    af, bf = a.float(), b.float()
                    assert (af == bf).float().mean() > 0.9, what
                    assert ((af - bf).abs() <= 0.5 * af.abs() + 2**-9).all(), what
                else:
                    steps = e4m3_steps(a, b)
                    assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.999, what
        # V alone (the static q/k path): the same V, scales and shift as the three-tensor pass.
        v = qkv[2]
        ref = quantize_v(v, OPTIONS["head+kv"])
        got = quantize_v_triton(v, OPTIONS["head+kv"], launch)
        assert got[0].stride() == v.stride()
        for a, b in zip(ref[1:], got[1:]):
            assert (a - b).abs().max() <= 1e-6 * a.abs().max()
        af, bf = ref[0].float(), got[0].float()
        if interpreter:
            assert (af == bf).float().mean() > 0.9 and ((af - bf).abs() <= 0.5 * af.abs() + 2**-9).all()
        else:
            steps = e4m3_steps(ref[0], got[0])
            assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.999


@needs_triton
def test_triton_quantiser_under_the_interpreter():
    """The Triton kernels' indexing, masking and reductions on the CPU through Triton's interpreter
    (tests/triton_interp.py says how to run it without a GPU)."""
    run_in_interpreter("from tests.test_fp8_attention import SMALL_LAUNCH, compare_triton_quantiser as c; "
                       "c('cpu', 3, 300, 32, interpreter=True, launch=SMALL_LAUNCH)")


def test_e4m3_steps():
    x = torch.tensor([0.0, -0.0, 2**-9, -(2**-9), 1.0, 1.125, -1.0, 448.0]).to(E4M3)
    y = torch.tensor([-0.0, 2**-9, -(2**-9), 2**-9, 1.125, 1.0, -1.25, 416.0]).to(E4M3)
    assert e4m3_steps(x, y).tolist() == [0, 1, 2, 2, 1, 1, 2, 1]


def test_triton_op_fake_keeps_the_layout():
    """What torch.compile sees of the Triton op (its fake implementation): e4m3 tensors laid out like the inputs,
    [1] descales, [H, 1, 1] o_scale, [H, 1, D] o_shift (None without V smoothing)."""
    with FakeTensorMode():
        buf = torch.empty(3, 1, 6, 2048, 64, dtype=torch.bfloat16)
        rows = torch.empty(3, 2048, 6, 64, dtype=torch.bfloat16).transpose(1, 2)
        for q, k, v in (buf[:, 0], rows):
            p = quantize_qkv_triton(q, k, v, DEFAULT_OPTIONS)
            assert all(t.dtype == E4M3 and t.stride() == x.stride() for t, x in zip(p[:3], (q, k, v)))
            assert p.descale_q.shape == p.descale_k.shape == (1,)
            assert p.o_scale.shape == (6, 1, 1) and p.o_shift.shape == (6, 1, 64)
        assert quantize_qkv_triton(q, k, v, OPTIONS["naive"]).o_shift is None


def _cuda_triton_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if triton is None:
        return "needs triton"
    if torch.cuda.get_device_capability() < (8, 9):
        return "Triton's e4m3 conversion needs sm_89+"
    return None


@pytest.mark.skipif(_cuda_triton_reason() is not None, reason=str(_cuda_triton_reason()))
@pytest.mark.parametrize("heads,seq", [(56, 4099), (28, 1000)])
def test_triton_quantiser_matches_torch_gpu(heads, seq):
    compare_triton_quantiser("cuda", heads, seq, 128)


@pytest.mark.skipif(_cuda_triton_reason() is not None, reason=str(_cuda_triton_reason()))
def test_triton_quantiser_inside_torch_compile_gpu():
    """Inside a compiled function the op stays one opaque call (fullgraph: no graph break) and gives the eager
    result bit for bit (both passes are deterministic)."""
    q, k, v = (torch.randn(8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def fn(q, k, v):
        return quantize_qkv_triton(q * 2, k + 1, v, DEFAULT_OPTIONS)

    eager, compiled = fn(q, k, v), torch.compile(fn, fullgraph=True)(q, k, v)
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)
