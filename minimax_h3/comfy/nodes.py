"""The ComfyUI nodes this product runs, one table entry each, and the interpreter that turns a graph into a render.

A graph is run from its one saving node (`SaveVideo`, or `SaveImage` for an image graph) back through what it needs,
as ComfyUI's executor does: inputs are pulled lazily, so the branch a switch does not take is never looked at. Each
node type is an entry of `NODES`: the widget names of its unnamed values, and a handler that computes its outputs
from its inputs. Scalars (`Val`) carry where they were written or computed, so a refusal names the node and the
`--set NODE.WIDGET=VALUE` that changes it. Models, encoders, latents and samples are symbolic values; the saving
node's handler checks that what reaches it is one render this product runs (`WorkflowRender`).

A node the product does not run is refused naming its id, its type and why: an unknown type anywhere in the graph
(it might be an output node of its own), a known one with a reason (`REFUSED`) where the run reaches it, a value a
handler cannot honour (a file this product does not load, a setting it has no equivalent for). All refusals of a
graph are collected, so one answer lists everything to change.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from minimax_h3.comfy.expr import ExpressionError, evaluate
from minimax_h3.comfy.graph import Graph, GraphError, Link, Literal, Node
from minimax_h3.contract import FPS, IMAGE_FRAMES, RenderSpec, SparseAttention, check_sparse, needed_partition
from minimax_h3.files import MODEL_FILES
from stagekit.errors import InvalidArgument

UNKNOWN = ("not a node this product runs (it runs the MiniMax-H3 nodes of ComfyUI's local templates; "
           "docs/workflows.md lists them)")


# ---- values ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Val:
    """A scalar and where it comes from: `where` for messages, `key` the `--set` key of a widget's own value."""

    value: Any
    where: str
    key: str = ""

    def hint(self, value: str = "...") -> str:
        """How to change it: ` (--set KEY=VALUE)` for a widget's own value, else nothing."""
        return f" (--set {self.key}={value})" if self.key else ""


@dataclass(frozen=True)
class FileUse:
    """A file a loader node names."""

    name: Val
    node: str           # the loader node's id
    type: str           # ... and its type
    role: str           # dit | text_encoder | video_vae | audio_vae | lora


@dataclass(frozen=True)
class Model:
    unet: FileUse
    loras: tuple[tuple[FileUse, Val], ...] = ()
    shift: tuple[Val, Val] | None = None     # (video, audio) from MiniMaxH3SigmaShift
    attention: str = ""                     # ModelAttentionBackend's choice
    sparse: SparseAttention | None = None    # BlockSparseAttention's VSA


@dataclass(frozen=True)
class Clip:
    file: FileUse


@dataclass(frozen=True)
class Vae:
    file: FileUse

    @property
    def kind(self) -> str:
        return "audio" if self.file.role == "audio_vae" else "video"


@dataclass(frozen=True)
class MediaRef:
    """A file a loader node reads from ComfyUI's input folder: an image, a video (with its sound) or a sound."""

    kind: str           # image | video | audio
    name: Val
    node: str           # the LoadImage / LoadVideo / LoadAudio node


@dataclass(frozen=True)
class ScaledImage:
    image: MediaRef
    width: int
    height: int
    node: str


@dataclass(frozen=True)
class VideoPart:
    """GetVideoComponents' frames or sound of a video file."""

    video: MediaRef
    part: str           # images | audio


@dataclass(frozen=True)
class GuideUse:
    """A MiniMaxH3AddGuide node's guide: an image and / or a sound anchored at `frame` (negative: from the end)."""

    node: str
    frame: Val
    latent: str         # the node whose latent it anchors in
    image: MediaRef | None = None
    audio: MediaRef | None = None


@dataclass(frozen=True)
class Cond:
    node: str
    kind: str           # text | image_to_video | reference_to_video
    prompt: Val
    clip: Clip
    first_frame: MediaRef | None = None
    last_frame: MediaRef | None = None
    references: tuple[MediaRef, ...] = ()
    vae: Vae | None = None
    audio_vae: Vae | None = None
    guides: tuple[GuideUse, ...] = ()
    ref_image_size: Val | None = None  # MiniMaxH3ReferenceToVideo's: "match" | "max"


@dataclass(frozen=True)
class Latent:
    node: str
    width: Val
    height: Val
    length: Val
    image: bool = False  # EmptyLatentImage: one frame


@dataclass(frozen=True)
class Noise:
    seed: Val


@dataclass(frozen=True)
class SamplerChoice:
    name: Val


@dataclass(frozen=True)
class Sigmas:
    node: str
    model: Model
    scheduler: Val
    steps: Val


@dataclass(frozen=True)
class Guider:
    node: str
    model: Model
    cond: Cond


@dataclass(frozen=True)
class Sampled:
    node: str
    seed: Val
    guider: Guider
    sampler: Val
    sigmas: Sigmas
    latent: Latent
    part: str = "av"    # av (packed video + audio) | video | audio | denoised


@dataclass(frozen=True)
class Frames:
    node: str
    sampled: Sampled
    vae: Vae


@dataclass(frozen=True)
class Sound:
    node: str
    sampled: Sampled
    vae: Vae


@dataclass(frozen=True)
class VideoOut:
    node: str
    frames: Frames
    sound: Sound | None


class _Stopped:
    """What a node that could not compute stands for: its consumers stop without a refusal of their own (the node's
    own refusal says why)."""


STOPPED = _Stopped()


@dataclass(frozen=True)
class Mask:
    """LoadImage's MASK output: no node this product runs takes one."""

    node: str


@dataclass(frozen=True)
class Refusal:
    node: str           # "" for the graph as a whole
    type: str
    why: str

    def __str__(self) -> str:
        return f"{self.type} node {self.node}: {self.why}" if self.node else self.why


class WorkflowRefused(InvalidArgument):
    """A graph this product does not run as written; `refusals` lists every node and why (and the message, one per
    line)."""

    def __init__(self, refusals: list[Refusal]):
        self.refusals = refusals
        lines = "\n  ".join(str(r) for r in refusals)
        super().__init__(f"this graph cannot run here as written ({len(refusals)} "
                         f"{'reason' if len(refusals) == 1 else 'reasons'}):\n  {lines}")


