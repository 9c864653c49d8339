"""H3's contract between the stages: latent geometry, the inter-stage tensors, and the render-spec rules.

Every process that handles a render (the client, the render service, the load tester, the encoder, the DiT and the
decoder stages) takes these facts from here and nowhere else; the module is torch-free so the thin client can
import it. docs/model.md §3 has the model facts behind the numbers.

1. **Geometry.** Frames follow the video VAE's 17-frame clip rule (F = 17n + 5 pixel frames -> T = 5n + 2 latent
   frames); a latent covers 16x16 pixels (sizes are whole 32-px DiT rows: VAE /16 then patch 2); video latents have
   24 channels; audio is 32 kHz stereo, one 32-channel latent per 800 samples (40 latents/s, Ta = round(F/24*40)).
2. **Render spec.** `RenderSpec` and `validate`: the canvas bounds are those the model was trained on (the seeds
   render up to 1920x1088; 4:1 aspect either way). Each process validates a spec once, where it enters. A spec may
   ask for VSA block-sparse attention (`SparseAttention`: ComfyUI's BlockSparseAttention values).
3. **Tensors.** `TENSORS` names every tensor one stage hands another, with its dtype class and its shape as a
   function of the render spec (and of the serving model's `LatentGeometry`; None = any size); `RESULTS` says,
   call by call, which tensors a stage sends back to its caller.
4. **Partitions.** Which of the two DiT files (fl2va, ref2va) a request needs, and the refusal naming it.
5. **LoRAs.** Which file a request's LoRA name means, and the refusal of a name a DiT would not take, from what its
   Status reports (`StageStatus.loras`).
6. **Long video.** How a render longer than one window is cut into windows aligned to the VAE's 17-frame clips
   (`plan_windows`), which prompt each window takes, and which frames an extension samples (docs/long_video.md).
   The plan is a function of the spec alone, so the client, the render service and the DiT agree on it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import PurePath
from types import MappingProxyType
from typing import Callable, Literal, Mapping, Sequence

from stagekit.errors import FailedPrecondition, InvalidArgument, NotFound

# ---- 1. latent geometry (docs/model.md §3.1-3.2) -------------------------------------------------------------------
FPS = 24                  # video frames per second
FRAME_CLIP = 17           # VAE clip length in pixel frames
FRAME_OFFSET = 5          # F = 17n + 5
LATENTS_PER_CLIP = 5      # T = 5n + 2: five latent frames per clip ...
LATENT_FRAME_OFFSET = 2   # ... and two for the first frame's clip, less the three dropped
VAE_SPATIAL = 16          # pixels per latent on each spatial axis
VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32
AUDIO_CHANNELS = 2        # stereo: each channel encoded alone by the mono audio VAE
AUDIO_SAMPLE_RATE = 32000
AUDIO_HOP = 800           # audio samples per latent
AUDIO_LATENTS_PER_SECOND = AUDIO_SAMPLE_RATE // AUDIO_HOP  # 40

# ---- render-spec bounds ------------------------------------------------------------------------------------------
MIN_FRAMES = 22           # n = 1: the reference VAE decode rejects fewer than 3 latent frames
IMAGE_FRAMES = 1          # an image: one latent frame (a still, as ComfyUI samples EmptyLatentImage), no sound
IMAGE_PROMPT_ONLY = ("an image (frames=1) renders from the prompt alone: keyframes, references and guides condition "
                     "a video")
MAX_WINDOW_FRAMES = 515   # one window, sampled in one pass: n = 30 (trained range is ~124-362; longer is not promised)
MAX_FRAMES = 7196         # n = 423, 299.8 s: beyond one window the render is sampled in windows (section 6)
SIZE_MULTIPLE = 32        # one DiT row covers 32x32 pixels
MIN_SIDE, MAX_SIDE = 256, 2048
MAX_AREA = 1920 * 1088    # largest canvas the seeds target
MAX_ASPECT = 4.0
MIN_STEPS, MAX_STEPS = 1, 200
MAX_SEED = 2**63 - 1
MAX_PROMPT_BYTES = 64 << 10  # far above any prompt that fits the encoder's --max-prompt-tokens; refuses abuse early
SAMPLERS = ("res_multistep", "euler")
SCHEDULERS = ("simple", "diffusers")
# "exact": every DiT block at every step (the same bits as ever); "fast": step caching (First Block Cache,
# minimax_h3/dit/step_cache.py) skips most blocks on steps whose first block changed little since the last full one.
QUALITIES = ("exact", "fast")
# How image references are sized (minimax_h3.media.ImageFit): the model's own 2048 px short edge (""), or ComfyUI's
# MiniMaxH3ReferenceToVideo `ref_image_size`, scaled down only: to that short edge ("max"), to the render's area
# ("match").
REF_IMAGE_SIZES = ("", "max", "match")
# ComfyUI's BlockSparseAttention node (docs/workflows.md): the methods this product runs, and its widgets' bounds.
SPARSE_METHODS = ("vsa",)
MIN_KEEP_PERCENT, MAX_KEEP_PERCENT = 0.5, 95.0
MAX_MIN_TOKENS = 1 << 20
DEFAULT_STEPS = 8          # model calls in the stock ComfyUI template (res_multistep + simple)
DEFAULT_SIZE = (832, 480)
DEFAULT_FRAMES = 124
DEFAULT_CRF = 18           # H.264 quality when a request says 0
PNG = "png"                # RenderRequest.output_format of an image: its one frame, taken from an MP4 written at
IMAGE_CRF = 1              # ... this quality unless the request names one
MAX_CRF = 51               # x264's scale: 0 means DEFAULT_CRF here, lower is better
MAX_OUTPUT_SIDE = 4096     # --upscale bounds: H.264 level 5.1 sizes, at most UHD
MAX_OUTPUT_AREA = 3840 * 2160
MAX_ASPECT_CHANGE = 0.10   # an upscale may stretch the picture by at most 10 % (832x480 -> 1920x1080: 2.5 %)


def snap_frames(frames: int) -> int:
    """Smallest valid frame count (17n + 5) >= frames."""
    if frames < 1:
        raise InvalidArgument(f"frames must be >= 1, got {frames}")
    n = max(0, -(-(frames - FRAME_OFFSET) // FRAME_CLIP))
    return FRAME_CLIP * n + FRAME_OFFSET


def video_latent_frames(frames: int) -> int:
    """T = 5n + 2 latent frames for F = 17n + 5 pixel frames, 1 for an image; InvalidArgument for any other count."""
    if frames == IMAGE_FRAMES:
        return 1
    if frames < FRAME_OFFSET or frames % FRAME_CLIP != FRAME_OFFSET:
        raise InvalidArgument(
            f"frames must be of the form 17*n + 5 (e.g. 124, 141, 362), got {frames}; snap_frames({frames}) = "
            f"{snap_frames(frames)}"
        )
    return (frames - FRAME_OFFSET) // FRAME_CLIP * LATENTS_PER_CLIP + LATENT_FRAME_OFFSET


def audio_latent_count(frames: int) -> int:
    """Ta = round(F / 24 * 40) audio latents per channel (never a .5 tie for F = 17n + 5); none for an image."""
    if frames == IMAGE_FRAMES:
        return 0
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


def audio_samples(frames: int, fps: int = FPS) -> int:
    """Audio samples per channel that last as long as `frames` video frames: round(F * 32000 / fps)."""
    return round(frames * AUDIO_SAMPLE_RATE / fps)


def latent_side(pixels: int) -> int:
    """Latents along a spatial axis of `pixels` pixels."""
    return pixels // VAE_SPATIAL


def pixel_side(latents: int) -> int:
    """Pixels along a spatial axis of `latents` latents."""
    return latents * VAE_SPATIAL


@dataclass(frozen=True)
class LatentGeometry:
    """The channel widths and spatial ratio of the latents a stage serves (its VAEs' or its DiT's config); H3's
    are the defaults. The time axis is always H3's clock (`video_latent_frames`, `audio_latent_count`)."""

    video_channels: int = VIDEO_LATENT_CHANNELS
    spatial_ratio: int = VAE_SPATIAL
    audio_channels: int = AUDIO_LATENT_CHANNELS


