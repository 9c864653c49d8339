"""Tests for minimax_h3/dit/sampling.py: schedules (docs/model.md §7.2, §11.3), the audio carry, Euler / res_multistep,
determinism, cancellation. diffusers' MiniMaxH3Scheduler is used as an oracle only."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from minimax_h3.dit.sampling import (
                                     AUDIO_SHIFT,
                                     DEFAULT_STEPS,
                                     VIDEO_SHIFT,
                                     Cancelled,
                                     SamplerConfig,
                                     audio_sigma_from_video,
                                     diffusers_sigmas,
                                     initial_noise,
                                     sample,
                                     schedule,
                                     shift_sigma,
                                     simple_sigmas,
                                     )
import stagekit.errors

# §7.2 (video, 5 decimals) and §11.3 (audio, with the trailing 0).
TABLE_VIDEO_8 = [1, 0.98824, 0.97297, 0.95238, 0.92308, 0.87805, 0.80000, 0.63158, 0]
TABLE_AUDIO_8 = [1, 0.9545454, 0.9, 0.8333333, 0.75, 0.6428571, 0.5, 0.3, 0]

VSHAPE = (6, 4)  # a few "video rows"
ASHAPE = (4, 3)  # a few "audio rows"


def MiniMaxH3Scheduler(shift: float):  # noqa: N802 - the oracle, imported lazily (the GPU image has no diffusers)
    mod = pytest.importorskip("diffusers.schedulers.scheduling_minimax_h3")
    return mod.MiniMaxH3Scheduler(shift=shift)


def _diffusers_grid(num_points: int, shift: float) -> torch.Tensor:
    sch = MiniMaxH3Scheduler(shift=shift)
    sch.set_timesteps(num_points)
    return sch.sigmas


# ---- toy denoisers (dtype-generic so a float64 reference can call them too) -----------------------------------------
def _coupled_toy(x_v, x_a, t_v, t_a):
    """A nonlinear denoiser whose video output depends on the audio input and vice versa (so a wrong audio
    carry or a wrong per-stream t shows up in both outputs)."""
    a_mean = x_a.mean()
    v_mean = x_v.mean()
    v_v = torch.tanh(x_v) * (0.5 + t_v) - 0.3 * x_v + 0.2 * torch.sin(a_mean) + 0.1 * t_a
    v_a = torch.cos(x_a) * (1.0 - 0.5 * t_a) - 0.4 * x_a + 0.15 * v_mean * t_v
    return v_v, v_a


def _fixed_target(x0_v, x0_a):
    """The exact velocity for a point-mass data distribution at x0: v = x0 − ε = (x0 − x)/σ."""

    def fn(x_v, x_a, t_v, t_a):
        return (x0_v - x_v) / (1 - t_v), (x0_a - x_a) / (1 - t_a)

    return fn


# ---- schedules ------------------------------------------------------------------------------------------------------
def test_constants():
    assert (VIDEO_SHIFT, AUDIO_SHIFT, DEFAULT_STEPS) == (12.0, 3.0, 8)
    cfg = SamplerConfig()
    assert (cfg.sampler, cfg.scheduler, cfg.steps, cfg.video_shift, cfg.audio_shift) == (
        "res_multistep", "simple", 8, 12.0, 3.0)
    assert cfg.audio_carry == 4.0


def test_shift_and_audio_sigma():
    assert shift_sigma(0.0, 12.0) == 0.0 and shift_sigma(1.0, 12.0) == 1.0
    assert shift_sigma(0.5, 12.0) == pytest.approx(12 / 13)
    b = torch.linspace(0, 1, 101, dtype=torch.float64)
    for s_v, s_a in ((12.0, 3.0), (6.0, 3.0), (5.0, 2.0), (1.0, 1.0)):
        got = audio_sigma_from_video(shift_sigma(b, s_v), s_v, s_a)
        torch.testing.assert_close(got, shift_sigma(b, s_a), atol=1e-12, rtol=0)


def test_eight_step_tables():
    sv, sa = simple_sigmas(8, VIDEO_SHIFT), simple_sigmas(8, AUDIO_SHIFT)
    assert sv.dtype == torch.float32 and sv.shape == (9,) and sv[-1] == 0
    torch.testing.assert_close(sv, torch.tensor(TABLE_VIDEO_8), atol=5e-6, rtol=0)
    torch.testing.assert_close(sa, torch.tensor(TABLE_AUDIO_8), atol=1e-6, rtol=0)
    # the joint schedule of the default config is exactly those two tables
    jv, ja = schedule(SamplerConfig())
    assert torch.equal(jv, sv) and torch.equal(ja, sa)
    # ComfyUI simple with 8 steps == diffusers with N = 9, bit for bit, for both shifts (§7.2)
    assert torch.equal(sv, _diffusers_grid(9, VIDEO_SHIFT))
    assert torch.equal(sa, _diffusers_grid(9, AUDIO_SHIFT))
    assert torch.equal(diffusers_sigmas(9, VIDEO_SHIFT), sv)
    jv, ja = schedule(SamplerConfig(scheduler="diffusers"))
    assert torch.equal(jv, sv) and torch.equal(ja, sa)


@pytest.mark.parametrize("shift", [12.0, 3.0, 1.0, 5.5, 0.7])
@pytest.mark.parametrize("num_points", [2, 3, 5, 9, 17, 31, 51, 201])
def test_diffusers_sigmas_match_scheduler(num_points, shift):
    assert torch.equal(diffusers_sigmas(num_points, shift), _diffusers_grid(num_points, shift))


@pytest.mark.parametrize("steps", [1, 4, 8, 20, 50])
def test_diffusers_joint_schedule_matches_two_schedulers(steps):
    jv, ja = schedule(SamplerConfig(scheduler="diffusers", steps=steps))
    assert torch.equal(jv, _diffusers_grid(steps + 1, VIDEO_SHIFT))
    assert torch.equal(ja, _diffusers_grid(steps + 1, AUDIO_SHIFT))


def test_simple_sigmas_index_comfy_table():
    # independent construction: the 1000-entry table sigma((k+1)/1000) and ComfyUI's float index step
    table = [12.0 * ((k + 1) / 1000) / (1 + 11.0 * ((k + 1) / 1000)) for k in range(1000)]
    for steps in (1, 3, 7, 8, 16, 38, 100, 200):
        got = simple_sigmas(steps, 12.0)
        ss = 1000 / steps
        want = [table[-(1 + int(x * ss))] for x in range(steps)] + [0.0]
        assert got.shape == (steps + 1,)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=2e-7, rtol=0)
        assert bool((got[1:] < got[:-1]).all())
    # steps = 38: x = 19 gives int(19 * 26.315...) = 499 (not 500), i.e. b = 0.501
    assert simple_sigmas(38, 1.0)[19].item() == pytest.approx(0.501, abs=1e-7)
    # the simple grid is not the diffusers grid in general (int truncation of the table index)
    assert not torch.equal(simple_sigmas(7, 12.0), _diffusers_grid(8, 12.0))


def test_schedule_audio_follows_video():
    for cfg in (SamplerConfig(steps=13), SamplerConfig(scheduler="diffusers", steps=13, video_shift=6.0)):
        sv, sa = schedule(cfg)
        torch.testing.assert_close(sa, audio_sigma_from_video(sv, cfg.video_shift, cfg.audio_shift),
                                   atol=3e-7, rtol=0)


# ---- config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(sampler="dpmpp_2m"), "valid samplers: res_multistep, euler"),
    (dict(sampler=""), "valid samplers"),
    (dict(scheduler="karras"), "valid schedulers: simple, diffusers"),
    (dict(steps=0), r"steps must be an integer in 1\.\.200"),
    (dict(steps=201), r"1\.\.200"),
    (dict(steps=2.5), "steps"),
    (dict(steps=True), "steps"),
    (dict(video_shift=0.0), "video_shift must be a finite number > 0"),
    (dict(audio_shift=-3.0), "audio_shift"),
    (dict(audio_shift=float("nan")), "audio_shift"),
    (dict(video_shift=float("inf")), "video_shift"),
])
def test_bad_configs(kwargs, match):
    cfg = SamplerConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    with pytest.raises(ValueError, match=match):  # sample() validates too, before doing any work
        sample(_coupled_toy, torch.zeros(VSHAPE), torch.zeros(ASHAPE), cfg)


def test_good_configs_and_from_params():
    for cfg in (SamplerConfig(), SamplerConfig("euler", "diffusers", 1, 6.0, 3.0), SamplerConfig(steps=200)):
        assert cfg.validate() is cfg

    class P:  # RenderParams-shaped, proto defaults ("" / 0 = model default)
        sampler, scheduler, steps, video_shift, audio_shift = "", "", 0, 0.0, 0.0

    assert SamplerConfig.from_params(P()) == SamplerConfig()
    P.sampler, P.steps, P.video_shift = "euler", 20, 6.0
    assert SamplerConfig.from_params(P()) == SamplerConfig("euler", "simple", 20, 6.0, 3.0)
    P.sampler = "heun"
    with pytest.raises(ValueError, match="valid samplers"):
        SamplerConfig.from_params(P())
    with pytest.raises(ValueError, match="steps"):
        simple_sigmas(0, 12.0)
    with pytest.raises(ValueError, match="num_points"):
        diffusers_sigmas(1, 12.0)


# ---- noise ----------------------------------------------------------------------------------------------------------
def test_initial_noise():
    v1, a1 = initial_noise(1234, (2, 3, 4), (5, 6))
    v2, a2 = initial_noise(1234, (2, 3, 4), (5, 6))
    assert v1.dtype == a1.dtype == torch.float32 and v1.shape == (2, 3, 4) and a1.shape == (5, 6)
    assert torch.equal(v1, v2) and torch.equal(a1, a2)
    # drawn on a seeded CPU generator, video first then audio
    g = torch.Generator().manual_seed(1234)
    assert torch.equal(v1, torch.randn((2, 3, 4), generator=g)) and torch.equal(a1, torch.randn((5, 6), generator=g))
    v3, _ = initial_noise(1235, (2, 3, 4), (5, 6))
    assert not torch.equal(v1, v3)
    initial_noise(2**63 - 1, (1,), (1,))
    for bad in (-1, 2**63, 1.0, True):
        with pytest.raises(ValueError, match="seed"):
            initial_noise(bad, (1,), (1,))
    with pytest.raises(ValueError, match="video_shape"):
        initial_noise(0, (0, 3), (1,))
    with pytest.raises(ValueError, match="audio_rows_shape"):
        initial_noise(0, (1,), "ab")


# ---- the loop: Euler ------------------------------------------------------------------------------------------------
def _euler_two_clocks_f64(denoise, nv, na, sv, sa):
    """Reference: plain Euler on each stream's OWN sigma grid (no carry), float64, x + (x − D)/σ·(σ' − σ)."""
    x, xa = nv.double() * sv[0], na.double() * sa[0]
    for i in range(len(sv) - 1):
        tv = torch.tensor(1 - sv[i], dtype=torch.float64)
        ta = torch.tensor(1 - sa[i], dtype=torch.float64)
        v_v, v_a = denoise(x, xa, tv, ta)
        d_v, d_a = x + sv[i] * v_v, xa + sa[i] * v_a
        x = x + (x - d_v) / sv[i] * (sv[i + 1] - sv[i])
        xa = xa + (xa - d_a) / sa[i] * (sa[i + 1] - sa[i])
    return x, xa


@pytest.mark.parametrize("cfg", [
    SamplerConfig("euler"),
    SamplerConfig("euler", "diffusers", steps=20),
    SamplerConfig("euler", "simple", steps=30, video_shift=5.0, audio_shift=2.0),  # k = 2.5
    SamplerConfig("euler", "simple", steps=5, video_shift=2.0, audio_shift=7.0),  # k < 1
])
def test_euler_with_carry_equals_euler_on_own_audio_grid(cfg):
    nv, na = initial_noise(7, VSHAPE, ASHAPE)
    sv, sa = (s.double().tolist() for s in schedule(cfg))
    want_v, want_a = _euler_two_clocks_f64(_coupled_toy, nv, na, sv, sa)
    got_v, got_a = sample(_coupled_toy, nv, na, cfg)
    assert got_v.dtype == got_a.dtype == torch.float32
    torch.testing.assert_close(got_v.double(), want_v, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(got_a.double(), want_a, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("scheduler, steps", [("diffusers", 8), ("diffusers", 3), ("diffusers", 25), ("simple", 8)])
def test_euler_matches_diffusers_scheduler(scheduler, steps):
    nv, na = initial_noise(11, VSHAPE, ASHAPE)
    sch_v, sch_a = MiniMaxH3Scheduler(shift=VIDEO_SHIFT), MiniMaxH3Scheduler(shift=AUDIO_SHIFT)
    sch_v.set_timesteps(steps + 1)
    sch_a.set_timesteps(steps + 1)
    x, xa = nv.clone(), na.clone()
    for t_v, t_a in zip(sch_v.timesteps, sch_a.timesteps):
        v_v, v_a = _coupled_toy(x, xa, t_v, t_a)
        x = sch_v.step(v_v, t_v, x).prev_sample
        xa = sch_a.step(v_a, t_a, xa).prev_sample
    got_v, got_a = sample(_coupled_toy, nv, na, SamplerConfig("euler", scheduler, steps))
    torch.testing.assert_close(got_v, x, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(got_a, xa, atol=2e-6, rtol=1e-6)


# ---- the loop: res_multistep ----------------------------------------------------------------------------------------
def _res_multistep_scalar(denoise_scalar, xv, ea, sv, sa, k):
    """Straightforward scalar §7.2 res_multistep (eta 0) over the packed state [video ; y] on the video grid,
    with the ComfyUI audio carry. Pure Python floats."""
    y = sv[0] * ea
    xv = sv[0] * xv
    old = None
    for i in range(len(sv) - 1):
        xa = sa[i] / sv[i] * y
        v_v, v_a = denoise_scalar(xv, xa, 1 - sv[i], 1 - sa[i])
        den = (xv + sv[i] * v_v, k * (xa + sa[i] * v_a))
        if old is None or sv[i + 1] == 0:
            xv = xv + (xv - den[0]) / sv[i] * (sv[i + 1] - sv[i])
            y = y + (y - den[1]) / sv[i] * (sv[i + 1] - sv[i])
        else:
            lam = lambda s: -math.log(s)  # noqa: E731
            h = lam(sv[i + 1]) - lam(sv[i])
            c2 = (lam(sv[i - 1]) - lam(sv[i])) / h
            phi1 = (math.exp(-h) - 1) / -h
            phi2 = (phi1 - 1) / -h
            b1, b2 = phi1 - phi2 / c2, phi2 / c2
            xv = math.exp(-h) * xv + h * (b1 * den[0] + b2 * old[0])
            y = math.exp(-h) * y + h * (b1 * den[1] + b2 * old[1])
        old = den
    return xv, y / k


def _elementwise_toy(x_v, x_a, t_v, t_a, sin=torch.sin, tanh=torch.tanh):
    return tanh(x_v) * (0.5 + t_v) - 0.3 * x_v + 0.1 * t_a, sin(x_a) * (1.0 - 0.5 * t_a) - 0.4 * x_a + 0.2 * t_v


@pytest.mark.parametrize("cfg", [
    SamplerConfig(),
    SamplerConfig(scheduler="diffusers", steps=12),
    SamplerConfig(steps=40, video_shift=5.0, audio_shift=2.0),
    SamplerConfig(steps=2),
])
def test_res_multistep_matches_scalar_reference(cfg):
    nv, na = initial_noise(3, (5,), (4,))
    got_v, got_a = sample(_elementwise_toy, nv, na, cfg)
    sv, sa = (s.tolist() for s in schedule(cfg))
    scalar = lambda a, b, c, d: _elementwise_toy(a, b, c, d, sin=math.sin, tanh=math.tanh)  # noqa: E731
    for j in range(5):
        want_v, _ = _res_multistep_scalar(scalar, nv[j].item(), na[j % 4].item(), sv, sa, cfg.audio_carry)
        assert got_v[j].item() == pytest.approx(want_v, abs=3e-6, rel=3e-6)
    for j in range(4):
        _, want_a = _res_multistep_scalar(scalar, nv[j].item(), na[j].item(), sv, sa, cfg.audio_carry)
        assert got_a[j].item() == pytest.approx(want_a, abs=3e-6, rel=3e-6)
    # and it is a genuinely different integrator from Euler on this problem
    e_v, _ = sample(_elementwise_toy, nv, na, SamplerConfig("euler", cfg.scheduler, cfg.steps,
                                                             cfg.video_shift, cfg.audio_shift))
    if cfg.steps > 2:
        assert (e_v - got_v).abs().max() > 1e-4


@pytest.mark.parametrize("sampler", ["res_multistep", "euler"])
@pytest.mark.parametrize("steps", [1, 2, 8, 37])
def test_fixed_target_converges(sampler, steps):
    x0_v, x0_a = initial_noise(99, VSHAPE, ASHAPE)
    x0_v, x0_a = 3 * x0_v + 1, 0.5 * x0_a - 2
    nv, na = initial_noise(5, VSHAPE, ASHAPE)
    got_v, got_a = sample(_fixed_target(x0_v, x0_a), nv, na, SamplerConfig(sampler, steps=steps))
    torch.testing.assert_close(got_v, x0_v, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_a, x0_a, atol=2e-5, rtol=1e-5)


def test_carry_matches_comfy_velocity_form():
    # §7.2: ComfyUI converts the audio velocity (its sign: out = −v) to v_y = (1 − k)·x_a + (1 + (k − 1)·σ_a)·out,
    # and its denoised is y − σ_v·v_y. That must equal our D_y = k·(x_a + σ_a·v).
    sv, sa = (s.double() for s in schedule(SamplerConfig(steps=16)))
    k = VIDEO_SHIFT / AUDIO_SHIFT
    g = torch.Generator().manual_seed(0)
    for i in range(16):
        x_a, v = torch.randn(10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
        y = x_a * sv[i] / sa[i]
        comfy_denoised = y - sv[i] * ((1 - k) * x_a + (1 + (k - 1) * sa[i]) * (-v))
        torch.testing.assert_close(comfy_denoised, k * (x_a + sa[i] * v), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sampler", ["res_multistep", "euler"])
def test_last_step_returns_denoised_exactly(sampler):
    calls = []

    def rec(x_v, x_a, t_v, t_a):
        out = _coupled_toy(x_v, x_a, t_v, t_a)
        calls.append((x_v.clone(), x_a.clone(), t_v.clone(), t_a.clone(), out[0].clone(), out[1].clone()))
        return out

    nv, na = initial_noise(21, VSHAPE, ASHAPE)
    cfg = SamplerConfig(sampler)
    got_v, got_a = sample(rec, nv, na, cfg)
    sv, sa = schedule(cfg)
    assert len(calls) == cfg.steps
    x_v, x_a, t_v, t_a, v_v, v_a = calls[-1]
    assert torch.equal(t_v, 1 - sv[-2]) and torch.equal(t_a, 1 - sa[-2])
    assert torch.equal(got_v, x_v + sv[-2] * v_v)
    assert torch.equal(got_a, x_a + sa[-2] * v_a)  # k = 4 is a power of two: the carry round trip is exact


def test_denoise_sees_stream_timesteps_and_latents():
    seen = []

    def rec(x_v, x_a, t_v, t_a):
        assert t_v.shape == t_a.shape == () and t_v.dtype == t_a.dtype == torch.float32
        assert x_v.dtype == x_a.dtype == torch.float32
        seen.append((t_v.item(), t_a.item(), x_a.clone()))
        return _coupled_toy(x_v, x_a, t_v, t_a)

    nv, na = initial_noise(2, VSHAPE, ASHAPE)
    sample(rec, nv, na, SamplerConfig())
    sv, sa = schedule(SamplerConfig())
    assert [s[0] for s in seen] == (1 - sv[:-1]).tolist()
    assert [s[1] for s in seen] == (1 - sa[:-1]).tolist()
    assert seen[0][0] == seen[0][1] == 0.0  # §11.1: one distinct t at the first step
    assert torch.equal(seen[0][2], na)  # at σ = 1 the model sees the audio noise itself (carry factor 1)


def test_deterministic_bitwise():
    outs = []
    for _ in range(2):
        nv, na = initial_noise(424242, VSHAPE, ASHAPE)
        outs.append(sample(_coupled_toy, nv, na, SamplerConfig(steps=10)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    nv, na = initial_noise(424243, VSHAPE, ASHAPE)
    other = sample(_coupled_toy, nv, na, SamplerConfig(steps=10))
    assert not torch.equal(outs[0][0], other[0])


def test_inputs_not_modified_and_half_noise_accepted():
    nv, na = initial_noise(8, VSHAPE, ASHAPE)
    nv0, na0 = nv.clone(), na.clone()
    sample(_coupled_toy, nv, na, SamplerConfig())
    assert torch.equal(nv, nv0) and torch.equal(na, na0)
    v, a = sample(_coupled_toy, nv.bfloat16(), na.bfloat16(), SamplerConfig(steps=2))
    assert v.dtype == a.dtype == torch.float32


# ---- callbacks / cancellation ---------------------------------------------------------------------------------------
def test_on_step_and_should_stop_called_per_step():
    events = []
    nv, na = initial_noise(1, VSHAPE, ASHAPE)

    def den(*args):
        events.append("model")
        return _coupled_toy(*args)

    def stop():
        events.append("stop?")
        return False

    sample(den, nv, na, SamplerConfig(steps=3), on_step=lambda i, n: events.append((i, n)), should_stop=stop)
    assert events == ["stop?", "model", (1, 3), "stop?", "model", (2, 3), "stop?", "model", (3, 3)]


@pytest.mark.parametrize("stop_at", [0, 3, 7])
def test_should_stop_raises_cancelled_at_boundary(stop_at):
    n_model, progress, n_stop = [], [], [0]

    def stop():
        n_stop[0] += 1
        return n_stop[0] - 1 == stop_at

    def den(*args):
        n_model.append(1)
        return _coupled_toy(*args)

    nv, na = initial_noise(1, VSHAPE, ASHAPE)
    with pytest.raises(Cancelled) as ei:
        sample(den, nv, na, SamplerConfig(), on_step=lambda i, n: progress.append(i), should_stop=stop)
    assert len(n_model) == stop_at and progress == list(range(1, stop_at + 1))
    assert ei.value.steps_done == stop_at and ei.value.total == 8
    assert isinstance(ei.value, stagekit.errors.Cancelled)  # the server maps it to gRPC CANCELLED
    assert stagekit.errors.status_for(ei.value)[0].name == "CANCELLED"


def test_bad_inputs():
    nv, na = initial_noise(1, VSHAPE, ASHAPE)
    with pytest.raises(ValueError, match="v_audio of shape"):
        sample(lambda xv, xa, tv, ta: (xv, xa[:1]), nv, na, SamplerConfig())
    with pytest.raises(ValueError, match="video_noise must be a floating-point tensor"):
        sample(_coupled_toy, torch.zeros(VSHAPE, dtype=torch.int64), na, SamplerConfig())
    with pytest.raises(ValueError, match="audio_noise"):
        sample(_coupled_toy, nv, [1.0], SamplerConfig())


# ---- GPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_per_step_host_sync_and_same_noise_bits():
    nv_cpu, na_cpu = initial_noise(5, VSHAPE, ASHAPE)
    nv, na = initial_noise(5, VSHAPE, ASHAPE, device="cuda")
    assert nv.is_cuda and torch.equal(nv.cpu(), nv_cpu) and torch.equal(na.cpu(), na_cpu)

    def syncs(steps):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = sample(_coupled_toy, nv, na, SamplerConfig(steps=steps))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return out, sum("called a synchronizing CUDA operation" in str(x.message) for x in w)

    (v2, _), s2 = syncs(2)
    (v8, a8), s8 = syncs(8)
    assert s8 == s2 <= 1, (s2, s8)  # at most the one table upload, nothing per step
    assert v8.is_cuda and a8.is_cuda
    cpu_v, cpu_a = sample(_coupled_toy, nv_cpu, na_cpu, SamplerConfig(steps=8))
    torch.testing.assert_close(v8.cpu(), cpu_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a8.cpu(), cpu_a, atol=1e-5, rtol=1e-5)