# ---- what a graph becomes ---------------------------------------------------------------------------------------
@dataclass
class WorkflowRender:
    """The render a graph stands for, each value with where it came from."""

    output: str                      # "mp4" | "png"
    save_node: str                   # the node that saves it (ComfyUI's history names its outputs by it)
    filename_prefix: str
    conditioning: str                # text | image_to_video | reference_to_video (the node that encodes the prompt)
    prompt: Val
    seed: Val
    width: Val
    height: Val
    frames: Val
    steps: Val
    sampler: Val
    scheduler: Val
    video_shift: Val | None = None
    audio_shift: Val | None = None
    sparse: SparseAttention | None = None  # BlockSparseAttention's VSA
    ref_image_size: Val | None = None      # MiniMaxH3ReferenceToVideo's image reference sizing
    loras: list[tuple[Val, Val]] = field(default_factory=list)
    first_frame: MediaRef | None = None
    last_frame: MediaRef | None = None
    references: list[MediaRef] = field(default_factory=list)
    guides: list[GuideUse] = field(default_factory=list)
    files: list[FileUse] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def spec(self) -> RenderSpec:
        """The render spec (not validated: `check_spec` attributes what is wrong to the graph)."""
        shift = (lambda v: float(v.value) if v is not None else 0.0)
        return RenderSpec(prompt=self.prompt.value, width=self.width.value, height=self.height.value,
                          frames=self.frames.value, steps=self.steps.value, seed=self.seed.value,
                          sampler=self.sampler.value, scheduler=self.scheduler.value,
                          video_shift=shift(self.video_shift), audio_shift=shift(self.audio_shift),
                          sparse=self.sparse,
                          ref_image_size=self.ref_image_size.value if self.ref_image_size is not None else "")

    def media(self) -> list[tuple[str, MediaRef]]:
        """(slot, file) of every file the render reads: first_frame, last_frame, reference i, guide i image / audio."""
        out = [(a, r) for a, r in (("first_frame", self.first_frame), ("last_frame", self.last_frame)) if r]
        out += [(f"reference {i + 1}", r) for i, r in enumerate(self.references)]
        return out + [(f"guide {i + 1} {part}", r) for i, g in enumerate(self.guides)
                      for part, r in (("image", g.image), ("audio", g.audio)) if r]

    def summary(self) -> dict:
        """The request as plain values (what the CLI's --explain prints and the tests compare)."""
        def val(v):
            return None if v is None else v.value
        return {
            "output": self.output, "save_node": self.save_node, "conditioning": self.conditioning,
            "prompt": self.prompt.value, "seed": self.seed.value, "width": self.width.value,
            "height": self.height.value, "frames": self.frames.value, "steps": self.steps.value,
            "sampler": self.sampler.value, "scheduler": self.scheduler.value,
            "video_shift": val(self.video_shift), "audio_shift": val(self.audio_shift),
            "sparse_attention": None if self.sparse is None else dataclasses.asdict(self.sparse),
            "ref_image_size": val(self.ref_image_size),
            "loras": [[n.value, s.value] for n, s in self.loras],
            "first_frame": self.first_frame and self.first_frame.name.value,
            "last_frame": self.last_frame and self.last_frame.name.value,
            "references": [[r.kind, r.name.value] for r in self.references],
            "guides": [[g.frame.value, g.image and g.image.name.value, g.audio and g.audio.name.value]
                       for g in self.guides],
            "files": {f.role: f.name.value for f in self.files if f.role != "lora"},
            "notes": list(self.notes),
        }

    def where(self, field_name: str) -> Val | None:
        return getattr(self, field_name, None)


# A refusal of the render spec (contract.validate's message) and the fields it is about.
_SPEC_FIELDS = (("frames=", ("frames",)), ("width=", ("width",)), ("height=", ("height",)), ("steps=", ("steps",)),
                ("seed=", ("seed",)), ("unknown sampler", ("sampler",)), ("unknown scheduler", ("scheduler",)),
                ("video_shift=", ("video_shift",)), ("audio_shift=", ("audio_shift",)), ("prompt", ("prompt",)),
                ("aspect ratio", ("width", "height")), ("", ("width", "height")))


def attribute(message: str, render: WorkflowRender, overridden: set[str]) -> str:
    """`message` (a render-spec refusal) with the graph values it is about named: where each came from and the
    `--set` that changes it. Values a flag gave (`overridden`) are the flag's."""
    fields = next(f for prefix, f in _SPEC_FIELDS if message.startswith(prefix))
    parts = []
    for name in fields:
        v = render.where(name)
        if name in overridden or v is None:
            continue
        parts.append(f"{name} from {v.where}{v.hint()}")
    return message + (f" [{'; '.join(parts)}]" if parts else "")


# ---- the interpreter --------------------------------------------------------------------------------------------
SizeOf = Callable[[MediaRef], tuple[int, int]]


class _Stop(InvalidArgument):
    """A node cannot compute its outputs (refused already, or an input it needs is missing or refused): the graph's
    fault, whose refusal the interpreter has recorded."""

    def __init__(self):
        super().__init__("a node of the graph cannot compute its outputs")


