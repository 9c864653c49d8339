"""FlashAttention-3 candidates (minimax_h3/kernels/fa3_attention.py): the fp8 path's descales and V's mean on CPU
through the kernel's fp32 emulation, the registry offering FA3 only where it runs (and saying why not), FA3's bf16 O
handed to an fp8 out_proj as cuDNN's e4m3 O is, and (GPU with fa3-fwd only) the kernels against exact attention."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minimax_h3.kernels.fa3_attention import PINNED, Fa3Attention, fa3_fp8, fa3_fp8_emulated, unavailable
from minimax_h3.kernels.fp8 import E4M3
from minimax_h3.kernels.fp8_attention import (DEFAULT_OPTIONS, E4M3_MAX, Fp8Attention, Fp8AttentionOptions, Fp8QKInput,
                                              dequantize_o, quantize_qkv, static_qk_mult)
from minimax_h3.kernels.layers import AttentionOutput, Fp8AttentionInput, Fp8AttentionOutput, fp8_rows_method
from minimax_h3.kernels.registry import (REL_ERR_BOUND, AttentionCandidate, KernelConfig, KernelError,
                                         default_attention_candidates, rel_err, select_kernels)
from tests.test_fp8_attention import TINY_PROBE, _normed_qkv, _qkv, _ref

ALL_ROWS = Fp8AttentionOptions(min_seq=0)


def _fa3(options=ALL_ROWS) -> Fp8Attention:
    return Fp8Attention(options, emulate=True, kernel="fa3")


def test_fa3_fp8_within_the_fp8_bound_and_no_worse_than_cudnns():
    """Same quantised q, k, v: FA3 writes O in bf16 where cuDNN's Hopper kernel rounds it to e4m3, so its error is
    at most cuDNN's; both within the registry's fp8 bound."""
    q, k, v = _qkv()
    ref = _ref(q, k, v)
    err_fa3 = rel_err(_fa3()(q, k, v), ref)
    err_cudnn = rel_err(Fp8Attention(ALL_ROWS, emulate=True)(q, k, v), ref)
    assert 1e-3 < err_fa3 <= err_cudnn * 1.02 and err_cudnn < REL_ERR_BOUND["fp8_attention"], (err_fa3, err_cudnn)


def test_fa3_fp8_descales_are_the_quantisers_scales():
    """V's per-head scale goes in as FA3's per-head descale (o_scale x OUTPUT_SCALE); V's mean comes back on O.
    With a one-hot softmax (P exact in e4m3) O is V's last row, per head, as quantised."""
    h, s, d = 3, 8, 16
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, h, s, d, generator=g) * torch.tensor([1.0, 10.0, 0.1]).view(1, h, 1, 1) + 5.0
    k = torch.zeros(1, h, s, d)
    k[0, :, :, 0] = torch.arange(s) * 100.0  # the last key dominates every query's softmax
    q = torch.zeros(1, h, s, d)
    q[0, :, :, 0] = 1.0
    o = _fa3()(q, k, v)
    p = quantize_qkv(q[0], k[0], v[0], ALL_ROWS)
    # The kernel's bf16 O is V's deviation from its mean, descaled per head; the mean is added in fp32.
    dev = (p.v8.float() * (p.o_scale * 0.5)).to(torch.bfloat16).float()
    want = (dev + p.o_shift)[:, -1:].expand(h, s, d)
    assert o.dtype == q.dtype and torch.allclose(o[0], want, rtol=1e-6, atol=1e-6)
    span = (v[0] - v[0].mean(1, keepdim=True)).abs().amax((1, 2))  # what each head's e4m3 steps are relative to
    assert ((o[0] - v[0, :, -1:]).abs().amax((1, 2)) <= span / 16).all()  # e4m3: 3 mantissa bits


