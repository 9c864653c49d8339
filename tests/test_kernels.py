"""Kernel registry (minimax_h3/kernels/registry.py) on CPU: arch table, probe picks, overrides, parity rejection, the
probe's timing in turn, fp8 math."""

import math
import time

import pytest
import torch

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.layout import build_layout
from minimax_h3.dit.model import H3DiT
from minimax_h3.kernels.int8 import QuantizedWeight, quantize_convrot
from minimax_h3.kernels.fp8 import FP8_E4M3_MAX, quantize_fp8_rowwise
from minimax_h3.kernels.registry import (Fp8RowwiseLinear, Fp8Unavailable, KernelConfig, KernelError, LinearCandidate,
                                         arch_key, default_attention_candidates, default_linear_candidates,
                                         TimedCallError, fp8_rowwise_reference, interleaved_ms, rel_err,
                                         select_kernels)
from tests.dit_ranks import random_inputs

# Tiny probe so the whole file runs in a few seconds on 2 cores.
SMALL = KernelConfig(linear_shapes=((64, 256, 128),), attention_shape=(1, 2, 64, 32), probe_iters=2,
                     compute_dtype=torch.float32)


def test_cpu_arch_considers_only_fallbacks():
    assert arch_key("cpu") == "cpu"
    lin = [n for n, c in default_linear_candidates().items() if "cpu" in c.archs]
    att = [n for n, c in default_attention_candidates().items() if "cpu" in c.archs]
    assert sorted(lin) == ["bf16", "fp32"]
    assert att == ["math"]


def test_auto_picks_a_fallback_and_reports_reasons():
    sel = select_kernels("cpu", SMALL)
    assert sel.linear in ("fp32", "bf16") and sel.attention == "math"
    rows = sel.status_rows()
    assert [r[0] for r in rows] == ["linear", "attention"]
    assert all(isinstance(r[2], str) and "fastest valid on cpu" in r[2] for r in rows)
    # Both CPU linears pass parity; the losing one is listed with its time.
    assert {r.kernel for r in sel.probes["linear"] if r.ok} == {"fp32", "bf16"}
    # The chosen pieces work: a linear built from an int8 ConvRot weight and the attention callable.
    q, s = quantize_convrot(torch.randn(32, 64) / 8, 64)
    lin = sel.make_linear(QuantizedWeight(q, s, 64))
    assert lin(torch.randn(3, 64)).shape == (3, 32)
    qkv = torch.randn(3, 1, 2, 8, 16)
    assert sel.attention_fn()(*qkv).shape == (1, 2, 8, 16)


def test_override_is_honoured_and_checked():
    sel = select_kernels("cpu", KernelConfig(**{**SMALL.__dict__, "linear_kernel": "bf16"}))
    assert sel.linear == "bf16" and "forced by config" in sel.status_rows()[0][2]
    with pytest.raises(KernelError, match="unknown linear kernel"):
        select_kernels("cpu", KernelConfig(**{**SMALL.__dict__, "linear_kernel": "int4"}))
    with pytest.raises(KernelError, match="cannot run on cpu"):
        select_kernels("cpu", KernelConfig(**{**SMALL.__dict__, "linear_kernel": "fp8"}))
    with pytest.raises(KernelError, match="cannot run on cpu"):
        select_kernels("cpu", KernelConfig(**{**SMALL.__dict__, "attention_kernel": "cudnn"}))


class _Broken(torch.nn.Module):
    """Fast but wrong: what a miscompiled / mis-dispatched kernel looks like."""

    def __init__(self, n_out):
        super().__init__()
        self.n_out = n_out

    def forward(self, x):
        return torch.zeros(*x.shape[:-1], self.n_out, dtype=x.dtype) + 1e-3


def _broken_build(w, bias, dtype):
    return _Broken(w.shape[0])