class Interpreter:
    def __init__(self, graph: Graph, size_of: SizeOf | None = None):
        self.graph = graph
        self.size_of = size_of
        self.refusals: list[Refusal] = []
        self.cache: dict[str, tuple] = {}
        self.running: list[str] = []
        self.notes: list[str] = []

    # -- refusals
    def refuse(self, node: Node | None, why: str) -> None:
        r = Refusal(node.id if node else "", node.type if node else "", why)
        if r not in self.refusals:
            self.refusals.append(r)

    def stop(self, node: Node, why: str) -> _Stop:
        self.refuse(node, why)
        return _Stop()

    # -- evaluation
    def outputs(self, node_id: str) -> tuple:
        if node_id in self.cache:
            return self.cache[node_id]
        if node_id in self.running:
            raise GraphError(f"the graph loops through node {node_id}")
        node = self.graph.node(node_id)
        self.running.append(node_id)
        try:
            kind = NODES.get(node.type)
            if kind is None:
                reason = refusal_reason(node.type)
                self.refuse(node, reason)
                out = (STOPPED,) * 8
            else:
                self._name_positional(node, kind)
                try:
                    out = kind.handler(self, node)
                except _Stop:
                    out = (STOPPED,) * 8
        finally:
            self.running.pop()
        self.cache[node_id] = out
        return out

    def _name_positional(self, node: Node, kind: "NodeKind") -> None:
        if node.positional is None:
            return
        layout = next((ly for ly in kind.widgets if len(ly) == len(node.positional)), None)
        if layout is None:
            raise self.stop(node, f"its {len(node.positional)} widget values do not match its widgets "
                                  f"({' / '.join(', '.join(ly) for ly in kind.widgets) or 'none'}); save the graph "
                                  "again with a current ComfyUI")
        for name, value in zip(layout, node.positional):
            node.inputs.setdefault(name, Literal(value, f"{node.id}.{name}"))
        node.positional = None

    def raw(self, node: Node, name: str):
        """Input `name`'s value, or None when nothing feeds it (a refused source raises _Stop)."""
        v = node.inputs.get(name)
        if v is None:
            return None
        if isinstance(v, Literal):
            return Val(v.value, f"widget {v.origin}", v.origin)
        assert isinstance(v, Link)
        outs = self.outputs(v.node)
        if v.slot >= len(outs):
            raise self.stop(node, f"its input {name} names output {v.slot} of node {v.node}, which has no such output")
        value = outs[v.slot]
        if value is STOPPED:
            raise _Stop()
        return value

    def get(self, node: Node, name: str, want: type | tuple = object, default: Any = None, optional=False):
        """Input `name` as a `want` (a Val's value type for scalars); its default when given and nothing feeds it."""
        v = self.raw(node, name)
        if v is None:
            if default is not None:
                return Val(default, f"{node.label()}'s default {name}")
            if optional:
                return None
            raise self.stop(node, f"its input {name} is not connected")
        if want is object:
            return v
        scalar = want in (int, float, str, bool) or isinstance(want, tuple) and all(
            w in (int, float, str, bool) for w in want)
        if scalar:
            if not isinstance(v, Val):
                raise self.stop(node, f"its input {name} gets a {type(v).__name__}, not a value")
            if not _is(v.value, want):
                raise self.stop(node, f"{name}={v.value!r} ({v.where}) is not a {_type_words(want)}")
            return v
        if not isinstance(v, want):
            raise self.stop(node, f"its input {name} gets a {_value_words(v)}, not a {_type_words(want)}")
        return v

    def computed(self, node: Node, value: Any, name: str = "") -> Val:
        return Val(value, f"{node.label()}" + (f" ({name})" if name else ""))

    # -- files
    def file(self, node: Node, name: str, role: str) -> FileUse:
        """The file a loader's widget `name` names, for `role`; refused when the catalog says this product does not
        load it or it is another kind of file."""
        v = self.get(node, name, str)
        use = FileUse(v, node.id, node.type, role)
        known = MODEL_FILES.get(v.value)
        if known is not None:
            if known.refusal:
                self.refuse(node, f"{v.value}: {known.refusal}{v.hint(known.instead or '...')}")
            elif role != "any" and known.role != role and not (role == "vae" and known.role.endswith("_vae")):
                self.refuse(node, f"{v.value} is a {known.role.replace('_', ' ')} file, not a {role.replace('_', ' ')}"
                                  f"{v.hint()}")
            return replace(use, role=known.role) if role in ("vae", "any") else use
        if role == "vae":
            return replace(use, role="audio_vae" if "audio" in v.value.lower() else "video_vae")
        return use


def _is(value, want) -> bool:
    kinds = want if isinstance(want, tuple) else (want,)
    for k in kinds:
        if k is bool and isinstance(value, bool):
            return True
        if k is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if k is str and isinstance(value, str):
            return True
    return False


def _type_words(want) -> str:
    kinds = want if isinstance(want, tuple) else (want,)
    return " or ".join(_WORDS.get(k, getattr(k, "__name__", str(k))) for k in kinds)


def _value_words(v) -> str:
    return f"value {v.value!r}" if isinstance(v, Val) else _WORDS.get(type(v), type(v).__name__)


_WORDS = {Model: "model (MODEL)", Clip: "text encoder (CLIP)", Vae: "VAE", MediaRef: "loaded file",
          ScaledImage: "scaled image", VideoPart: "video component", Cond: "conditioning", Latent: "latent",
          Noise: "noise", SamplerChoice: "sampler", Sigmas: "sigmas", Guider: "guider", Sampled: "sampled latent",
          Frames: "decoded frames (IMAGE)", Sound: "decoded sound (AUDIO)", VideoOut: "video", Mask: "mask (MASK)",
          int: "integer", float: "number", str: "text", bool: "boolean"}


# ---- the table --------------------------------------------------------------------------------------------------
Handler = Callable[[Interpreter, Node], tuple]


@dataclass(frozen=True)
class NodeKind:
    handler: Handler
    widgets: tuple[tuple[str, ...], ...] = ()   # names of unnamed widget values, one tuple per layout
    saves: bool = False                         # an output node: the render is what reaches it


NODES: dict[str, NodeKind] = {}


def node(type_name: str, *widgets: tuple[str, ...], saves: bool = False):
    def register(fn: Handler) -> Handler:
        NODES[type_name] = NodeKind(fn, widgets, saves)
        return fn
    return register


def widget_layouts(type_name: str) -> tuple[tuple[str, ...], ...]:
    """The widget names of a type's unnamed values (graph.parse_graph's `layouts`)."""
    kind = NODES.get(type_name)
    return kind.widgets if kind else ()


