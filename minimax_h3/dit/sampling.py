"""Sigma schedules and the denoising loop of MiniMax-H3 (rectified flow, video + audio on one sampler clock).

Facts: docs/model.md §7 (sampling), §2.6 (per-row t), §10 items 3/6, §11 items 1/3/4.

Conventions used throughout (§7.1):
  x_σ = (1 − σ)·x0 + σ·ε,   t = 1 − σ (t = 1 is clean),   the DiT returns the *data-ward* velocity v = x0 − ε,
  so the denoised estimate is x0_hat = x_σ + σ·v.

Two shifted schedules share one base grid b ∈ [0, 1]:  σ(b) = s·b / (1 + (s − 1)·b), s = 12 (video) and 3 (audio).

How the loop integrates both streams (ComfyUI `ModelSamplingAV` "audio carry", §7.2): the sampler advances ONE sigma
grid, the video one, over the state [x_video ; y] with y = (σ_v/σ_a)·x_audio. Because the shifts act on a shared b,
y = σ_v·ε + (1 − σ_v)·(k·x0_audio) with k = s_v/s_a, i.e. y is an ordinary flow interpolation on the video clock whose
clean target is k·x0_audio. So any single-clock sampler applies unchanged, provided that
  * the model sees x_audio = (σ_a/σ_v)·y at timestep t_audio = 1 − σ_a,
  * the audio "denoised" in the sampler frame is D_y = k·x0_hat_audio,
  * the sampler starts from y = σ_v0·ε_audio and the result is x_audio = y / k.
For Euler (a DDIM-type update) this is exactly Euler on the audio's own σ_a grid; for res_multistep it is what
ComfyUI computes (the exponential integrator runs on the video clock's λ = −ln σ_v).

The loop itself stays device-agnostic and host-sync free: every per-step scalar (σ, t, carry factor, update weights)
is precomputed on the CPU from the fp32 schedule, moved to the latent device once as one small fp32 table, and
indexed per step (a 0-dim device tensor, no `.item()`). The only host round trips per step are the caller's
`should_stop` / `on_step` callbacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from minimax_h3.contract import DEFAULT_STEPS, MAX_SEED, MAX_STEPS, MIN_STEPS, SAMPLERS, SCHEDULERS
from stagekit.checkpoints import nonfinite_flag
from stagekit.errors import Cancelled as _StageCancelled
from stagekit.errors import Internal, InvalidArgument

# ---- model-defined constants --------------------------------------------------------------------------------------
VIDEO_SHIFT = 12.0  # sigma_shift_video of the release (§7.2)
AUDIO_SHIFT = 3.0  # sigma_shift_audio of the release (§7.2)

# ComfyUI's ModelSamplingDiscreteFlow keeps a table of 1000 sigmas, sigma(k / 1000) for k = 1..1000; the `simple`
# scheduler picks evenly spaced entries from it (§7.2).
FLOW_TABLE_SIZE = 1000

SamplerName = Literal["res_multistep", "euler"]
SchedulerName = Literal["simple", "diffusers"]

# denoise(x_video, x_audio, t_video, t_audio) -> (v_video, v_audio), data-ward velocities of the TARGET rows.
DenoiseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Cancelled(_StageCancelled):
    """Sampling was stopped by `should_stop()` at a step boundary (maps to gRPC CANCELLED)."""

    def __init__(self, steps_done: int, total: int):
        super().__init__(f"sampling cancelled after {steps_done} of {total} steps")
        self.steps_done = steps_done
        self.total = total


# ---- schedules ------------------------------------------------------------------------------------------------------
def shift_sigma(b, s: float):
    """Exponential time shift σ = s·b / (1 + (s − 1)·b) of a base-grid value (float or tensor; tensors keep dtype).

    Written in the same operation order as ComfyUI's `time_snr_shift` and diffusers' scheduler so an fp32 tensor
    input gives bit-identical tables.
    """
    return s * b / (1 + (s - 1) * b)


def audio_sigma_from_video(sigma_v, s_v: float = VIDEO_SHIFT, s_a: float = AUDIO_SHIFT):
    """The audio sigma on the same base-grid point as `sigma_v`: invert the video shift to b, apply the audio shift."""
    b = sigma_v / (s_v + sigma_v * (1 - s_v))
    return shift_sigma(b, s_a)


def _check_shift(shift: float, name: str = "shift") -> None:
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise InvalidArgument(f"{name} must be a finite number > 0 (model default {VIDEO_SHIFT} video / "
                         f"{AUDIO_SHIFT} audio), got {shift!r}")


def _check_int(value, name: str, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name} must be an integer in {rng}, got {value!r}")


def _simple_base(steps: int) -> torch.Tensor:
    """Base-grid points of ComfyUI's `simple` scheduler: steps entries of the 1000-table, then b = 0 (σ = 0).

    Entry x is table index 999 − int(x·(1000/steps)), i.e. b = (1000 − int(x·ss))/1000 with the float step
    ss = 1000/steps exactly as ComfyUI computes it (this differs from integer division for e.g. steps = 38, 76).
    The table itself is (k/1000) for k = 1..1000 in fp32.
    """
    ss = FLOW_TABLE_SIZE / steps
    idx = torch.tensor([FLOW_TABLE_SIZE - int(x * ss) for x in range(steps)] + [0], dtype=torch.int64)
    return idx / FLOW_TABLE_SIZE  # int64 / int -> fp32, same values as the ComfyUI table rows


def simple_sigmas(steps: int, shift: float) -> torch.Tensor:
    """ComfyUI `ModelSamplingDiscreteFlow(shift)` + `simple` scheduler: [steps + 1] fp32 sigmas ending in 0."""
    _check_int(steps, "steps", 1, FLOW_TABLE_SIZE)
    _check_shift(shift)
    return shift_sigma(_simple_base(steps), float(shift))


def _diffusers_base(num_points: int, shift: float) -> torch.Tensor:
    """linspace(1, 0, N) in fp32, with the points dropped whose shifted sigma repeats the previous one."""
    b = torch.linspace(1.0, 0.0, num_points, dtype=torch.float32)
    sig = shift_sigma(b, float(shift))
    keep = torch.ones(num_points, dtype=torch.bool)
    keep[1:] = sig[1:] != sig[:-1]  # float32 collisions created by the shift near σ = 1
    return b[keep]


def diffusers_sigmas(num_points: int, shift: float) -> torch.Tensor:
    """diffusers `MiniMaxH3Scheduler` grid: N points (terminal 0 included, so N − 1 model calls), duplicates removed."""
    _check_int(num_points, "num_points", 2)
    _check_shift(shift)
    return shift_sigma(_diffusers_base(num_points, shift), float(shift))


# ---- config -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplerConfig:
    """What the sampler needs from a request. `steps` counts model evaluations for both schedulers
    (the diffusers grid then has steps + 1 points, §10 item 6)."""

    sampler: SamplerName = "res_multistep"
    scheduler: SchedulerName = "simple"
    steps: int = DEFAULT_STEPS
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT

    def validate(self) -> "SamplerConfig":
        if self.sampler not in SAMPLERS:
            raise InvalidArgument(f"unknown sampler {self.sampler!r}; valid samplers: {', '.join(SAMPLERS)}")
        if self.scheduler not in SCHEDULERS:
            raise InvalidArgument(f"unknown scheduler {self.scheduler!r}; valid schedulers: {', '.join(SCHEDULERS)}")
        _check_int(self.steps, "steps", MIN_STEPS, MAX_STEPS)
        _check_shift(self.video_shift, "video_shift")
        _check_shift(self.audio_shift, "audio_shift")
        return self

    @classmethod
    def from_params(cls, params) -> "SamplerConfig":
        """Build from an object with RenderParams' fields, where "" / 0 mean "model default" (common.proto)."""
        return cls(
            sampler=params.sampler or "res_multistep",
            scheduler=params.scheduler or "simple",
            steps=int(params.steps) or DEFAULT_STEPS,
            video_shift=float(params.video_shift) or VIDEO_SHIFT,
            audio_shift=float(params.audio_shift) or AUDIO_SHIFT,
        ).validate()

    @property
    def audio_carry(self) -> float:
        """k = s_v / s_a: the sampler-frame audio target is k·x0_audio."""
        return self.video_shift / self.audio_shift