def test_parity_rejects_a_broken_fast_kernel():
    cands = default_linear_candidates()
    cands["broken"] = LinearCandidate("broken", _broken_build, rel_err_bound=1e-2, archs=("cpu",))
    sel = select_kernels("cpu", SMALL, linear_candidates=cands)
    assert sel.linear in ("fp32", "bf16")
    broken = next(r for r in sel.probes["linear"] if r.kernel == "broken")
    assert not broken.ok and broken.why.startswith("parity")
    assert "broken rejected (parity" in sel.status_rows()[0][2]
    # Forcing it fails loudly at start-up.
    with pytest.raises(KernelError, match="failed its start-up check"):
        select_kernels("cpu", KernelConfig(**{**SMALL.__dict__, "linear_kernel": "broken"}), linear_candidates=cands)


def test_raising_kernel_is_rejected_and_all_failing_is_an_error():
    def boom(w, bias, dtype):
        raise RuntimeError("no kernel image for this device")

    cands = {"boom": LinearCandidate("boom", boom, 1e-2, archs=("cpu",)),
             "broken": LinearCandidate("broken", _broken_build, 1e-2, archs=("cpu",))}
    with pytest.raises(KernelError, match="every linear kernel failed"):
        select_kernels("cpu", SMALL, linear_candidates=cands)


class _FallingClock:
    """perf_counter for the registry: every call of a `_Timed` kernel advances it by the kernel's cost, stretched as
    calls go on (a GPU whose clock falls as it heats at its power limit)."""

    def __init__(self):
        self.now, self.calls, self.order = 0.0, 0, []

    def perf_counter(self) -> float:
        return self.now

    def run(self, name: str, cost: float) -> None:
        self.now += cost * (1.0 + 0.1 * self.calls)
        self.calls += 1
        self.order.append(name)


class _Timed(torch.nn.Module):
    """An exact linear that costs `cost` on `clock`; raises from its `fail_from`-th call on."""

    def __init__(self, w, name, cost, clock, fail_from=None):
        super().__init__()
        self.w, self.name, self.cost = w.dequantize(torch.float32), name, cost
        self.clock, self.fail_from = clock, fail_from

    def forward(self, x):
        if self.fail_from is not None and self.clock.order.count(self.name) >= self.fail_from:
            raise RuntimeError("an illegal memory access was encountered")
        self.clock.run(self.name, self.cost)
        return torch.nn.functional.linear(x.float(), self.w).to(x.dtype)


def _timed_candidates(clock, **fail_from):
    def cand(name, cost):
        build = lambda w, bias, dtype: _Timed(w, name, cost, clock, fail_from.get(name))  # noqa: E731
        return LinearCandidate(name, build, 1e-2, archs=("cpu",))
    return {"first": cand("first", 1.0), "faster": cand("faster", 0.9), "third": cand("third", 1.2)}


def test_the_probe_times_candidates_in_turn_and_a_falling_clock_favours_none(monkeypatch):
    """Timed one after another, the clock falling by 10 % of the cost per call would hand the first candidate the
    win (its median at ~1.4, the faster one's at ~1.9); in turn, each round calls every candidate once, and the
    one that is faster at any clock wins."""
    from minimax_h3.kernels import registry

    clock = _FallingClock()
    monkeypatch.setattr(registry, "time", clock)
    cfg = KernelConfig(**{**SMALL.__dict__, "probe_iters": 5})
    sel = select_kernels("cpu", cfg, linear_candidates=_timed_candidates(clock))
    assert sel.linear == "faster", sel.status_rows()[0]
    # One check call each, one warm-up call each, then five rounds of all three in the same order.
    assert clock.order == ["first", "faster", "third"] * 7
    ms = {r.kernel: r.ms for r in sel.probes["linear"]}
    assert ms["faster"] < ms["first"] < ms["third"]


def test_a_candidate_that_raises_while_timed_is_rejected_and_the_others_are_timed(monkeypatch):
    from minimax_h3.kernels import registry

    clock = _FallingClock()
    monkeypatch.setattr(registry, "time", clock)
    sel = select_kernels("cpu", SMALL, linear_candidates=_timed_candidates(clock, faster=2))  # passes its check
    broke = next(r for r in sel.probes["linear"] if r.kernel == "faster")
    assert not broke.ok and broke.why == "error: RuntimeError: an illegal memory access was encountered"
    assert sel.linear == "first" and all(r.ms for r in sel.probes["linear"] if r.ok)