# Node types this product knows and does not run, and why (a type, or a prefix ending in "*"); where the run
# reaches one it is refused. A piece the product learns to run replaces its line here with a handler above.
REFUSED: dict[str, str] = {
    "MinimaxHailuo03*": "a MiniMax cloud API node: it renders on MiniMax's servers (an API key and credits), not "
                        "with the local model this product serves",
    "MiniMaxH3FunControlNetApply": "a pose ControlNet: this product does not run ControlNets",
    "ModelPatchLoader": "loads a model patch (a ControlNet): this product does not run them",
    "SDPose*": "pose extraction (SDPose): not part of this product",
    "RTDETR_detect": "person detection (RT-DETR): not part of this product",
    "MiniMaxH3ContextWindows": "context windows (long video in overlapping windows): this product renders one "
                               "window of up to 515 frames",
    "KSampler": "the one-node sampler (with CFG and a negative prompt): this product samples H3 as its templates "
                "do, with SamplerCustomAdvanced + BasicGuider",
    "CFGGuider": "classifier-free guidance with a negative prompt: this product samples H3 without CFG "
                 "(BasicGuider)",
}
# Known types a refused node passes its input on through, so the rest of the graph is still checked.
_PASS_THROUGH = {"MiniMaxH3ContextWindows": "model"}


def refusal_reason(type_name: str) -> str:
    for key, why in REFUSED.items():
        if key == type_name or key.endswith("*") and type_name.startswith(key[:-1]):
            return why
    return UNKNOWN


def _refused_node(ev: Interpreter, n: Node) -> tuple:
    ev.refuse(n, refusal_reason(n.type))
    through = _PASS_THROUGH.get(n.type)
    if through is None:
        raise _Stop()
    return (ev.get(n, through),)


# -- values and arithmetic
@node("PrimitiveInt", ("value", "control_after_generate"))
def _primitive_int(ev, n):
    return (ev.get(n, "value", int),)


@node("PrimitiveFloat", ("value",))
def _primitive_float(ev, n):
    return (ev.get(n, "value", float),)


@node("PrimitiveBoolean", ("value",))
def _primitive_bool(ev, n):
    return (ev.get(n, "value", bool),)


@node("PrimitiveString", ("value",))
@node("PrimitiveStringMultiline", ("value",))
def _primitive_string(ev, n):
    return (ev.get(n, "value", str),)


@node("ComfyMathExpression", ("expression",))
def _math(ev, n):
    """The formula over the node's values by their letters (`values.a` is `a`), evaluated by minimax_h3.comfy.expr;
    outputs FLOAT, INT (truncated) and BOOL (non-zero), as ComfyUI's node gives them."""
    expr = ev.get(n, "expression", str)
    values = {}
    for k in sorted(k for k in n.inputs if k.startswith("values.")):
        v = ev.get(n, k, (int, float, bool), optional=True)
        if v is not None:
            values[k.split(".", 1)[1]] = v.value
    try:
        result = evaluate(expr.value, values)
    except ExpressionError as e:
        raise ev.stop(n, e.message) from None
    where = f"{n.label()} ({expr.value.strip()})"
    return Val(float(result), where), Val(int(result), where), Val(result != 0, where)


@node("ComfySwitchNode", ("switch",))
def _switch(ev, n):
    on = ev.get(n, "switch", bool)
    return (ev.get(n, "on_true" if on.value else "on_false"),)


# ResolutionSelector's aspect ratios (ComfyUI core), w:h.
ASPECT_RATIOS = {"1:1 (Square)": (1, 1), "3:2 (Photo)": (3, 2), "4:3 (Standard)": (4, 3),
                 "16:9 (Widescreen)": (16, 9), "21:9 (Ultrawide)": (21, 9), "2:3 (Portrait Photo)": (2, 3),
                 "3:4 (Portrait Standard)": (3, 4), "9:16 (Portrait Widescreen)": (9, 16)}


@node("ResolutionSelector", ("aspect_ratio", "megapixels"), ("aspect_ratio", "megapixels", "multiple"),
      ("aspect_ratio", "megapixels", "multiple", "minimum"))
def _resolution(ev, n):
    """Width and height of an aspect ratio at a megapixel target (1 MP = 1024 x 1024), each rounded to the nearest
    `multiple`; below `minimum` on a side, the smallest exact-ratio size on the multiple grid above it."""
    aspect = ev.get(n, "aspect_ratio", str)
    if aspect.value not in ASPECT_RATIOS:
        raise ev.stop(n, f"aspect_ratio {aspect.value!r} is not one of ResolutionSelector's "
                         f"({', '.join(ASPECT_RATIOS)}){aspect.hint()}")
    w, h = ASPECT_RATIOS[aspect.value]
    mp = ev.get(n, "megapixels", float).value
    multiple = ev.get(n, "multiple", int, default=8).value
    minimum = ev.get(n, "minimum", int, default=256).value
    if mp <= 0 or multiple <= 0:
        raise ev.stop(n, f"megapixels {mp} and multiple {multiple} must be positive")
    scale = math.sqrt(mp * 1024 * 1024 / (w * h))
    width, height = round(w * scale / multiple) * multiple, round(h * scale / multiple) * multiple
    if width < minimum or height < minimum:
        step_w, step_h = multiple // math.gcd(w, multiple), multiple // math.gcd(h, multiple)
        k_step = step_w * step_h // math.gcd(step_w, step_h)
        k = math.ceil(math.ceil(max(minimum / w, minimum / h)) / k_step) * k_step
        width, height = w * k, h * k
    return ev.computed(n, width, "width"), ev.computed(n, height, "height")


# -- files the graph reads from ComfyUI's input folder
@node("LoadImage", ("image", "upload"))
def _load_image(ev, n):
    return MediaRef("image", ev.get(n, "image", str), n.id), Mask(n.id)


@node("LoadAudio", ("audio", "upload"))
def _load_audio(ev, n):
    return (MediaRef("audio", ev.get(n, "audio", str), n.id),)


@node("LoadVideo", ("file", "upload"))
def _load_video(ev, n):
    return (MediaRef("video", ev.get(n, "file", str), n.id),)


@node("GetVideoComponents")
def _video_components(ev, n):
    video = ev.get(n, "video", MediaRef)
    if video.kind != "video":
        raise ev.stop(n, "its video input is not a LoadVideo file")
    return VideoPart(video, "images"), VideoPart(video, "audio"), Val(float(FPS), n.label())