def schedule(cfg: SamplerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ_video, σ_audio), each [n + 1] fp32 on CPU ending in 0, n = model evaluations.

    Both come from the same base-grid points, so σ_audio equals `audio_sigma_from_video(σ_video)` up to fp32
    rounding and equals the audio table of the matching diffusers/ComfyUI schedule bit for bit.
    """
    cfg.validate()
    if cfg.scheduler == "simple":
        b = _simple_base(cfg.steps)
    else:
        b = _diffusers_base(cfg.steps + 1, cfg.video_shift)  # dedupe on the clock the sampler integrates
    return shift_sigma(b, float(cfg.video_shift)), shift_sigma(b, float(cfg.audio_shift))


# ---- per-step coefficients ------------------------------------------------------------------------------------------
# Columns of the per-step table moved to the device once.
_SV, _SA, _TV, _TA, _CARRY, _CX, _CD, _CO, _K = range(9)


def _phi1(z: float) -> float:
    return math.expm1(z) / z


def _phi2(z: float) -> float:
    return (_phi1(z) - 1.0) / z


def _update_weights(sampler: str, sig: list[float], i: int) -> tuple[float, float, float]:
    """Weights (c_x, c_D, c_Dprev) of x_{i+1} = c_x·x_i + c_D·D_i + c_Dprev·D_{i−1} on the sampler grid (§7.2).

    Computed in float64 on the host from the fp32 grid, so they are identical on every device and rank.
    """
    s, s_next = sig[i], sig[i + 1]
    if s_next == s:  # degenerate grid point (extreme shifts): nothing to integrate
        return 1.0, 0.0, 0.0
    r = s_next / s
    euler = r, 1.0 - r, 0.0  # x + (x − D)/σ·(σ' − σ) written as a blend, so σ' = 0 gives exactly D
    if sampler == "euler" or i == 0 or s_next == 0.0:
        return euler
    # res_multistep, eta = 0 (ComfyUI sample_res_multistep): 2nd-order exponential integrator in λ = −ln σ.
    h = math.log(s) - math.log(s_next)  # λ(σ_{i+1}) − λ(σ_i) > 0
    h_prev = math.log(s) - math.log(sig[i - 1])  # λ(σ_{i−1}) − λ(σ_i) < 0
    c2 = h_prev / h
    if c2 == 0.0 or not math.isfinite(c2):  # repeated previous sigma: no usable history, take the 1st-order step
        return euler
    p1, p2 = _phi1(-h), _phi2(-h)
    b1, b2 = p1 - p2 / c2, p2 / c2
    return math.exp(-h), h * b1, h * b2


def _step_table(cfg: SamplerConfig, sigma_v: torch.Tensor, sigma_a: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """[n, 9] fp32 (σ_v, σ_a, t_v, t_a, carry σ_a/σ_v, c_x, c_D, c_Dprev, k) per model evaluation, and for each step
    whether it uses the previous denoised (known on the host, so the loop never inspects device values)."""
    n = sigma_v.numel() - 1
    sv, sa = sigma_v[:-1], sigma_a[:-1]
    sig = [float(x) for x in sigma_v]  # the exact fp32 grid values as Python floats
    weights = [_update_weights(cfg.sampler, sig, i) for i in range(n)]
    w = torch.tensor(weights, dtype=torch.float64).float()
    table = torch.stack([sv, sa, 1.0 - sv, 1.0 - sa, sa / sv,  # t = 1 − σ in fp32, as the reference builds it
                         w[:, 0], w[:, 1], w[:, 2], torch.full_like(sv, cfg.audio_carry)], dim=1)
    return table, [wi[2] != 0.0 for wi in weights]


# ---- noise ----------------------------------------------------------------------------------------------------------
def _check_shape(shape, name: str, rows_may_be_0: bool = False) -> tuple[int, ...]:
    """A shape of positive ints; `rows_may_be_0`: its first dim may be 0 (an image's audio: no rows)."""
    try:
        shape = tuple(shape)
    except TypeError:
        raise InvalidArgument(f"{name} must be a sequence of positive ints, got {shape!r}") from None
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= -int(rows_may_be_0 and i == 0)
                        for i, d in enumerate(shape)):
        raise InvalidArgument(f"{name} must be a non-empty sequence of positive ints, got {shape!r}")
    return shape


