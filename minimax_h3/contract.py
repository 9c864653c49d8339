"""Input rules for a render, enforced by the client and again by every stage.

The numbers are the model's: frames follow the VAE's 17-frame clip rule
(F = 17n + 5 pixel frames -> 5n + 2 latent frames), sizes are whole 32-px DiT
rows (VAE /16 then patch 2), and the canvas bounds are those the model was
trained on (the seeds render up to 1920x1088; 4:1 aspect either way).
"""

from __future__ import annotations

from dataclasses import dataclass

from stagekit.errors import InvalidArgument

FPS = 24
FRAME_CLIP = 17           # VAE clip length in pixel frames
FRAME_OFFSET = 5          # F = 17n + 5
MIN_FRAMES = 22           # n = 1: the reference VAE decode rejects fewer than 3 latent frames
MAX_FRAMES = 515          # n = 30 (trained range is ~124-362; longer is allowed, not promised)
SIZE_MULTIPLE = 32        # one DiT row covers 32x32 pixels
MIN_SIDE, MAX_SIDE = 256, 2048
MAX_AREA = 1920 * 1088    # largest canvas the seeds target
MAX_ASPECT = 4.0
MIN_STEPS, MAX_STEPS = 1, 200
MAX_SEED = 2**63 - 1
MAX_PROMPT_BYTES = 64 << 10  # far above any prompt that fits the encoder's --max-prompt-tokens; refuses abuse early
SAMPLERS = ("res_multistep", "euler")
SCHEDULERS = ("simple", "diffusers")
DEFAULT_STEPS = 8          # model calls in the stock ComfyUI template (res_multistep + simple)
DEFAULT_SIZE = (832, 480)
DEFAULT_FRAMES = 124
DEFAULT_CRF = 18           # H.264 quality when a request says 0
MAX_CRF = 51               # x264's scale: 0 means DEFAULT_CRF here, lower is better
MAX_OUTPUT_SIDE = 4096     # --upscale bounds: H.264 level 5.1 sizes, at most UHD
MAX_OUTPUT_AREA = 3840 * 2160
MAX_ASPECT_CHANGE = 0.10   # an upscale may stretch the picture by at most 10 % (832x480 -> 1920x1080: 2.5 %)


@dataclass(frozen=True)
class RenderSpec:
    prompt: str = ""
    width: int = DEFAULT_SIZE[0]
    height: int = DEFAULT_SIZE[1]
    frames: int = DEFAULT_FRAMES
    steps: int = DEFAULT_STEPS
    seed: int = 0
    sampler: str = "res_multistep"
    scheduler: str = "simple"
    video_shift: float = 0.0  # 0 = the model's default
    audio_shift: float = 0.0

    @property
    def latent_frames(self) -> int:
        return (self.frames - FRAME_OFFSET) // FRAME_CLIP * 5 + 2

    @property
    def audio_latents(self) -> int:
        # 40 audio latents per second at 24 fps video (hop 800 at 32 kHz)
        return round(self.frames / FPS * 40)