def test_fa3_takes_the_static_qk_path():
    q, k, v, gains = _normed_qkv()
    fn = _fa3(DEFAULT_OPTIONS.__class__(**{**DEFAULT_OPTIONS.__dict__, "min_seq": 0}))
    mult = static_qk_mult(*gains)
    qk8 = (torch.stack([q, k]) * mult.view(2, 1, 1, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    o = fn.attend_fp8_qk(Fp8QKInput(qk8, v, mult))
    assert o.shape == q.shape and 1e-3 < rel_err(o, _ref(q, k, v)) < REL_ERR_BOUND["fp8_attention"]
    kept = fn.attend_fp8_qk(Fp8QKInput(qk8, v, mult), keep_fp8_o=True)  # FA3's bf16 O, unit scales, V's mean
    assert kept.o8.dtype == torch.bfloat16 and torch.equal(kept.o_scale, torch.ones(q.shape[1], 1, 1))
    assert torch.equal(dequantize_o(*kept, o.dtype), o[0])


def test_an_fp8_out_proj_gets_o_as_each_kernel_writes_it():
    """The block hands an fp8 out_proj's method O as the kernel wrote it: cuDNN's e4m3 O with its head scales,
    FA3's bf16 O with unit scales; either way out_proj gets the same rows as from O put together first."""
    q, k, v, gains = _normed_qkv()
    mult = static_qk_mult(*gains)
    qk8 = (torch.stack([q, k]) * mult.view(2, 1, 1, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    out_proj = nn.Linear(q.shape[1] * q.shape[3], 8).bfloat16()
    out_proj.linear_method = fp8_rows_method("cpu")  # takes fp8 attention's O for bf16 compute
    plain = nn.Linear(q.shape[1] * q.shape[3], 8).bfloat16()
    plain.load_state_dict(out_proj.state_dict())
    opts = DEFAULT_OPTIONS.__class__(**{**DEFAULT_OPTIONS.__dict__, "min_seq": 0})
    for kernel, dtype in (("cudnn", E4M3), ("fa3", torch.bfloat16)):
        inp = Fp8AttentionInput(Fp8QKInput(qk8, v.bfloat16(), mult), v_in_projection=False)
        got = inp.attend(Fp8Attention(opts, emulate=True, kernel=kernel), out_proj, torch.bfloat16)
        assert isinstance(got, Fp8AttentionOutput) and got.fp8.o8.dtype == dtype
        inp = Fp8AttentionInput(Fp8QKInput(qk8, v.bfloat16(), mult), v_in_projection=False)
        want = inp.attend(Fp8Attention(opts, emulate=True, kernel=kernel), plain, torch.bfloat16)
        assert type(want) is AttentionOutput and want.o.dtype == torch.bfloat16
        s = q.shape[2]
        assert torch.equal(got.project(out_proj, 0, s), want.project(plain, 0, s)), kernel


def test_registry_offers_fa3_only_on_hopper_and_says_why_not(monkeypatch):
    cands = default_attention_candidates()
    for name in ("fa3", "fa3_fp8"):
        assert cands[name].archs == ("sm_90",)
    assert cands["fa3"].rel_err_bound == REL_ERR_BOUND["cudnn"]  # bf16 attention's bound
    assert cands["fa3_fp8"].rel_err_bound == REL_ERR_BOUND["fp8_attention"]  # fp8 attention's bound
    assert "needs a CUDA GPU" in unavailable("cpu")
    with pytest.raises(KernelError, match="FlashAttention-3 needs a CUDA GPU"):
        select_kernels("cpu", KernelConfig(**{**TINY_PROBE.__dict__, "attention_kernel": "fa3_fp8"}))
    # Considered on this machine: skipped with its reason, the fallback chosen.
    fa3 = cands["fa3"]
    cands["fa3"] = AttentionCandidate("fa3", fa3.make_fn, fa3.rel_err_bound, fa3.unavailable, archs=("cpu",))
    sel = select_kernels("cpu", TINY_PROBE, attention_candidates=cands)
    assert sel.attention == "math" and "fa3 skipped (FlashAttention-3 needs a CUDA GPU" in sel.status_rows()[1][2]
    # A Hopper without the package: the reason names the install.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)
    why = unavailable(torch.device("cuda", 0))
    assert "fa3-fwd is not importable" in why and f"pip install {PINNED}" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "runs on Hopper (sm_90); this GPU is sm_89" in unavailable(torch.device("cuda", 0))


def test_fa3_bf16_refuses_fp16_with_the_reason():
    q = torch.zeros(1, 2, 4, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="bf16 and fp8 kernels only"):
        Fa3Attention()(q, q, q)


# ---- GPU with fa3-fwd (Hopper) ---------------------------------------------------------------------------------------
def _gpu_reason() -> str | None:
    return "needs CUDA" if not torch.cuda.is_available() else unavailable("cuda")


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_fa3_kernels_against_exact_attention_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 56, 4096, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    o = Fa3Attention()(q, k, v)
    assert o.shape == q.shape and rel_err(o, ref) < REL_ERR_BOUND["fa3"]
    opts = Fp8AttentionOptions(min_seq=0)
    p = quantize_qkv(q[0], k[0], v[0], opts)
    kernel = fa3_fp8(p.q8, p.k8, p.v8, p.descale_q, p.descale_k, p.o_scale * 0.5)
    emulated = fa3_fp8_emulated(*(t[:4] for t in (p.q8, p.k8, p.v8)), p.descale_q, p.descale_k,
                                (p.o_scale * 0.5)[:4])
    err_kernel = rel_err(kernel[:4] + p.o_shift[:4], ref[0, :4])
    err_emulated = rel_err(emulated.float() + p.o_shift[:4], ref[0, :4])
    assert err_kernel < 1.5 * err_emulated + 2e-3, (err_kernel, err_emulated)
    o8 = Fp8Attention(opts, kernel="fa3")(q, k, v)
    assert rel_err(o8, ref) < REL_ERR_BOUND["fp8_attention"]