def _size(ev: Interpreter, n: Node, image) -> tuple[int, int]:
    if isinstance(image, ScaledImage):
        return image.width, image.height
    if ev.size_of is None:
        raise ev.stop(n, f"needs the size of {image.name.value} (LoadImage node {image.node}), which is not at hand")
    try:
        return ev.size_of(image)
    except InvalidArgument as e:
        raise ev.stop(n, f"needs the size of {image.name.value} (LoadImage node {image.node}): {e.message}") from None


@node("GetImageSize")
def _image_size(ev, n):
    image = ev.get(n, "image", (MediaRef, ScaledImage))
    if isinstance(image, MediaRef) and image.kind != "image":
        raise ev.stop(n, "its image input is not an image")
    w, h = _size(ev, n, image)
    return ev.computed(n, w, "width"), ev.computed(n, h, "height"), ev.computed(n, 1, "batch_size")


@node("ImageScaleToTotalPixels", ("upscale_method", "megapixels"), ("upscale_method", "megapixels", "resolution_steps"))
def _scale_to_pixels(ev, n):
    """The size ComfyUI scales the image to: its aspect at `megapixels` (1 MP = 1024 x 1024), each side rounded to
    the nearest `resolution_steps`. The scaled pixels themselves feed only GetImageSize here."""
    image = ev.get(n, "image", MediaRef)
    mp = ev.get(n, "megapixels", float).value
    steps = ev.get(n, "resolution_steps", int, default=1).value
    w, h = _size(ev, n, image)
    scale = math.sqrt(mp * 1024 * 1024 / (w * h))
    return (ScaledImage(image, round(w * scale / steps) * steps, round(h * scale / steps) * steps, n.id),)


# -- models
@node("UNETLoader", ("unet_name", "weight_dtype"))
def _unet(ev, n):
    use = ev.file(n, "unet_name", "dit")
    dtype = ev.get(n, "weight_dtype", str, default="default")
    if dtype.value != "default":
        ev.refuse(n, f"weight_dtype {dtype.value!r}: this product loads the DiT file's own weights (the stage's "
                     f"--linear-kernel picks how they compute), not a cast to another dtype{dtype.hint()}")
    return (Model(use),)


@node("LoraLoaderModelOnly", ("lora_name", "strength_model"))
def _lora(ev, n):
    model = ev.get(n, "model", Model)
    use = ev.file(n, "lora_name", "lora")
    strength = ev.get(n, "strength_model", float)
    return (replace(model, loras=model.loras + ((use, strength),)),)


@node("MiniMaxH3SigmaShift", ("shift_video", "shift_audio"))
def _sigma_shift(ev, n):
    model = ev.get(n, "model", Model)
    if model.sparse is not None:
        ev.refuse(n, "it comes after BlockSparseAttention, whose window ComfyUI computes from the shift in effect "
                     "where it runs: connect MiniMaxH3SigmaShift before BlockSparseAttention, as the FastH3 templates "
                     "do")
    return (replace(model, shift=(ev.get(n, "shift_video", float), ev.get(n, "shift_audio", float))),)


SPARSE_LAYOUT = ("selection", "selection.keep_percent", "start_percent", "end_percent", "dense_blocks", "min_tokens",
                 "extra_tokens", "sink_conditioning", "verbose")
SINK_CONDITIONING = "exact_kv_and_rows"  # the FastH3 templates' value: VSA keeps every non-video row exact anyway
_BLOCK_RANGE = re.compile(r"\d+\s*-\s*\d+|\d+")


def dense_block_list(text: str) -> tuple[int, ...]:
    """BlockSparseAttention's dense_blocks as ComfyUI reads it: numbers and ranges, anything else between them
    ignored ("0, 1, 47-49" -> 0, 1, 47, 48, 49)."""
    blocks = set()
    for part in _BLOCK_RANGE.findall(text):
        a, _, b = part.partition("-")
        lo, hi = sorted((int(a), int(b or a)))
        blocks.update(range(lo, hi + 1))
    return tuple(sorted(blocks))


@node("BlockSparseAttention", SPARSE_LAYOUT)
def _block_sparse(ev, n):
    """VSA for the FastH3 checkpoints (docs/kernels.md, "Block-sparse attention (VSA)"): method "vsa" only;
    extra_tokens and verbose have no effect on VSA (ComfyUI ignores extra_tokens for it too)."""
    model = ev.get(n, "model", Model)
    method = ev.get(n, "selection", str)
    if method.value != "vsa":
        ev.refuse(n, f"method {method.value!r}: this product runs 'vsa' (FastVideo's video sparse attention, what the "
                     f"FastH3 checkpoints are distilled for), not Sol-Attn or SLA{method.hint('vsa')}")
        return (model,)
    if model.sparse is not None:
        raise ev.stop(n, "the model already has BlockSparseAttention applied: keep one")
    sink = ev.get(n, "sink_conditioning", str, default=SINK_CONDITIONING)
    if sink.value != SINK_CONDITIONING:
        ev.refuse(n, f"sink_conditioning {sink.value!r}: this product's VSA keeps every text, keyframe, reference and "
                     f"audio row exact as a key and as a query, as the FastH3 templates' {SINK_CONDITIONING!r} asks "
                     f"(what another value does to ComfyUI's VSA is not documented){sink.hint(SINK_CONDITIONING)}")
    values = {name: ev.get(n, name, want, default=default) for name, want, default in (
        ("selection.keep_percent", (int, float), 10.0), ("start_percent", (int, float), 0.2),
        ("end_percent", (int, float), 1.0), ("dense_blocks", str, ""), ("min_tokens", int, 12288),
        ("extra_tokens", int, 256), ("verbose", bool, False))}
    sp = SparseAttention(keep_percent=float(values["selection.keep_percent"].value),
                         start_percent=float(values["start_percent"].value),
                         end_percent=float(values["end_percent"].value),
                         dense_blocks=dense_block_list(values["dense_blocks"].value),
                         min_tokens=values["min_tokens"].value)
    try:
        check_sparse(sp)
    except InvalidArgument as e:
        raise ev.stop(n, e.message) from None
    ev.notes.append(f"{n.label()} runs VSA from {sp.start_percent:.0%} to {sp.end_percent:.0%} of the schedule, "
                    f"keeping {sp.keep_percent:g} % of the video tiles (dense for sequences under {sp.min_tokens} rows"
                    + (f" and in blocks {list(sp.dense_blocks)}" if sp.dense_blocks else "") + "): the DiT computes "
                    "it with its VSA kernel (`python -m client status`); extra_tokens and verbose do nothing for VSA")
    return (replace(model, sparse=sp),)