def nearest_valid_frames(frames: int) -> tuple[int, int]:
    n = max(0, (frames - FRAME_OFFSET) // FRAME_CLIP)
    lo = FRAME_CLIP * n + FRAME_OFFSET
    return max(lo, MIN_FRAMES), max(lo + FRAME_CLIP, MIN_FRAMES)


def validate(spec: RenderSpec, need_prompt: bool = False) -> RenderSpec:
    """Raise InvalidArgument with an actionable message for the first rule broken."""
    if need_prompt and not spec.prompt.strip():
        raise InvalidArgument("prompt is empty; describe the video (and its sound) to generate")
    f = spec.frames
    if f < MIN_FRAMES or f > MAX_FRAMES or (f - FRAME_OFFSET) % FRAME_CLIP:
        lo, hi = nearest_valid_frames(min(max(f, MIN_FRAMES), MAX_FRAMES))
        near = f"{lo} or {hi}" if lo != hi and hi <= MAX_FRAMES else str(lo)
        raise InvalidArgument(
            f"frames={f} is not valid: frame counts must be 17n+5 between {MIN_FRAMES} and {MAX_FRAMES} "
            f"(nearest valid: {near}; 124 = 5.2 s at 24 fps)")
    for name, v in (("width", spec.width), ("height", spec.height)):
        if v % SIZE_MULTIPLE or not MIN_SIDE <= v <= MAX_SIDE:
            r = max(MIN_SIDE, min(MAX_SIDE, round(v / SIZE_MULTIPLE) * SIZE_MULTIPLE))
            raise InvalidArgument(
                f"{name}={v} is not valid: use a multiple of {SIZE_MULTIPLE} between {MIN_SIDE} and {MAX_SIDE} (e.g. {r})")
    if spec.width * spec.height > MAX_AREA:
        raise InvalidArgument(
            f"{spec.width}x{spec.height} is larger than the model canvas ({MAX_AREA} pixels, e.g. 1920x1088)")
    aspect = max(spec.width, spec.height) / min(spec.width, spec.height)
    if aspect > MAX_ASPECT:
        raise InvalidArgument(f"aspect ratio {spec.width}x{spec.height} is beyond 4:1")
    if not MIN_STEPS <= spec.steps <= MAX_STEPS:
        raise InvalidArgument(f"steps={spec.steps} is not valid: use {MIN_STEPS}..{MAX_STEPS} (default {DEFAULT_STEPS})")
    if not 0 <= spec.seed <= MAX_SEED:
        raise InvalidArgument(f"seed={spec.seed} is not valid: use 0..2^63-1")
    if spec.sampler not in SAMPLERS:
        raise InvalidArgument(f"unknown sampler {spec.sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if spec.scheduler not in SCHEDULERS:
        raise InvalidArgument(f"unknown scheduler {spec.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    for name, v in (("video_shift", spec.video_shift), ("audio_shift", spec.audio_shift)):
        if not (v == 0 or 0.1 <= v <= 100):
            raise InvalidArgument(f"{name}={v} is not valid: use 0 (model default) or 0.1..100")
    return spec


def check_upscale(width: int, height: int, out_width: int, out_height: int) -> None:
    """An output size for a `width` x `height` render: even sides (yuv420p), at most UHD, near the render's aspect.
    Raises InvalidArgument with the rule broken."""
    if out_width <= 0 or out_height <= 0:
        raise InvalidArgument(f"upscale {out_width}x{out_height}: give both width and height (e.g. 1920x1080)")
    if out_width % 2 or out_height % 2:
        raise InvalidArgument(f"upscale {out_width}x{out_height}: H.264 yuv420p needs even width and height")
    if max(out_width, out_height) > MAX_OUTPUT_SIDE or out_width * out_height > MAX_OUTPUT_AREA:
        raise InvalidArgument(f"upscale {out_width}x{out_height} is beyond the largest output "
                              f"({MAX_OUTPUT_SIDE} per side, {MAX_OUTPUT_AREA} pixels, e.g. 3840x2160)")
    change = abs((out_width / out_height) / (width / height) - 1)
    if change > MAX_ASPECT_CHANGE:
        near = round(out_height * width / height / 2) * 2
        raise InvalidArgument(f"upscale {out_width}x{out_height} changes the {width}x{height} render's aspect by "
                              f"{change:.0%} (at most {MAX_ASPECT_CHANGE:.0%}); e.g. {near}x{out_height}")


def check_output(spec: RenderSpec, crf: int, upscale_width: int = 0, upscale_height: int = 0) -> None:
    """The MP4 settings of a render (what the client checks before anything starts, and the render service and
    the decoder again on receipt): `crf` 0 (= DEFAULT_CRF) .. MAX_CRF, an upscale size per `check_upscale`."""
    if not 0 <= crf <= MAX_CRF:
        raise InvalidArgument(f"crf={crf} is not valid: use 1..{MAX_CRF}, lower is better (0 means {DEFAULT_CRF})")
    if upscale_width or upscale_height:
        check_upscale(spec.width, spec.height, upscale_width, upscale_height)


def spec_from_proto(p) -> RenderSpec:
    """RenderParams message -> RenderSpec (unset optional fields mean 'default')."""
    def get(name: str, default: int) -> int:
        return getattr(p, name) if p.HasField(name) else default

    return RenderSpec(
        prompt=p.prompt,
        width=get("width", DEFAULT_SIZE[0]),
        height=get("height", DEFAULT_SIZE[1]),
        frames=get("frames", DEFAULT_FRAMES),
        steps=get("steps", DEFAULT_STEPS),
        seed=p.seed,
        sampler=p.sampler or "res_multistep",
        scheduler=p.scheduler or "simple",
        video_shift=p.video_shift,
        audio_shift=p.audio_shift,
    )


def spec_to_proto(spec: RenderSpec, msg) -> None:
    """Fill a RenderParams message from a RenderSpec."""
    msg.prompt = spec.prompt
    msg.width, msg.height, msg.frames, msg.steps, msg.seed = spec.width, spec.height, spec.frames, spec.steps, spec.seed
    msg.sampler, msg.scheduler = spec.sampler, spec.scheduler
    msg.video_shift, msg.audio_shift = spec.video_shift, spec.audio_shift