def test_interleaved_ms_names_the_call_that_raised():
    def boom():
        raise ValueError("bad launch")

    assert len(interleaved_ms([lambda: None, lambda: None], torch.device("cpu"), 3)) == 2
    with pytest.raises(TimedCallError, match="ValueError: bad launch") as e:
        interleaved_ms([lambda: None, boom], torch.device("cpu"), 3)
    assert e.value.position == 1 and isinstance(e.value.error, ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_interleaved_ms_times_the_gpu_not_the_host_on_gpu():
    """A call that spends 0.3 ms on the host before a few-microsecond kernel times as the kernel: the host's part
    runs while the stream is still busy with the spin queued ahead of the call."""
    x = torch.ones(1024, device="cuda")

    def slow_host():
        time.sleep(3e-4)
        x.add_(1)

    assert interleaved_ms([slow_host], torch.device("cuda"), 5)[0] < 0.15


def test_fp8_rowwise_quantisation_math():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 64, generator=g) * torch.logspace(-3, 2, 16)[:, None]
    q, s = quantize_fp8_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 1)
    assert torch.allclose(q.float().abs().amax(1), torch.full((16,), FP8_E4M3_MAX))  # row absmax hits 448
    deq = q.float() * s
    # e4m3: 3 mantissa bits -> round-to-nearest relative error <= 2^-4 in the normal range, plus the subnormal step.
    assert ((deq - t).abs() <= t.abs() * 2**-4 + s * 2**-9).all()

    w = torch.randn(48, 64, generator=g) / 8
    x = torch.randn(10, 64, generator=g)
    x[:, 3] *= 20  # an outlier channel
    ref = x @ w.T
    lin = Fp8RowwiseLinear.from_dense(w, out_dtype=torch.float32, emulate=True)
    y = lin(x)
    assert y.dtype == torch.float32
    err = rel_err(y, ref)
    assert 1e-3 < err < 8e-2  # quantised (not exact), but within the fp8 bound
    assert torch.allclose(y, fp8_rowwise_reference(x, lin.weight, lin.weight_scale))


def test_fp8_from_int8_weight_and_cpu_error():
    w = torch.randn(32, 256) / 16
    q, s = quantize_convrot(w, 256)
    qw = QuantizedWeight(q, s, 256)
    lin = Fp8RowwiseLinear.from_quantized(qw, bias=torch.ones(32), emulate=True, out_dtype=torch.float32)
    x = torch.randn(5, 256)
    ref = x @ qw.dequantize(torch.float32).T + 1
    assert rel_err(lin(x), ref) < 8e-2
    plain = Fp8RowwiseLinear.from_quantized(qw)
    with pytest.raises(Fp8Unavailable, match="bf16"):
        plain(x)
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8RowwiseLinear(250, 32)


def test_model_uses_the_selected_attention_fn():
    cfg = DiTConfig.tiny()
    lay = build_layout(cfg, 3, 22, 64, 64)
    v, a, t = random_inputs(cfg, lay, seed=0)
    model = H3DiT(cfg, compute_dtype=torch.float32).eval()
    calls = []

    def counting(q, k, v_):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v_)

    with torch.no_grad():
        base = model(v, a, t, 0.3, 0.5, lay)
        model.set_attention_fn(select_kernels("cpu", SMALL).attention_fn())
        same = model(v, a, t, 0.3, 0.5, lay)
        model.set_attention_fn(counting)
        model(v, a, t, 0.3, 0.5, lay)
    assert len(calls) == cfg.num_layers + cfg.num_refiner_layers
    assert all(math.isclose(rel_err(x, y), 0.0, abs_tol=1e-6) for x, y in zip(same, base))


def test_load_time_int8_conversion_goes_a_slab_of_rows_at_a_time():
    """A float linear converted to int8 at load quantises a slab of rows at a time (bounded temporaries) with the
    same codes and scales as the whole weight at once."""
    from minimax_h3.kernels.int8 import quantize_convrot
    from minimax_h3.kernels.registry import _int8_weight

    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = _int8_weight(w, chunk_elems=1 << 30)
    q, s = quantize_convrot(w.float(), whole.groupsize)
    assert torch.equal(whole.qdata, q) and torch.equal(whole.scale, s)
    for elems in (256, 7 * 256, 1000):  # one row, 7 rows, a slab that does not divide the rows
        part = _int8_weight(w, chunk_elems=elems)
        assert torch.equal(part.qdata, q) and torch.equal(part.scale, s) and part.groupsize == whole.groupsize