def draw_noise(seed: int, cond_shapes, video_shape, audio_rows_shape
               ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(per-keyframe noises, video noise, audio noise rows): standard-normal fp32 drawn exactly as diffusers' MiniMax-H3
    pipeline draws them (docs/checkpoints.md, "Seeds"), so a seed gives the same starting latents in both:

      one CPU generator seeded with `seed`; first one draw per keyframe in packed order (its latent shape
      [24, 1, H/16, W/16]), then the video noise as a latent [24, T, H/16, W/16] (patchified into rows afterwards),
      then the audio noise directly in row layout `audio_rows_shape` = [2 * Ta, 32] (channel-major rows, the
      first Ta rows the left channel) -- not [2, 32, Ta]: the same random stream in another arrangement would give
      other audio. An image (Ta = 0) draws no audio noise.

    CPU-drawn so every device and every TP rank gets the same bits; without keyframes the video/audio bits are those
    of `initial_noise`."""
    _check_int(seed, "seed", 0, MAX_SEED)
    shapes = [_check_shape(s, f"cond_shapes[{i}]") for i, s in enumerate(cond_shapes)]
    video_shape = _check_shape(video_shape, "video_shape")
    audio_rows_shape = _check_shape(audio_rows_shape, "audio_rows_shape", rows_may_be_0=True)  # none: an image
    gen = torch.Generator(device="cpu").manual_seed(seed)
    conds = [torch.randn(s, generator=gen, dtype=torch.float32) for s in shapes]
    video = torch.randn(video_shape, generator=gen, dtype=torch.float32)
    audio_rows = torch.randn(audio_rows_shape, generator=gen, dtype=torch.float32)
    return conds, video, audio_rows


def initial_noise(seed: int, video_shape, audio_rows_shape, device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """t2va noise (video latent, audio rows) for `seed` (see `draw_noise`), moved to `device` after drawing."""
    _, video, audio = draw_noise(seed, (), video_shape, audio_rows_shape)
    if device is not None:
        video, audio = video.to(device), audio.to(device)
    return video, audio


# ---- the loop -------------------------------------------------------------------------------------------------------
def _check_output(out: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"denoise returned {name} of shape {got}, expected {tuple(like.shape)} (the target rows)")
    return out.to(torch.float32)


def sample(
    denoise: DenoiseFn,
    video_noise: torch.Tensor,
    audio_noise: torch.Tensor,
    cfg: SamplerConfig,
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate from noise to (video_x0, audio_x0), fp32, same shapes and device as the noise.

    `denoise(x_video, x_audio, t_video, t_audio)` gets fp32 latents of the target rows and 0-dim fp32 t tensors on the
    latent device (t = 1 − σ of each stream, §2.6), and returns the data-ward velocities (v_video, v_audio).
    `should_stop()` is called before every model evaluation (a step boundary, on every rank; it may run a collective)
    and a True raises `Cancelled`. `on_step(done, total)` is called after every step with done = 1..total.
    Deterministic: no randomness, fixed fp32 arithmetic, one model call per step.

    Latents that are not finite are never returned: each step records on the device whether its latents are all
    finite (no host sync per step), and the end raises `Internal` (a server fault: weights or kernels) naming the
    first step whose latents held a NaN or an Inf.
    """
    cfg.validate()
    for name, t in (("video_noise", video_noise), ("audio_noise", audio_noise)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise InvalidArgument(f"{name} must be a floating-point tensor, got {type(t).__name__}"
                             f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
    if video_noise.device != audio_noise.device:
        raise InvalidArgument(f"video_noise is on {video_noise.device} but audio_noise on {audio_noise.device}; "
                         "put both on the device the model runs on")

    sigma_v, sigma_a = schedule(cfg)
    n = sigma_v.numel() - 1
    table, multistep = _step_table(cfg, sigma_v, sigma_a)
    table = table.to(video_noise.device)  # the only host->device copy of the run
    s0, k = table[0, _SV], table[0, _K]

    # Sampler state: video rows and the carried audio y = (σ_v/σ_a)·x_a, both starting as σ_0·ε (ComfyUI's noise
    # scaling of an empty latent). σ_0 = shift(1) = 1 (exactly so for the model shifts): this is the noise itself.
    x = video_noise.to(torch.float32) * s0
    y = audio_noise.to(torch.float32) * s0
    d_x_prev = d_y_prev = None
    finite = torch.ones(n, dtype=torch.bool, device=x.device)  # finite[i]: the latents after step i + 1

    for i in range(n):
        if should_stop is not None and should_stop():
            raise Cancelled(i, n)
        row = table[i]
        sv, sa = row[_SV], row[_SA]
        x_audio = y * row[_CARRY]
        v_video, v_audio = denoise(x, x_audio, row[_TV], row[_TA])
        v_video = _check_output(v_video, x, "v_video")
        v_audio = _check_output(v_audio, y, "v_audio")
        d_x = x + sv * v_video  # x0_hat, video
        d_y = (x_audio + sa * v_audio) * k  # k·x0_hat, audio in the sampler frame

        cx, cd = row[_CX], row[_CD]
        if multistep[i]:
            co = row[_CO]
            x = cx * x + cd * d_x + co * d_x_prev
            y = cx * y + cd * d_y + co * d_y_prev
        else:
            x = cx * x + cd * d_x
            y = cx * y + cd * d_y
        if cfg.sampler == "res_multistep":
            d_x_prev, d_y_prev = d_x, d_y
        flags = [f for f in (nonfinite_flag(x), nonfinite_flag(y)) if f is not None]  # an image has no audio rows
        finite[i] = ~torch.stack(flags).any()
        if on_step is not None:
            on_step(i + 1, n)

    _check_finite_steps(finite)
    return x, y / k


def _check_finite_steps(finite: torch.Tensor) -> None:
    """One host sync for the whole run: raise `Internal` naming the first step whose latents were not finite."""
    if bool(finite.all()):
        return
    step = int((~finite).nonzero()[0]) + 1
    raise Internal(f"dit: the sampled latents hold NaN/Inf from step {step} of {finite.numel()} on (the model's "
                   "output at that step was not finite); a server fault (its weights or kernels), nothing was sent")