ATTENTION_BACKENDS = ("comfy kitchen attention",)


@node("ModelAttentionBackend", ("attention",))
def _attention(ev, n):
    model = ev.get(n, "model", Model)
    choice = ev.get(n, "attention", str)
    if choice.value not in ATTENTION_BACKENDS:
        ev.refuse(n, f"attention {choice.value!r}: this product runs exact attention only (as "
                     f"{', '.join(ATTENTION_BACKENDS)} does){choice.hint()}")
    ev.notes.append(f"{n.label()} asks for {choice.value!r}: the DiT computes attention with the exact kernel it "
                    "chose at its start (`python -m client status` shows it)")
    return (replace(model, attention=choice.value),)


@node("CLIPLoader", ("clip_name", "type", "device"))
def _clip(ev, n):
    use = ev.file(n, "clip_name", "text_encoder")
    kind = ev.get(n, "type", str, default="minimax")
    if kind.value != "minimax":
        ev.refuse(n, f"type {kind.value!r}: MiniMax-H3's text encoder is CLIPLoader type 'minimax'{kind.hint()}")
    return (Clip(use),)


@node("VAELoader", ("vae_name",))
def _vae(ev, n):
    return (Vae(ev.file(n, "vae_name", "vae")),)


# -- conditioning and latents
_EMBEDDING = re.compile(r"embedding:\S+")


def _prompt(ev: Interpreter, n: Node, name: str) -> Val:
    prompt = ev.get(n, name, str)
    if m := _EMBEDDING.search(prompt.value):
        ev.refuse(n, f"the prompt ({prompt.where}) uses the prompt embedding {m.group(0)!r}: this product encodes "
                     "the prompt's text only")
    return prompt


def _vae_of(ev: Interpreter, n: Node, name: str, kind: str, optional=False) -> Vae | None:
    vae = ev.get(n, name, Vae, optional=optional)
    if vae is not None and vae.kind != kind:
        raise ev.stop(n, f"its {name} input gets the {vae.kind} VAE {vae.file.name.value}, not a {kind} VAE")
    return vae


@node("CLIPTextEncode", ("text",))
def _text_encode(ev, n):
    return (Cond(n.id, "text", _prompt(ev, n, "text"), ev.get(n, "clip", Clip)),)


def _image_input(ev: Interpreter, n: Node, name: str) -> MediaRef | None:
    image = ev.get(n, name, (MediaRef, ScaledImage), optional=True)
    if isinstance(image, ScaledImage):
        raise ev.stop(n, f"its {name} is a scaled image (ImageScaleToTotalPixels node {image.node}): this product "
                         "fits the image file to the render's size itself; connect the LoadImage node directly")
    if image is not None and image.kind != "image":
        raise ev.stop(n, f"its {name} input is not an image")
    return image


@node("MiniMaxH3ImageToVideo", ("prompt", "width", "height", "length"))
def _image_to_video(ev, n):
    first, last = _image_input(ev, n, "first_frame"), _image_input(ev, n, "last_frame")
    cond = Cond(n.id, "image_to_video", _prompt(ev, n, "prompt"), ev.get(n, "clip", Clip), first, last,
                vae=_vae_of(ev, n, "vae", "video"))
    latent = Latent(n.id, ev.get(n, "width", int), ev.get(n, "height", int), ev.get(n, "length", int))
    return cond, latent


REF_GROUPS = ("ref_images", "ref_videos", "ref_video_audios", "ref_audios")


def _group(n: Node, group: str) -> list[str]:
    """A reference group's inputs in order (`ref_images.ref_image_0`, `..._1`, ...)."""
    names = [k for k in n.inputs if k.startswith(group + ".")]
    return sorted(names, key=lambda k: int(re.sub(r"\D", "", k.rsplit("_", 1)[-1]) or 0))


@node("MiniMaxH3ReferenceToVideo", ("prompt", "width", "height", "length", "ref_image_size"))
def _reference_to_video(ev, n):
    """References in the node's order: images, then videos (each with its sound), then sounds; `ref_image_size` sizes
    the images as ComfyUI does ("match" or "max": minimax_h3.media.ImageFit)."""
    refs: list[MediaRef] = []
    for k in _group(n, "ref_images"):
        refs.append(_image_input(ev, n, k))
    videos = [ev.get(n, k, VideoPart) for k in _group(n, "ref_videos")]
    sounds = {int(re.sub(r"\D", "", k.rsplit("_", 1)[-1]) or 0): ev.get(n, k, VideoPart)
              for k in _group(n, "ref_video_audios")}
    for i, part in enumerate(videos):
        if part.part != "images":
            raise ev.stop(n, f"ref_videos {i}: connect GetVideoComponents' images output")
        sound = sounds.get(i)
        if sound is None or sound.video != part.video or sound.part != "audio":
            raise ev.stop(n, f"ref_video_audios {i}: this product conditions on a video reference together with its "
                             f"own soundtrack; connect the audio output of the GetVideoComponents that gives "
                             f"ref_videos {i}")
        refs.append(part.video)
    for k in _group(n, "ref_audios"):
        sound = ev.get(n, k, MediaRef)
        if sound.kind != "audio":
            raise ev.stop(n, f"its {k} input is not a LoadAudio sound")
        refs.append(sound)
    size = ev.get(n, "ref_image_size", str, default="match")
    if size.value not in ("match", "max"):
        ev.refuse(n, f"ref_image_size {size.value!r}: the node takes match or max{size.hint()}")
    cond = Cond(n.id, "reference_to_video", _prompt(ev, n, "prompt"), ev.get(n, "clip", Clip),
                references=tuple(refs), vae=_vae_of(ev, n, "vae", "video"),
                audio_vae=_vae_of(ev, n, "audio_vae", "audio", optional=True), ref_image_size=size)
    latent = Latent(n.id, ev.get(n, "width", int), ev.get(n, "height", int), ev.get(n, "length", int))
    return cond, latent