H3_GEOMETRY = LatentGeometry()


def one_video_latent(latents, what: str):
    """A video latent `[C, T, h, w]` (a tensor or an array), given as that or as a batch of one `[1, C, T, h, w]`;
    InvalidArgument naming `what` for any other shape."""
    if latents.ndim == 5 and latents.shape[0] == 1:
        latents = latents[0]
    if latents.ndim != 4:
        raise InvalidArgument(f"{what} takes one video latent [C, T, h, w] (or a batch of one, [1, C, T, h, w]); "
                              f"got shape {tuple(latents.shape)}")
    return latents


# ---- 2. the render spec --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SparseAttention:
    """VSA block-sparse attention in the DiT's blocks, as ComfyUI's BlockSparseAttention node (method "vsa") sets it
    (docs/kernels.md, "Block-sparse attention (VSA)"); the defaults are the FastH3 templates' values."""

    method: str = "vsa"              # SPARSE_METHODS
    keep_percent: float = 10.0       # video tiles a video query tile keeps by score (FastH3 is trained at 10)
    start_percent: float = 0.2       # dense at the schedule's sigmas above shift(1 - start) ...
    end_percent: float = 1.0         # ... and below shift(1 - end)
    dense_blocks: tuple[int, ...] = ()  # DiT blocks that always run dense
    min_tokens: int = 12288          # packed sequences of fewer rows run dense


@dataclass(frozen=True)
class RenderSpec:
    """One render's parameters (common.proto's RenderParams, unset fields filled in); valid once `validate` passed."""

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
    quality: str = "exact"  # QUALITIES
    # Long video (section 6); 0 / "" / () = the product's pick.
    window_frames: int = 0         # frames per window (17n + 5)
    window_overlap: int = 0        # frames two neighbouring windows share (17m + 5)
    window_mode: str = ""          # "fused" | "continuation"
    window_fuse: str = ""          # fused windows' weights: "pyramid" | "flat" | "overlap-linear"
    more_prompts: tuple[str, ...] = ()     # the prompts after `prompt`, in time order
    prompt_starts: tuple[float, ...] = ()  # each more prompt's start second on the clip's clock; () = spread evenly
    prefix_frames: int = 0         # an extension: frames [0, prefix_frames) are a finished clip it continues
    ref_image_size: str = ""       # REF_IMAGE_SIZES

    @property
    def span_start(self) -> int:
        """The first frame whose latents the DiT returns: 0, or for an extension the first frame of the source's
        tail it continues from (the guide, `prefix_frames - overlap`)."""
        return self.prefix_frames - self.guide_frames

    @property
    def guide_frames(self) -> int:
        """Frames of the source's tail an extension is conditioned on (0 for other renders)."""
        return (self.window_overlap or DEFAULT_OVERLAP[CONTINUATION]) if self.prefix_frames else 0
    sparse: SparseAttention | None = None  # None: dense attention

    @property
    def latent_frames(self) -> int:
        """T = 5n + 2 video latent frames the DiT returns: the whole clip's (17n + 5 frames), or an extension's span
        from `span_start`."""
        return video_latent_frames(self.frames - self.span_start)

    @property
    def latent_size(self) -> tuple[int, int]:
        """(H/16, W/16): the latent height and width of the canvas."""
        return latent_side(self.height), latent_side(self.width)

    @property
    def audio_latents(self) -> int:
        """Ta audio latents per channel the DiT returns: round(F / 24 * 40) for a whole clip, the span's for an
        extension (counted on the clip's clock, so the parts add up to the whole)."""
        return audio_latent_count(self.frames) - audio_latent_count(self.span_start)

    @property
    def guide_latents(self) -> int:
        """Video latent frames of an extension's guide (0 for other renders)."""
        return video_latent_frames(self.guide_frames) if self.prefix_frames else 0

    @property
    def guide_audio_latents(self) -> int:
        """Audio latents per channel of an extension's guide (0 for other renders)."""
        return audio_latent_count(self.prefix_frames) - audio_latent_count(self.span_start)

    @property
    def prompts(self) -> tuple[str, ...]:
        """Every prompt in time order (the first is `prompt`)."""
        return (self.prompt, *self.more_prompts)