def test_tuned_values_are_per_device_data():
    """minimax_h3/kernels/tuning.json: an architecture's own entry, else the one "default" names (the H200's: also
    the CPU's, where Triton only interprets); every entry has every name the default has; an unknown name is a clear
    error. What reads it: the Triton launches, the DiT's row chunks, fp8 accumulation and the fp8 linears' method."""
    from minimax_h3.kernels.layers import fp8_rows_method
    from minimax_h3.kernels.registry import Fp8RowwiseLinear
    from minimax_h3.kernels.tuning import _table, arch_entry, chunk_rows, fp8_fast_accum, launch_params, tuned

    h200 = arch_entry("sm_90")
    assert h200["measured_on"] == "NVIDIA H200" and h200["swiglu_fp8_rows"]["num_warps"] == 32
    assert arch_entry("sm_100") is h200 and arch_entry("cpu") is h200 and arch_entry("default") is h200
    entries = {k: v for k, v in _table().items() if isinstance(v, dict)}
    for arch, entry in entries.items():
        assert set(entry) == set(arch_entry("cpu")), arch
        assert all("benchmark" in v for k, v in entry.items() if k != "measured_on"), arch  # each says how
    assert launch_params("qk_norm_rope", "cpu") == {"block_rows": 8, "num_warps": 2, "heads_per_program": 8,
                                                    "num_stages": 3}
    with pytest.raises(KeyError, match="no 'nope' entry"):
        launch_params("nope", "cpu")
    # The H200's values (what the DiT stage runs with there; the CPU gets the same through "default").
    assert (chunk_rows("sm_90").eager, chunk_rows("sm_90").compiled_tp, chunk_rows("sm_90").compiled_one) == \
        (4096, 16384, 65536)
    assert fp8_fast_accum("sm_90") is True
    assert tuned("fp8_rows_in_compiled_blocks", "sm_90") == {
        "modulate_in_compiled_blocks": False, "add_modulate_in_compiled_blocks": True,
        "swiglu_in_compiled_blocks": True, "o_rows_in_compiled_blocks": True}
    lin = Fp8RowwiseLinear.from_dense(torch.randn(32, 16), emulate=True)  # tuned for the weight's device
    assert lin.fast_accum is True and lin.linear_method is fp8_rows_method("cpu")
    assert fp8_rows_method("sm_90") == fp8_rows_method("cpu")
    assert not fp8_rows_method("sm_90").modulate_in_compiled_blocks
    assert Fp8RowwiseLinear.from_dense(torch.randn(32, 16), emulate=True, fast_accum=False).fast_accum is False


def test_one_block_reads_in_three_files():
    """A DiT block is minimax_h3/dit/model.py (its steps), minimax_h3/dit/ops.py (their plain math) and
    minimax_h3/kernels/layers.py (what each layer's method runs): the kernel modules define no plain math of the
    block, they import it from ops.py and reproduce it."""
    import ast
    from pathlib import Path

    import minimax_h3.kernels as kernels

    block_math = {"rms_norm", "apply_rope", "modulate", "swiglu", "qk_norm_rope_reference"}
    for path in Path(kernels.__file__).parent.glob("*.py"):
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert not defined & block_math, (path.name, defined & block_math)


def test_the_model_calls_its_layers_plainly():
    """minimax_h3/dit/model.py names no kernel type, probes no layer and branches on no compile mode: what a layer
    computes and fuses is its method's (minimax_h3/kernels/layers.py)."""
    from pathlib import Path

    import minimax_h3.dit.model as model

    src = Path(model.__file__).read_text()
    for word in ("getattr(", "is_compiling", "Fp8", "fp8", "accepts_", "isinstance(o", "isinstance(h"):
        assert word not in src, word