@node("MiniMaxH3AddGuide", ("frame_idx",))
def _add_guide(ev, n):
    """ComfyUI's guide (comfy_extras/nodes_minimax_h3.py): an image and / or a sound anchored at `frame_idx` of the
    video its latent makes (negative: counted from the end), added to the conditioning it passes on; no strength.
    A one-image guide here: a clip (an image batch of 17k + 5 frames) is refused."""
    cond = ev.get(n, "positive", Cond)
    latent = ev.get(n, "latent", Latent)
    frame = ev.get(n, "frame_idx", int)
    if latent.image:
        raise ev.stop(n, f"its latent is an image's (EmptyLatentImage node {latent.node}): a guide anchors a frame of "
                         "a video latent (MiniMaxH3ImageToVideo or MiniMaxH3ReferenceToVideo)")
    if isinstance(ev.raw(n, "image"), VideoPart):
        raise ev.stop(n, "its image is a video's frames (GetVideoComponents): this product anchors one image per "
                         "guide, not a clip; connect a LoadImage")
    image = _image_input(ev, n, "image")
    audio = ev.get(n, "audio", (MediaRef, VideoPart), optional=True)
    if isinstance(audio, VideoPart) or audio is not None and audio.kind != "audio":
        raise ev.stop(n, "its audio input is not a LoadAudio sound: connect a LoadAudio")
    if image is None and audio is None:
        raise ev.stop(n, "it anchors nothing: connect an image and / or an audio")
    for part, name, kind in ((image, "vae", "video"), (audio, "audio_vae", "audio")):
        if part is not None and _vae_of(ev, n, name, kind, optional=True) is None:
            raise ev.stop(n, f"it anchors {'an image' if kind == 'video' else 'a sound'} without its {name} input "
                             f"(the {kind} VAE that encodes it): connect the VAELoader")
    return (replace(cond, guides=cond.guides + (GuideUse(n.id, frame, latent.node, image, audio),)),)


@node("EmptyLatentImage", ("width", "height", "batch_size"))
def _empty_latent_image(ev, n):
    batch = ev.get(n, "batch_size", int, default=1)
    if batch.value != 1:
        ev.refuse(n, f"batch_size {batch.value}: this product renders one image per graph{batch.hint()}")
    return (Latent(n.id, ev.get(n, "width", int), ev.get(n, "height", int),
                   Val(IMAGE_FRAMES, f"{n.label()} (one image: one latent frame, no sound)"), image=True),)


# -- sampling
@node("RandomNoise", ("noise_seed", "control_after_generate"))
def _noise(ev, n):
    return (Noise(ev.get(n, "noise_seed", int)),)


@node("KSamplerSelect", ("sampler_name",))
def _sampler_select(ev, n):
    return (SamplerChoice(ev.get(n, "sampler_name", str)),)


@node("BasicScheduler", ("scheduler", "steps", "denoise"))
def _scheduler(ev, n):
    denoise = ev.get(n, "denoise", float, default=1.0)
    if denoise.value != 1:
        ev.refuse(n, f"denoise {denoise.value}: this product samples from pure noise (denoise 1){denoise.hint()}")
    return (Sigmas(n.id, ev.get(n, "model", Model), ev.get(n, "scheduler", str), ev.get(n, "steps", int)),)


@node("BasicGuider")
def _guider(ev, n):
    return (Guider(n.id, ev.get(n, "model", Model), ev.get(n, "conditioning", Cond)),)


@node("SamplerCustomAdvanced")
def _sample(ev, n):
    s = Sampled(n.id, ev.get(n, "noise", Noise).seed, ev.get(n, "guider", Guider),
                ev.get(n, "sampler", SamplerChoice).name, ev.get(n, "sigmas", Sigmas), ev.get(n, "latent_image", Latent))
    return s, replace(s, part="denoised")


@node("LTXVSeparateAVLatent")
def _separate(ev, n):
    s = ev.get(n, "av_latent", Sampled)
    if s.part != "av":
        raise ev.stop(n, "its av_latent input is not a sampler's output")
    return replace(s, part="video"), replace(s, part="audio")


def _samples(ev: Interpreter, n: Node, part: str) -> Sampled:
    s = ev.get(n, "samples", Sampled)
    if s.part == "denoised":
        raise ev.stop(n, f"it decodes SamplerCustomAdvanced node {s.node}'s denoised_output: this product decodes "
                         "the sampler's output")
    if s.part not in ("av", part):
        raise ev.stop(n, f"it decodes the {s.part} half of the sampled latent")
    return s


@node("VAEDecode")
def _decode(ev, n):
    return (Frames(n.id, _samples(ev, n, "video"), _vae_of(ev, n, "vae", "video")),)


@node("VAEDecodeAudio")
def _decode_audio(ev, n):
    return (Sound(n.id, _samples(ev, n, "audio"), _vae_of(ev, n, "vae", "audio")),)


@node("CreateVideo", ("fps",), ("fps", "bit_depth"), ("fps", "bit_depth", "color_space"),
      ("fps", "bit_depth", "color_space", "codec"))
def _create_video(ev, n):
    frames = ev.get(n, "images", Frames)
    sound = ev.get(n, "audio", Sound, optional=True)
    fps = ev.get(n, "fps", (int, float))
    if fps.value != FPS:
        ev.refuse(n, f"fps {fps.value}: MiniMax-H3 renders {FPS} frames per second{fps.hint()}")
    for name, ok in (("bit_depth", (8, "8", "auto")), ("color_space", ("sRGB", "auto")), ("codec", ("none", "auto"))):
        v = ev.get(n, name, (int, str), optional=True)
        if v is not None and v.value not in ok:
            ev.refuse(n, f"{name} {v.value!r}: this product writes 8-bit sRGB H.264{v.hint()}")
    return (VideoOut(n.id, frames, sound),)


# -- the saving nodes: the render itself
@node("SaveVideo", ("filename_prefix", "format", "codec"), ("filename_prefix", "format", "format.codec", "codec"),
      saves=True)