def nearest_valid_frames(frames: int) -> tuple[int, int]:
    n = max(0, (frames - FRAME_OFFSET) // FRAME_CLIP)
    lo = FRAME_CLIP * n + FRAME_OFFSET
    return max(lo, MIN_FRAMES), max(lo + FRAME_CLIP, MIN_FRAMES)


def check_canvas(width: int, height: int) -> None:
    """A render canvas: whole DiT rows, within the trained sizes and aspects. Raises InvalidArgument."""
    for name, v in (("width", width), ("height", height)):
        if v % SIZE_MULTIPLE or not MIN_SIDE <= v <= MAX_SIDE:
            r = max(MIN_SIDE, min(MAX_SIDE, round(v / SIZE_MULTIPLE) * SIZE_MULTIPLE))
            raise InvalidArgument(
                f"{name}={v} is not valid: use a multiple of {SIZE_MULTIPLE} between {MIN_SIDE} and {MAX_SIDE} (e.g. {r})")
    if width * height > MAX_AREA:
        raise InvalidArgument(f"{width}x{height} is larger than the model canvas ({MAX_AREA} pixels, e.g. 1920x1088)")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise InvalidArgument(f"aspect ratio {width}x{height} is beyond 4:1")


def validate(spec: RenderSpec, need_prompt: bool = False) -> RenderSpec:
    """Raise InvalidArgument with an actionable message for the first rule broken; returns `spec`. Each process
    calls it once, where a spec enters it: the client's CLI, the render service's Submit, the DiT's Sample and the
    decoder's Decode; what runs after takes the spec as valid."""
    if need_prompt and not spec.prompt.strip():
        raise InvalidArgument("prompt is empty; describe the video (and its sound) to generate")
    f = spec.frames
    if f != IMAGE_FRAMES and (f < MIN_FRAMES or f > MAX_FRAMES or (f - FRAME_OFFSET) % FRAME_CLIP):
        lo, hi = nearest_valid_frames(min(max(f, MIN_FRAMES), MAX_FRAMES))
        near = f"{lo} or {hi}" if lo != hi and hi <= MAX_FRAMES else str(lo)
        raise InvalidArgument(
            f"frames={f} is not valid: frame counts must be 17n+5 between {MIN_FRAMES} and {MAX_FRAMES}, or "
            f"{IMAGE_FRAMES} for an image "
            f"(nearest valid: {near}; 124 = 5.2 s at 24 fps; beyond {MAX_WINDOW_FRAMES} the render is sampled in "
            "windows)")
    check_canvas(spec.width, spec.height)
    if not MIN_STEPS <= spec.steps <= MAX_STEPS:
        raise InvalidArgument(f"steps={spec.steps} is not valid: use {MIN_STEPS}..{MAX_STEPS} (default {DEFAULT_STEPS})")
    if not 0 <= spec.seed <= MAX_SEED:
        raise InvalidArgument(f"seed={spec.seed} is not valid: use 0..2^63-1")
    if spec.sampler not in SAMPLERS:
        raise InvalidArgument(f"unknown sampler {spec.sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if spec.scheduler not in SCHEDULERS:
        raise InvalidArgument(f"unknown scheduler {spec.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if spec.quality not in QUALITIES:
        raise InvalidArgument(f"unknown quality {spec.quality!r}; choose exact (every step computed, the default) or "
                              "fast (steps that change little reuse the last full step's work)")
    if spec.ref_image_size not in REF_IMAGE_SIZES:
        raise InvalidArgument(f"unknown ref_image_size {spec.ref_image_size!r}; choose max (image references scaled "
                              "down only, to a 2048 px short edge) or match (down only, to the render's area), or "
                              "leave it unset (the model's 2048 px short edge)")
    for name, v in (("video_shift", spec.video_shift), ("audio_shift", spec.audio_shift)):
        if not (v == 0 or 0.1 <= v <= 100):
            raise InvalidArgument(f"{name}={v} is not valid: use 0 (model default) or 0.1..100")
    windows = plan_windows(spec)  # the window fields, the prompts and an extension's frames (section 6)
    if windows.mode != SINGLE and (spec.quality == "fast" or spec.sparse is not None):
        what = "quality fast caches the steps" if spec.quality == "fast" else "sparse attention (VSA) tiles the rows"
        raise InvalidArgument(f"{what} of one window, and this render is sampled in windows ({windows.describe()}): "
                              f"render at most {MAX_WINDOW_FRAMES} frames with one prompt, or without it")
    if spec.sparse is not None:
        check_sparse(spec.sparse)
    return spec


def check_sparse(sp: SparseAttention) -> None:
    """A sparse-attention setting within the node's widget bounds. Raises InvalidArgument."""
    if sp.method not in SPARSE_METHODS:
        raise InvalidArgument(f"sparse attention method {sp.method!r}: this product runs {', '.join(SPARSE_METHODS)} "
                              "(the FastH3 checkpoints' video sparse attention)")
    if not MIN_KEEP_PERCENT <= sp.keep_percent <= MAX_KEEP_PERCENT:
        raise InvalidArgument(f"keep_percent={sp.keep_percent} is not valid: use "
                              f"{MIN_KEEP_PERCENT}..{MAX_KEEP_PERCENT} (FastH3 is trained at 10)")
    for name, v in (("start_percent", sp.start_percent), ("end_percent", sp.end_percent)):
        if not 0 <= v <= 1:
            raise InvalidArgument(f"{name}={v} is not valid: a point of the schedule, 0..1")
    if not 0 <= sp.min_tokens <= MAX_MIN_TOKENS:
        raise InvalidArgument(f"min_tokens={sp.min_tokens} is not valid: use 0..{MAX_MIN_TOKENS}")
    if any(b < 0 for b in sp.dense_blocks):
        raise InvalidArgument(f"dense_blocks {list(sp.dense_blocks)}: block numbers are >= 0")


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
        quality=p.quality or "exact",
        window_frames=p.window_frames,
        window_overlap=p.window_overlap,
        window_mode=p.window_mode,
        window_fuse=p.window_fuse,
        more_prompts=tuple(p.more_prompts),
        prompt_starts=tuple(p.prompt_starts),
        prefix_frames=p.prefix_frames,
        ref_image_size=p.ref_image_size,
        sparse=_sparse_from_proto(p.sparse_attention) if p.HasField("sparse_attention") else None,
    )


def _sparse_from_proto(m) -> SparseAttention:
    return SparseAttention(method=m.method, keep_percent=m.keep_percent, start_percent=m.start_percent,
                           end_percent=m.end_percent, dense_blocks=tuple(m.dense_blocks), min_tokens=m.min_tokens)


def spec_to_proto(spec: RenderSpec, msg) -> None:
    """Fill a RenderParams message from a RenderSpec."""
    msg.prompt = spec.prompt
    msg.width, msg.height, msg.frames, msg.steps, msg.seed = spec.width, spec.height, spec.frames, spec.steps, spec.seed
    msg.sampler, msg.scheduler = spec.sampler, spec.scheduler
    msg.video_shift, msg.audio_shift = spec.video_shift, spec.audio_shift
    msg.quality = spec.quality
    msg.window_frames, msg.window_overlap = spec.window_frames, spec.window_overlap
    msg.window_mode, msg.window_fuse, msg.prefix_frames = spec.window_mode, spec.window_fuse, spec.prefix_frames
    msg.ref_image_size = spec.ref_image_size
    msg.more_prompts[:] = spec.more_prompts
    msg.prompt_starts[:] = spec.prompt_starts
    msg.ClearField("sparse_attention")
    if spec.sparse is not None:
        sparse_to_proto(spec.sparse, msg.sparse_attention)


def sparse_to_proto(sp: SparseAttention, m) -> None:
    """Fill a SparseAttention message (setting it, in its RenderParams) from `sp`."""
    m.SetInParent()
    m.method, m.keep_percent, m.start_percent, m.end_percent = sp.method, sp.keep_percent, sp.start_percent, \
        sp.end_percent
    m.dense_blocks[:] = sp.dense_blocks
    m.min_tokens = sp.min_tokens


# ---- 3. inter-stage tensors ----------------------------------------------------------------------------------------
TEXT_STATES = "text_states"      # encoder -> DiT
TEXT_TAGS = "text_tags"          # encoder -> DiT (prompts with vision blocks)
TAIL_VIDEO = "tail_video"      # render service -> DiT: an extension's source tail (latents kept, or EncodeTail)
TAIL_AUDIO = "tail_audio"
VIDEO_LATENTS = "video_latents"  # DiT -> decoder
AUDIO_LATENTS = "audio_latents"  # DiT -> decoder
KEYFRAME_ANCHORS = ("first", "last")
REFERENCE_KINDS = ("image", "video", "audio")  # a reference is an image, a video (with or without sound) or a sound
MAX_REFERENCES = 12              # the released ref2va checkpoint's limit (diffusers enforces the same)
# ... and its limits per kind, as MiniMax-H3 documents them (a video's soundtrack does not count as an audio clip).
MAX_REFERENCES_OF_KIND = MappingProxyType({"image": 9, "video": 3, "audio": 3})
REF_PREFIX = "ref_"


def check_reference_kinds(kinds: Sequence[str]) -> None:
    """The mix of references (their kinds, in request order) the ref2va checkpoint takes: at most MAX_REFERENCES,
    at most MAX_REFERENCES_OF_KIND of each kind, and audio clips only beside an image or a video (a voice or music
    belongs to someone or something seen). InvalidArgument naming the limit and the fix."""
    if len(kinds) > MAX_REFERENCES:
        raise InvalidArgument(f"{len(kinds)} references; MiniMax-H3 takes at most {MAX_REFERENCES}")
    for kind, limit in MAX_REFERENCES_OF_KIND.items():
        if kinds.count(kind) > limit:
            raise InvalidArgument(f"MiniMax-H3 takes at most {limit} {kind} references, got {kinds.count(kind)}")
    if kinds and set(kinds) == {"audio"}:
        raise InvalidArgument("audio references need at least one image or video reference beside them: add the "
                              "picture or clip the voice or sound belongs to, and name both in the prompt")


# Guides (ComfyUI's MiniMaxH3AddGuide): an image and / or a sound anchored at one pixel frame of the generated video,
# conditioning rows beside the keyframes / references (docs/model.md §2.7-2.8). The DiT takes guide i's latents as
# `guide_tensor(i, part)` and every guide's frame in GUIDE_FRAMES.
GUIDE_PARTS = ("image", "audio")
GUIDE_PREFIX = "guide_"
GUIDE_FRAMES = "guide_frames"  # [G] int64: the pixel frame of each guide (negative: counted from the end)
MAX_GUIDES = 16


def guide_tensor(index: int, part: str) -> str:
    """Wire name of guide `index`'s (0-based, request order) `part` ("image" | "audio")."""
    return f"{GUIDE_PREFIX}{index}_{part}"


def resolve_guide_frame(frame: int, frames: int) -> int:
    """A guide's pixel frame in a video of `frames` frames: `frame` itself, or counted from the end when negative
    (-1 is the last frame), as ComfyUI's `frame_idx`. InvalidArgument when it falls outside the video."""
    resolved = frame if frame >= 0 else frames + frame
    if not 0 <= resolved < frames:
        raise InvalidArgument(f"guide frame {frame} is outside the video's {frames} frames (0..{frames - 1}, or "
                              f"-{frames}..-1 counted from the end)")
    return resolved


def seconds_to_frame(seconds: float) -> int:
    """The frame shown at `seconds` into the video: round(seconds * 24), as ComfyUI's templates compute `frame_idx`."""
    return round(seconds * FPS)
def prompt_tensor(index: int) -> str:
    """Wire name of the text states of the render's prompt `index` (0 = `prompt`, then each of `more_prompts`)."""
    return TEXT_STATES if index == 0 else f"{TEXT_STATES}_{index}"


def keyframe_tensor(anchor: str) -> str:
    """Wire name of the fl2va keyframe latent at `anchor` ("first" | "last")."""
    return f"keyframe_{anchor}"


def ref_tensor(index: int, part: str) -> str:
    """Wire name of ref2va reference `index`'s (0-based, request order) `part` ("image" | "video" | "audio")."""
    return f"{REF_PREFIX}{index}_{part}"


KEYFRAME_TENSORS = MappingProxyType({a: keyframe_tensor(a) for a in KEYFRAME_ANCHORS})
MAX_PROMPTS = 32                 # prompts of one render (a long one takes one per window)
PROMPT_TENSORS = tuple(prompt_tensor(i) for i in range(1, MAX_PROMPTS))  # the prompts after the first
REF_TENSOR_NAMES = tuple(ref_tensor(i, p) for i in range(MAX_REFERENCES) for p in REFERENCE_KINDS)
GUIDE_TENSOR_NAMES = tuple(guide_tensor(i, p) for i in range(MAX_GUIDES) for p in GUIDE_PARTS)

# The decoder's result names (decoder.proto; their rules are in RESULTS): EncodeImage's keyframe latent (sent on as
# `keyframe_tensor(anchor)`), EncodeReference's latents (sent on as `ref_tensor(i, ...)`), a RAW Decode's frames and
# audio.
ENCODED_KEYFRAME = "latents"
ENCODED_REFERENCE_VIDEO, ENCODED_REFERENCE_AUDIO = "video", "audio"
RAW_FRAMES, RAW_AUDIO = "frames", "audio"

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class TensorRule:
    """One inter-stage tensor: its dtype class ("float", "int" or "uint8") and its shape for a render spec and the
    serving model's latent geometry (None = any size; `text_dim` is the encoder's / DiT's hidden width)."""

    name: str
    dtype: Literal["float", "int", "uint8"]
    shape: Callable[[RenderSpec, LatentGeometry, int | None], Shape]
    meaning: str


def _keyframe_shape(s: RenderSpec, g: LatentGeometry, _d) -> Shape:
    return (g.video_channels, 1, s.height // g.spatial_ratio, s.width // g.spatial_ratio)


_RULES = [
    TensorRule(TEXT_STATES, "float", lambda s, g, d: (None, d), "[L, text_dim] prompt (and vision-token) states"),
    TensorRule(TEXT_TAGS, "int", lambda s, g, d: (None,), "[L] DiT modality tag per text_states row"),
    TensorRule(VIDEO_LATENTS, "float",
               lambda s, g, d: (g.video_channels, s.latent_frames, s.height // g.spatial_ratio,
                                s.width // g.spatial_ratio), "[24, T, H/16, W/16] sampled video latents"),
    TensorRule(AUDIO_LATENTS, "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, s.audio_latents),
               "[2, 32, Ta] sampled audio latents, one item per stereo channel"),
    *(TensorRule(n, "float", lambda s, g, d: (None, d), "[L, text_dim] states of a later prompt (long video)")
      for n in PROMPT_TENSORS),
    TensorRule(TAIL_VIDEO, "float", lambda s, g, d: (g.video_channels, s.guide_latents, s.height // g.spatial_ratio,
                                                      s.width // g.spatial_ratio),
               "[24, Tg, H/16, W/16] an extension's source latents of its last `guide_frames` frames"),
    TensorRule(TAIL_AUDIO, "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, s.guide_audio_latents),
               "[2, 32, Tga] the source's audio latents of the same frames"),
    *(TensorRule(keyframe_tensor(a), "float", _keyframe_shape,
                 f"[24, 1, H/16, W/16] normalised VAE latent of the {a} frame (fl2va)") for a in KEYFRAME_ANCHORS),
    *(r for i in range(MAX_REFERENCES) for r in (
        TensorRule(ref_tensor(i, "image"), "float", lambda s, g, d: (g.video_channels, 1, None, None),
                   "[24, 1, h, w] latent of an image reference at its own size (ref2va)"),
        TensorRule(ref_tensor(i, "video"), "float", lambda s, g, d: (g.video_channels, None, None, None),
                   "[24, T, h, w] latents of a video reference on its own canvas (ref2va)"),
        TensorRule(ref_tensor(i, "audio"), "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, None),
                   "[2, 32, Ta] audio latents of a reference's sound (ref2va)"))),
    TensorRule(GUIDE_FRAMES, "int", lambda s, g, d: (None,), "[G] pixel frame of each guide"),
    *(r for i in range(MAX_GUIDES) for r in (
        TensorRule(guide_tensor(i, "image"), "float", _keyframe_shape,
                   "[24, 1, H/16, W/16] normalised VAE latent of a guide image, fitted to the canvas"),
        TensorRule(guide_tensor(i, "audio"), "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, None),
                   "[2, 32, n] audio latents of a guide's sound"))),
]
TENSORS: Mapping[str, TensorRule] = MappingProxyType({r.name: r for r in _RULES})
SAMPLE_INPUTS = (TEXT_STATES, TEXT_TAGS, *KEYFRAME_TENSORS.values(), *REF_TENSOR_NAMES,  # what the DiT takes
                 GUIDE_FRAMES, *GUIDE_TENSOR_NAMES, *PROMPT_TENSORS, TAIL_VIDEO, TAIL_AUDIO)
SAMPLE_OUTPUTS = (VIDEO_LATENTS, AUDIO_LATENTS)  # what the DiT returns and the decoder takes

# What each stage call sends back to its caller, by RPC name; the caller checks the stream against it as it arrives
# (a result that breaks it is the stage's fault). A keyframe's and a RAW decode's sizes follow the request's canvas
# and frame count (for EncodeImage: its width and height).
RESULTS: Mapping[str, tuple[TensorRule, ...]] = MappingProxyType({
    "Encode": (TENSORS[TEXT_STATES], TENSORS[TEXT_TAGS]),
    "Sample": tuple(TENSORS[n] for n in SAMPLE_OUTPUTS),
    "EncodeImage": (TensorRule(ENCODED_KEYFRAME, "float", _keyframe_shape,
                               "[24, 1, H/16, W/16] normalised VAE latent of a keyframe image, fitted to the canvas"),),
    "EncodeReference": (
        TensorRule(ENCODED_REFERENCE_VIDEO, "float", lambda s, g, d: (g.video_channels, None, None, None),
                   "[24, T, h, w] latents of an image (T = 1) or video reference on its own canvas"),
        TensorRule(ENCODED_REFERENCE_AUDIO, "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, None),
                   "[2, 32, Ta] audio latents of a reference's sound")),
    "EncodeTail": (
        TensorRule(ENCODED_REFERENCE_VIDEO, "float", TENSORS[TAIL_VIDEO].shape,
                   "[24, Tg, H/16, W/16] latents of a finished MP4's last frames, on the render's canvas"),
        TensorRule(ENCODED_REFERENCE_AUDIO, "float", TENSORS[TAIL_AUDIO].shape,
                   "[2, 32, Tga] audio latents of the same frames")),
    "Decode": (
        TensorRule(RAW_FRAMES, "uint8", lambda s, g, d: (s.frames, s.height, s.width, 3),
                   "[F, H, W, 3] RGB frames of a RAW decode"),
        TensorRule(RAW_AUDIO, "float", lambda s, g, d: (AUDIO_CHANNELS, s.audio_latents * AUDIO_HOP),
                   "[2, Ta * 800] stereo audio of a RAW decode at AUDIO_SAMPLE_RATE")),
})


def tensor_shapes(names, spec: RenderSpec, geometry: LatentGeometry = H3_GEOMETRY,
                  text_dim: int | None = None) -> dict[str, Shape]:
    """{name: shape} of `names` for a render spec (see TENSORS)."""
    return {n: TENSORS[n].shape(spec, geometry, text_dim) for n in names}


def result_rules(call: str, spec: RenderSpec = RenderSpec(), geometry: LatentGeometry = H3_GEOMETRY,
                 text_dim: int | None = None) -> dict[str, tuple[str, Shape]]:
    """{name: (dtype class, shape)} of what stage call `call` (an RPC name in RESULTS) may send back."""
    return {r.name: (r.dtype, r.shape(spec, geometry, text_dim)) for r in RESULTS[call]}


def has_references(names) -> bool:
    """Whether a request's tensors include ref2va references."""
    return any(n.startswith(REF_PREFIX) for n in names)


def keyframe_anchors(names) -> tuple[str, ...]:
    """Anchors whose keyframe tensor is among `names`, in packed order (first before last)."""
    return tuple(a for a in KEYFRAME_ANCHORS if keyframe_tensor(a) in names)


# ---- 4. which DiT file a request needs ---------------------------------------------------------------------------
FL2VA = "fl2va"    # text, first/last frame
REF2VA = "ref2va"  # image / video / audio references
PARTITIONS = (FL2VA, REF2VA)


T2VA = "t2va"      # text alone (sampled by the fl2va file)
EXTEND = "extend"  # an extension whose source kept its latents (its guide is cut from them)
EXTEND_REENCODE = "extend_reencode"  # an extension whose guide is re-encoded from the source's MP4 (EncodeTail)
# The render stages each mode walks, in order (`keyframes`: the decoder's VAE encoders, for keyframes, references or
# an extension's guide).
RENDER_PLANS: dict[str, tuple[str, ...]] = {
    T2VA: ("encoder", "dit", "decoder"),
    FL2VA: ("keyframes", "encoder", "dit", "decoder"),
    REF2VA: ("keyframes", "encoder", "dit", "decoder"),
    EXTEND: ("encoder", "dit", "decoder"),
    EXTEND_REENCODE: ("keyframes", "encoder", "dit", "decoder"),
}


def render_mode(keyframes: bool, references: bool, extension: str = "") -> str:
    """The mode (key of RENDER_PLANS) of a request: an extension's (`extension`: EXTEND or EXTEND_REENCODE), ref2va
    with references, fl2va with first/last keyframes or guides (anything the VAE encoders encode first), else t2va."""
    return extension or (REF2VA if references else FL2VA if keyframes else T2VA)


def needed_partition(wants_references: bool) -> str:
    """The MiniMax-H3 partition trained for a request: references need ref2va, text / keyframe requests fl2va (the
    other file renders poor video without an error)."""
    return REF2VA if wants_references else FL2VA


def check_partition(wants_references: bool, served: Mapping[str, str]) -> None:
    """Refuse a request whose partition none of the `served` DiT files ({partition: file path}) provides, naming
    the file it needs. An empty `served` (not known) passes. Raises FailedPrecondition."""
    want = needed_partition(wants_references)
    if served and want not in served:
        what = "a render with references" if wants_references else "a text or first/last-frame render"
        have = ", ".join(f"{p} ({PurePath(f).name})" for p, f in served.items())
        raise FailedPrecondition(
            f"{what} needs the MiniMax-H3 {want} DiT file (minimax_h3_{want}_*.safetensors, or the release's "
            f"{'transformer_ref' if want == REF2VA else 'transformer'}/ folder, in the models folder), but the "
            f"DiT serves {have} only")


# ---- 5. which LoRAs a DiT takes ------------------------------------------------------------------------------------
LORA_FILE_SUFFIX = ".safetensors"
LORAS_LISTED = 20  # LoRA names a refusal lists (the rest are counted)


def lora_file_names(name: str) -> tuple[str, ...]:
    """The files in a DiT's loras directory that a request's bare LoRA `name` means, in the order the DiT tries
    them: the name as given, then with ".safetensors" added when it lacks it."""
    return (name,) if name.endswith(LORA_FILE_SUFFIX) else (name, name + LORA_FILE_SUFFIX)


def check_loras(names: Sequence[str], directory: str, served: Sequence[str], paths_allowed: bool) -> None:
    """Refuse request LoRA `names` that a DiT would refuse, from what its Status says it takes: the files `served`
    from its loras `directory` ("" = it has none) and, with `paths_allowed` (--allow-lora-paths), absolute paths
    (those files are on the DiT's machine: the DiT checks them itself). Raises, naming the fix, as the DiT would:
    InvalidArgument for a path it does not take, NotFound for a name it does not have."""
    have = set(served)
    listed = ", ".join(served[:LORAS_LISTED]) + (f" and {len(served) - LORAS_LISTED} more"
                                                 if len(served) > LORAS_LISTED else "")
    for name in names:
        if os.path.isabs(name):
            if paths_allowed:
                continue
            raise InvalidArgument(
                f"LoRA {name!r}: the DiT takes no LoRA paths, only the names of files in its loras directory"
                + (f" ({listed})" if served else "") + "; a path needs a DiT started with --allow-lora-paths")
        if any(f in have for f in lora_file_names(name)):
            continue
        if not directory:
            raise NotFound(f"LoRA {name!r}: the DiT has no loras directory, so it takes no LoRAs by name; "
                           "LoRA files go in <models-dir>/loras (or the DiT's --loras-dir)")
        raise NotFound(f"LoRA {name!r} not found in the DiT's loras directory {directory}: "
                       + (f"it has {listed}; name one of those, or copy the file there" if served else
                          "it holds no files; copy the LoRA file there"))


# ---- 6. long video: windows (docs/long_video.md) ----------------------------------------------------------------
SINGLE, FUSED, CONTINUATION = "single", "fused", "continuation"
WINDOW_MODES = (FUSED, CONTINUATION)
WINDOW_FUSES = ("pyramid", "flat", "overlap-linear")
MIN_WINDOW_FRAMES = 2 * FRAME_CLIP + FRAME_OFFSET  # 39: a window adds at least one clip beside its overlap
# The product's pick, for renders past one window: 175-frame (7.3 s) windows. A window of 960x544 with its guide is
# 31k packed rows (~4 GiB of activations beside the streamed DiT on a 22 GB card) and costs less per generated second
# than one 15 s window of 56k rows (docs/long_video.md, "Windows").
DEFAULT_WINDOW_FRAMES = 175
DEFAULT_OVERLAP = MappingProxyType({CONTINUATION: 22, FUSED: 39})  # vLLM-Omni's guide; ComfyUI's context_overlap
DEFAULT_MODE = CONTINUATION
DEFAULT_FUSE = "pyramid"


@dataclass(frozen=True)
class Window:
    """One window of a plan, on the clip's clock: pixel frames [start, start + frames), `start` a multiple of 17 so
    its latents are the clip's own (5 per 17 frames) and its audio the clip's own latents from round(start / 24 * 40)."""

    start: int
    frames: int     # 17n + 5
    guide: int      # continuation: leading frames given clean (the previous window's or the source's tail), else 0
    prompt: int     # index into RenderSpec.prompts

    @property
    def end(self) -> int:
        return self.start + self.frames

    @property
    def latent_start(self) -> int:
        return self.start // FRAME_CLIP * LATENTS_PER_CLIP

    @property
    def latent_frames(self) -> int:
        return video_latent_frames(self.frames)

    @property
    def audio_start(self) -> int:
        return audio_latent_count(self.start)

    @property
    def audio_latents(self) -> int:
        return audio_latent_count(self.end) - self.audio_start

    @property
    def guide_latents(self) -> int:
        return video_latent_frames(self.guide) if self.guide else 0

    @property
    def guide_audio(self) -> int:
        return audio_latent_count(self.start + self.guide) - self.audio_start if self.guide else 0


@dataclass(frozen=True)
class WindowPlan:
    """How a render is sampled: one window (today's render), continuation windows (each conditioned on the
    previous one's clean tail) or fused windows (overlapping windows averaged at every step)."""

    mode: str                      # SINGLE | FUSED | CONTINUATION
    window_frames: int
    overlap: int
    fuse: str                      # fused windows' weights ("" otherwise)
    picked: bool                   # chosen by the product (no window field was set)
    windows: tuple[Window, ...]
    span_start: int                # the first frame the DiT returns latents for (RenderSpec.span_start)

    def describe(self) -> str:
        """One line for progress messages, Status and the job's record."""
        how = " (picked)" if self.picked else ""
        if self.mode == SINGLE:
            return f"one window of {self.window_frames} frames{how}"
        w = self.windows
        fuse = f", {self.fuse} weights" if self.mode == FUSED else ""
        return (f"{self.mode}: {len(w)} window{'s' if len(w) > 1 else ''} of {self.window_frames} frames, overlap "
                f"{self.overlap}{fuse}{how}")


def _check_frames_of(name: str, v: int, lo: int, hi: int) -> None:
    if v and (v < lo or v > hi or (v - FRAME_OFFSET) % FRAME_CLIP):
        raise InvalidArgument(f"{name}={v} is not valid: use 17n+5 frames from {lo} to {hi} (0 = the product's pick)")


def _prompt_starts(spec: RenderSpec) -> list[float]:
    """Each prompt's start second on the clip's clock (the first at the start of what is sampled)."""
    first = spec.prefix_frames / FPS
    if spec.prompt_starts:
        return [first, *spec.prompt_starts]
    n = len(spec.prompts)
    return [first + i * (spec.frames - spec.prefix_frames) / FPS / n for i in range(n)]


def _check_prompts(spec: RenderSpec) -> None:
    if len(spec.prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"{len(spec.prompts)} prompts; a render takes at most {MAX_PROMPTS}")
    for i, p in enumerate(spec.more_prompts):
        if not p.strip():
            raise InvalidArgument(f"prompt {i + 2} is empty; every prompt describes its part of the video")
        if len(p.encode()) > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"prompt {i + 2} is {len(p.encode())} bytes; at most {MAX_PROMPT_BYTES}")
    if spec.prompt_starts:
        if len(spec.prompt_starts) != len(spec.more_prompts):
            raise InvalidArgument(f"{len(spec.prompt_starts)} prompt start times for {len(spec.more_prompts)} later "
                                  "prompts: give one start second per prompt after the first, or none (spread evenly)")
        starts = _prompt_starts(spec)
        end = spec.frames / FPS
        if any(not math.isfinite(t) for t in starts) or any(b <= a for a, b in zip(starts, starts[1:])) \
                or starts[-1] >= end:
            raise InvalidArgument(f"prompt start times {list(spec.prompt_starts)} must rise strictly after "
                                  f"{starts[0]:g} s and stay below the clip's end ({end:.2f} s)")


def plan_windows(spec: RenderSpec) -> WindowPlan:
    """The windows a render is sampled in (docs/long_video.md); InvalidArgument naming the field for a window
    setting, prompt list or extension that cannot be planned.

    Unset fields are the product's pick: a clip up to MAX_WINDOW_FRAMES with one prompt (and no window field set) is
    one window, the render of today; a longer one, one with several prompts, or an extension takes DEFAULT_MODE
    windows of DEFAULT_WINDOW_FRAMES. Windows
    start on 17-frame clip boundaries, so their video latents (5 per clip) and audio latents (round(frame / 24 * 40))
    are the clip's own and sound and picture stay in step.

    Continuation: window k + 1 starts `overlap` frames before window k ends and is conditioned on window k's clean
    latents of those frames (its `guide`); an extension's first window on the source's last `overlap` frames.
    Fused: windows `window - overlap` frames apart (the last one ending at the clip's end) sample the same latents,
    their velocities averaged at every step. A window takes the prompt in effect at the middle of the frames it adds
    (its frames past its guide)."""
    _check_prompts(spec)
    f, prefix = spec.frames, spec.prefix_frames
    if spec.window_mode and spec.window_mode not in WINDOW_MODES:
        raise InvalidArgument(f"window_mode {spec.window_mode!r} is not valid: use {' or '.join(WINDOW_MODES)} "
                              "('' = the product's pick)")
    if spec.window_fuse and spec.window_fuse not in WINDOW_FUSES:
        raise InvalidArgument(f"window_fuse {spec.window_fuse!r} is not valid: use one of {', '.join(WINDOW_FUSES)}")
    _check_frames_of("window_frames", spec.window_frames, MIN_WINDOW_FRAMES, MAX_WINDOW_FRAMES)
    mode = spec.window_mode or DEFAULT_MODE
    if spec.window_fuse and mode != FUSED:
        raise InvalidArgument("window_fuse applies to fused windows: set window_mode='fused' too, or leave it out")
    picked = not (spec.window_frames or spec.window_overlap or spec.window_mode)
    window = spec.window_frames or DEFAULT_WINDOW_FRAMES
    overlap = spec.window_overlap or DEFAULT_OVERLAP[mode]
    _check_frames_of("window_overlap", spec.window_overlap, FRAME_OFFSET, window - FRAME_CLIP)
    if overlap > window - FRAME_CLIP:
        raise InvalidArgument(f"a window of {window} frames leaves no new frames beside an overlap of {overlap}: "
                              f"use a window of at least {overlap + FRAME_CLIP} frames")
    if prefix:
        if mode != CONTINUATION:
            raise InvalidArgument("an extension continues its source: it takes continuation windows, not "
                                  f"window_mode={spec.window_mode!r}")
        _check_frames_of("prefix_frames", prefix, max(MIN_FRAMES, overlap), f - FRAME_CLIP)
        if not overlap <= prefix <= f - FRAME_CLIP:
            raise InvalidArgument(f"an extension of a {prefix}-frame clip to {f} frames needs a source of at least "
                                  f"{overlap} frames (its guide) and at least {FRAME_CLIP} new frames")
    if not prefix and f <= (MAX_WINDOW_FRAMES if picked and not spec.more_prompts else window):
        windows = (Window(0, f, 0, 0),)
        plan = WindowPlan(SINGLE, f, 0, "", picked, windows, 0)
    elif mode == CONTINUATION:
        out, start, guide = [], prefix - overlap if prefix else 0, overlap if prefix else 0
        while True:
            end = min(f, start + window)
            out.append((start, end - start, guide))
            if end == f:
                break
            start, guide = end - overlap, overlap
        plan = WindowPlan(CONTINUATION, window, overlap, "", picked, _with_prompts(spec, out), spec.span_start)
    else:
        starts = list(range(0, f - window, window - overlap))
        out = [(s, window, 0) for s in starts] + [(f - window, window, 0)]
        plan = WindowPlan(FUSED, window, overlap, spec.window_fuse or DEFAULT_FUSE, picked, _with_prompts(spec, out), 0)
    used = {w.prompt for w in plan.windows}
    if len(used) < len(spec.prompts):
        unused = min(set(range(len(spec.prompts))) - used)
        raise InvalidArgument(f"prompt {unused + 1} of {len(spec.prompts)} is used by no window: {plan.describe()}; "
                              "a window takes the prompt in effect at the middle of the frames it adds: give fewer "
                              "prompts, other start times or smaller windows")
    return plan


def _with_prompts(spec: RenderSpec, windows: list[tuple[int, int, int]]) -> tuple[Window, ...]:
    starts = _prompt_starts(spec)
    out = []
    for start, frames, guide in windows:
        middle = (start + guide + start + frames) / 2 / FPS
        out.append(Window(start, frames, guide, max(i for i, t in enumerate(starts) if t <= middle or i == 0)))
    return tuple(out)
