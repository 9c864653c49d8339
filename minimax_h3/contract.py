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
"""

from __future__ import annotations

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
# "exact": every DiT block at every step (the same bits as ever); "fast": step caching (First Block Cache,
# minimax_h3/dit/step_cache.py) skips most blocks on steps whose first block changed little since the last full one.
QUALITIES = ("exact", "fast")
# ComfyUI's BlockSparseAttention node (docs/workflows.md): the methods this product runs, and its widgets' bounds.
SPARSE_METHODS = ("vsa",)
MIN_KEEP_PERCENT, MAX_KEEP_PERCENT = 0.5, 95.0
MAX_MIN_TOKENS = 1 << 20
DEFAULT_STEPS = 8          # model calls in the stock ComfyUI template (res_multistep + simple)
DEFAULT_SIZE = (832, 480)
DEFAULT_FRAMES = 124
DEFAULT_CRF = 18           # H.264 quality when a request says 0
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
    """T = 5n + 2 latent frames for F = 17n + 5 pixel frames; InvalidArgument for any other count."""
    if frames < FRAME_OFFSET or frames % FRAME_CLIP != FRAME_OFFSET:
        raise InvalidArgument(
            f"frames must be of the form 17*n + 5 (e.g. 124, 141, 362), got {frames}; snap_frames({frames}) = "
            f"{snap_frames(frames)}"
        )
    return (frames - FRAME_OFFSET) // FRAME_CLIP * LATENTS_PER_CLIP + LATENT_FRAME_OFFSET


def audio_latent_count(frames: int) -> int:
    """Ta = round(F / 24 * 40) audio latents per channel (never a .5 tie for F = 17n + 5)."""
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
    sparse: SparseAttention | None = None  # None: dense attention

    @property
    def latent_frames(self) -> int:
        """T = 5n + 2 video latent frames (the spec must hold 17n + 5 frames)."""
        return video_latent_frames(self.frames)

    @property
    def latent_size(self) -> tuple[int, int]:
        """(H/16, W/16): the latent height and width of the canvas."""
        return latent_side(self.height), latent_side(self.width)

    @property
    def audio_latents(self) -> int:
        """Ta = round(F / 24 * 40) audio latents per channel."""
        return audio_latent_count(self.frames)


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
    if f < MIN_FRAMES or f > MAX_FRAMES or (f - FRAME_OFFSET) % FRAME_CLIP:
        lo, hi = nearest_valid_frames(min(max(f, MIN_FRAMES), MAX_FRAMES))
        near = f"{lo} or {hi}" if lo != hi and hi <= MAX_FRAMES else str(lo)
        raise InvalidArgument(
            f"frames={f} is not valid: frame counts must be 17n+5 between {MIN_FRAMES} and {MAX_FRAMES} "
            f"(nearest valid: {near}; 124 = 5.2 s at 24 fps)")
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
    for name, v in (("video_shift", spec.video_shift), ("audio_shift", spec.audio_shift)):
        if not (v == 0 or 0.1 <= v <= 100):
            raise InvalidArgument(f"{name}={v} is not valid: use 0 (model default) or 0.1..100")
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


def keyframe_tensor(anchor: str) -> str:
    """Wire name of the fl2va keyframe latent at `anchor` ("first" | "last")."""
    return f"keyframe_{anchor}"


def ref_tensor(index: int, part: str) -> str:
    """Wire name of ref2va reference `index`'s (0-based, request order) `part` ("image" | "video" | "audio")."""
    return f"{REF_PREFIX}{index}_{part}"


KEYFRAME_TENSORS = MappingProxyType({a: keyframe_tensor(a) for a in KEYFRAME_ANCHORS})
REF_TENSOR_NAMES = tuple(ref_tensor(i, p) for i in range(MAX_REFERENCES) for p in REFERENCE_KINDS)

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
    *(TensorRule(keyframe_tensor(a), "float", _keyframe_shape,
                 f"[24, 1, H/16, W/16] normalised VAE latent of the {a} frame (fl2va)") for a in KEYFRAME_ANCHORS),
    *(r for i in range(MAX_REFERENCES) for r in (
        TensorRule(ref_tensor(i, "image"), "float", lambda s, g, d: (g.video_channels, 1, None, None),
                   "[24, 1, h, w] latent of an image reference at its own size (ref2va)"),
        TensorRule(ref_tensor(i, "video"), "float", lambda s, g, d: (g.video_channels, None, None, None),
                   "[24, T, h, w] latents of a video reference on its own canvas (ref2va)"),
        TensorRule(ref_tensor(i, "audio"), "float", lambda s, g, d: (AUDIO_CHANNELS, g.audio_channels, None),
                   "[2, 32, Ta] audio latents of a reference's sound (ref2va)"))),
]
TENSORS: Mapping[str, TensorRule] = MappingProxyType({r.name: r for r in _RULES})
SAMPLE_INPUTS = (TEXT_STATES, TEXT_TAGS, *KEYFRAME_TENSORS.values(), *REF_TENSOR_NAMES)  # what the DiT takes
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
# The render stages each mode walks, in order (`keyframes`: the decoder's VAE encoders, for keyframes or references).
RENDER_PLANS: dict[str, tuple[str, ...]] = {
    T2VA: ("encoder", "dit", "decoder"),
    FL2VA: ("keyframes", "encoder", "dit", "decoder"),
    REF2VA: ("keyframes", "encoder", "dit", "decoder"),
}


def render_mode(keyframes: bool, references: bool) -> str:
    """The mode (key of RENDER_PLANS) of a request: ref2va with references, fl2va with first/last keyframes, else
    t2va."""
    return REF2VA if references else FL2VA if keyframes else T2VA


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