def _save_video(ev, n):
    video = ev.get(n, "video", VideoOut)
    for name in ("format", "format.codec", "codec"):
        v = ev.get(n, name, str, optional=True)
        if v is not None and v.value not in ("auto", "mp4", "h264"):
            ev.refuse(n, f"{name} {v.value!r}: this product writes MP4 (H.264 + AAC){v.hint()}")
    if video.sound is None:
        ev.refuse(ev.graph.node(video.node), "it has no audio input: this product's MP4 carries the sound rendered "
                                             "with the video; connect VAEDecodeAudio")
    elif video.sound.sampled.node != video.frames.sampled.node:
        raise ev.stop(n, "its frames and its sound come from two samplers: this product renders them together")
    return (_render(ev, n, "mp4", video.frames, video.sound),)


@node("SaveImage", ("filename_prefix",), saves=True)
def _save_image(ev, n):
    return (_render(ev, n, "png", ev.get(n, "images", Frames), None),)


def _render(ev: Interpreter, n: Node, output: str, frames: Frames, sound: Sound | None) -> WorkflowRender:
    """The one render that reaches a saving node, checked for what this product runs."""
    s = frames.sampled
    g, sig, lat, cond = s.guider, s.sigmas, s.latent, s.guider.cond
    sampler_node = ev.graph.node(s.node)
    if sig.model != g.model:
        ev.refuse(sampler_node, f"its scheduler's model (BasicScheduler node {sig.node}) is not its guider's "
                                f"(BasicGuider node {g.node}): this product samples with one model")
    if cond.kind == "text":
        if not lat.image:
            ev.refuse(sampler_node, "it samples a video latent with a text-only conditioning: video graphs encode the "
                                    "prompt with MiniMaxH3ImageToVideo or MiniMaxH3ReferenceToVideo")
    elif lat.node != cond.node:
        ev.refuse(sampler_node, f"its latent (node {lat.node}) and its conditioning (node {cond.node}) come from two "
                                "nodes: the MiniMax-H3 node that encodes the prompt also makes the latent")
    for guide in cond.guides:
        if guide.latent != lat.node:
            ev.refuse(ev.graph.node(guide.node), f"its latent (node {guide.latent}) is not the one sampled "
                                                 f"(node {lat.node}): a guide anchors a frame of the video the "
                                                 "sampler makes")
    if output == "png" and not lat.image:
        ev.refuse(n, "it saves the frames of a video as images: this product saves an image graph "
                     "(EmptyLatentImage) as a PNG and a video graph with SaveVideo")
    if output == "mp4" and lat.image:
        ev.refuse(n, f"it saves an image latent (EmptyLatentImage node {lat.node}) as a video: use SaveImage")
    for vae, enc in ((frames.vae, cond.vae), (sound.vae if sound else None, cond.audio_vae)):
        if vae is not None and enc is not None and vae.file.name.value != enc.file.name.value:
            ev.refuse(ev.graph.node(cond.node), f"it encodes with {enc.file.name.value} but the graph decodes with "
                                                f"{vae.file.name.value}: this product uses one VAE of each kind")
    partition = MODEL_FILES.get(g.model.unet.name.value)
    want = needed_partition(cond.kind == "reference_to_video")
    if partition is not None and partition.partition and partition.partition != want:
        ev.refuse(ev.graph.node(g.model.unet.node),
                  f"{g.model.unet.name.value} is the {partition.partition} DiT, but {cond.kind.replace('_', ' ')} "
                  f"renders need the {want} file (the other renders poor video without an error)"
                  f"{g.model.unet.name.hint()}")
    steps = sig.steps
    render = WorkflowRender(
        output=output, save_node=n.id, filename_prefix=str(ev.get(n, "filename_prefix", str, default="ComfyUI").value),
        conditioning=cond.kind, prompt=cond.prompt, seed=s.seed, width=lat.width, height=lat.height,
        frames=lat.length, steps=steps, sampler=s.sampler, scheduler=sig.scheduler,
        video_shift=g.model.shift[0] if g.model.shift else None,
        audio_shift=g.model.shift[1] if g.model.shift else None, sparse=g.model.sparse,
        ref_image_size=cond.ref_image_size, loras=[(f.name, strength) for f, strength in g.model.loras],
        first_frame=cond.first_frame, last_frame=cond.last_frame, references=list(cond.references),
        guides=list(cond.guides),
        files=[g.model.unet, cond.clip.file, frames.vae.file] + ([sound.vae.file] if sound else [])
        + [f for f, _ in g.model.loras],
        notes=ev.notes)
    return render


# -- the known types this product does not run
for _type in REFUSED:
    if not _type.endswith("*"):
        NODES.setdefault(_type, NodeKind(_refused_node))


# ---- the whole graph --------------------------------------------------------------------------------------------
@dataclass
class Interpretation:
    render: WorkflowRender | None
    refusals: list[Refusal]

    def result(self) -> WorkflowRender:
        """The render, or WorkflowRefused listing every refusal."""
        if self.refusals or self.render is None:
            raise WorkflowRefused(self.refusals or [Refusal("", "", "the graph renders nothing")])
        return self.render


def interpret(graph: Graph, size_of: SizeOf | None = None) -> Interpretation:
    """What `graph` renders, or why not: every node type known (an unknown one anywhere is refused: it could be an
    output of its own), exactly one saving node, and the run back from it."""
    ev = Interpreter(graph, size_of)
    for n in graph.nodes.values():  # unknown types and cloud / pose nodes, wherever they are
        if n.type not in NODES:
            ev.refuse(n, refusal_reason(n.type))
    saving = [n for n in graph.nodes.values() if n.type in NODES and NODES[n.type].saves]
    if not saving:
        ev.refuse(None, "the graph saves nothing: this product renders graphs that end in SaveVideo (or SaveImage "
                        "for an image)")
        return Interpretation(None, ev.refusals)
    if len(saving) > 1:
        ev.refuse(None, f"the graph saves {len(saving)} outputs ({', '.join(n.label() for n in saving)}): this "
                        "product renders one output per graph; remove the others or mute them (mode never)")
    render = ev.outputs(saving[0].id)[0]
    return Interpretation(render if isinstance(render, WorkflowRender) else None, ev.refusals)
