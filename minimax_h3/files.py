"""Where a stage finds its weights: `--weights FILE`, `--models-dir DIR`, or the embedded tiny model.

The embedded default is a tiny H3-shaped model family written once as real
safetensors files into a cache dir, so a first run exercises the same loaders
as real checkpoints. Its output is noise.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stagekit.errors import FailedPrecondition, InvalidArgument

EMBEDDED_VERSION = "embedded-v3"
MAX_CANDIDATES_NAMED = 4
EMBEDDED_NOTE = ("using the embedded tiny model: its output is noise. For real video, download the MiniMax-H3 "
                 "files and pass --models-dir DIR (see README 'Real checkpoints').")


@dataclass(frozen=True)
class CheckpointPart:
    """How a stage finds one part of the model under --models-dir (`find_checkpoint`)."""

    what: str                      # its name in messages
    patterns: tuple[str, ...]      # file or diffusers folder names; exactly one match is taken
    exclude: tuple[str, ...] = ()  # names the patterns also match that are another part's or another model's
    flag: str = "--weights"        # the stage flag that names the file instead
    optional: bool = False         # a folder without it still serves (the ref2va partition)


# The one table of where each part of the model is found: the stages resolve their weights with it, and
# `client models check` and the client's early --models-dir check read it (torch-free).
CHECKPOINT_PARTS: dict[str, CheckpointPart] = {
    "encoder": CheckpointPart("Qwen3-VL text encoder for MiniMax-H3",
                              ("*qwen3vl*minimax_h3*.safetensors", "*qwen3*vl*32b*.safetensors", "text_encoder")),
    "dit": CheckpointPart("MiniMax-H3 DiT checkpoint",
                          ("*minimax_h3*int8_convrot*.safetensors", "*minimax_h3*.safetensors",
                           "*fastvideo_fasth3*.safetensors", "transformer"),
                          ("*qwen3*", "*vae*", "*lora*", "*ref2va*")),
    "dit_ref2va": CheckpointPart("MiniMax-H3 ref2va DiT checkpoint",
                                 ("*minimax_h3*ref2va*.safetensors", "*fasth3_omniref*.safetensors", "transformer_ref"),
                                 ("*qwen3*", "*vae*", "*lora*"), optional=True),
    "video_vae": CheckpointPart("MiniMax-H3 video VAE",
                                ("*minimax_h3*video*vae*.safetensors", "*minimax*h3*vae*.safetensors", "video_vae"),
                                ("*audio*",), "--video-weights"),
    "audio_vae": CheckpointPart("MiniMax-H3 audio VAE",
                                ("*minimax_h3*audio*vae*.safetensors", "*minimax*h3*audio*.safetensors", "audio_vae"),
                                ("*video*",), "--audio-weights"),
}


# The video VAE files (`models fetch --video-vae`): the fp16 weights, and ComfyUI's int8 ConvRot file whose decoder
# linears the decoder dequantises at load (docs/checkpoints.md, "Video VAE int8 ConvRot"); ComfyUI's H3 templates name
# the int8 one. Names in MODEL_FILES (below), with their published sizes in GiB.
VIDEO_VAE_FILES: dict[str, tuple[str, float]] = {
    "fp16": ("minimax_h3_video_vae_fp16.safetensors", 4.85),
    "int8": ("minimax_h3_video_vae_int8_convrot.safetensors", 2.62),
}
# LightX2V's few-step Turbo LoRAs in their ComfyUI naming (`models fetch --lora`; docs/checkpoints.md, "LoRA files"),
# as ComfyUI's H3 templates name them: fl2v for text / first-last frame renders, ref2v for references.
TURBO_LORAS: dict[str, tuple[str, float]] = {
    "fl2v-8step": ("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1.82),
    "fl2v-4step-768p": ("minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16.safetensors", 1.82),
    "ref2v-4step": ("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", 1.82),
}


def ensure_embedded(cache_dir: Path, filename: str, write: Callable[[Path], None]) -> Path:
    """Return cache_dir/embedded-v1/filename, writing it with `write(tmp_path)` once (race-free)."""
    d = Path(cache_dir) / EMBEDDED_VERSION
    d.mkdir(parents=True, exist_ok=True)
    target = d / filename
    if target.exists():
        return target
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several stages may start at once
        if not target.exists():
            tmp = d / f".{filename}.tmp{os.getpid()}"
            write(tmp)
            tmp.replace(target)
    return target


def find_checkpoint(models_dir: str | Path, patterns: list[str], what: str, exclude: tuple[str, ...] = (),
                    flag: str = "--weights") -> Path:
    """The one file (or diffusers folder) under models_dir (recursively) whose name matches one of `patterns` and
    none of `exclude` (names of another stage's or another model's files: a ComfyUI folder keeps every stage's files
    side by side under diffusion_models/, text_encoders/ and vae/). Two candidates are refused naming both and
    `flag`: taking one of them silently could serve the wrong weights."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise FailedPrecondition(f"models dir {root} does not exist or is not a directory")
    found: dict[Path, Path] = {}  # real path -> path as found (a link and its target are one candidate)
    for pat in patterns:
        for p in sorted(root.rglob(pat)):
            if COMFY_FOLDERS["lora"] in p.relative_to(root).parts[:-1]:
                continue  # ComfyUI's LoRA folder: never a checkpoint (the Turbo LoRAs' names say only minimax_h3)
            if (p.is_file() or p.is_dir()) and not any(fnmatch.fnmatch(p.name, x) for x in exclude):
                found.setdefault(p.resolve(), p)
    hits = list(_one_per_checkpoint(found).values())
    if len(hits) > 1:
        listed = ", ".join(str(p) for p in hits[:MAX_CANDIDATES_NAMED])
        more = f" (+{len(hits) - MAX_CANDIDATES_NAMED} more)" if len(hits) > MAX_CANDIDATES_NAMED else ""
        raise FailedPrecondition(f"{len(hits)} candidate {what}s under {root}: {listed}{more}; name the one to serve "
                                 f"with {flag} (or keep one of them in the models dir)")
    if hits:
        return hits[0]
    raise FailedPrecondition(
        f"no {what} found under {root}: looked for {', '.join(patterns)}; pass the file explicitly with {flag}")


def _one_per_checkpoint(found: dict[Path, Path]) -> dict[Path, Path]:
    """The candidates (real path -> path as found) with each checkpoint once: a folder found by name (`transformer/`,
    `video_vae/`, ...) is the checkpoint of the `*.safetensors` directly inside it, so a folder whose files were
    all found by name too is the same checkpoint as they are: one file stays the candidate (the folder goes), several
    (a sharded set) are the folder's. A folder without safetensors of its own holds no checkpoint (a stage would
    refuse it). A folder with other weights beside a found file stays a candidate of its own."""
    files = {real for real in found if real.is_file()}
    out = dict(found)
    for real in [r for r in found if r.is_dir()]:
        own = {f.resolve() for f in real.glob("*.safetensors") if f.is_file()}
        if not own:
            del out[real]
        elif own <= files:
            for f in own if len(own) > 1 else {real}:
                out.pop(f, None)
    return out


def find_part(models_dir: str | Path, part: str) -> Path:
    """`find_checkpoint` of CHECKPOINT_PARTS[part]."""
    c = CHECKPOINT_PARTS[part]
    return find_checkpoint(models_dir, c.patterns, c.what, c.exclude, c.flag)


def resolve_checkpoint(explicit: str, models_dir: str, part: str,
                       embedded: Callable[[], Path]) -> tuple[Path, bool]:
    """(path, is_embedded) of CHECKPOINT_PARTS[part]: an explicit path (its stage flag), else the one match under
    --models-dir, else the embedded model."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.exists():
            raise FailedPrecondition(f"{CHECKPOINT_PARTS[part].what} weights {p} do not exist")
        return p, False
    if models_dir:
        return find_part(models_dir, part), False
    return embedded(), True


def shown_models_dir(models_dir: str) -> str:
    """A stage's --models-dir as its Status shows it: absolute, links resolved ("" for none), so a client compares it
    with a folder it names."""
    return str(Path(models_dir).expanduser().resolve()) if models_dir else ""


def safe_name(name: str, default: str) -> str:
    """A bare file name for outputs: no directories, no traversal, no hidden files."""
    base = os.path.basename(name or "")
    if not base or base in (".", "..") or base.startswith(".") or base != name:
        if name and base != name:
            raise InvalidArgument(f"output name {name!r} must be a bare file name (no directories)")
        return default
    if any(c in base for c in "\x00\n\r"):
        raise InvalidArgument(f"output name {name!r} contains control characters")
    return base


# ---- the files ComfyUI's MiniMax-H3 graphs name ------------------------------------------------------------------
COMFY_REPO = "Comfy-Org/MiniMax-H3"
# The folder of a ComfyUI install's `models/` each kind of file goes in (what its loader node lists).
COMFY_FOLDERS = {"dit": "diffusion_models", "text_encoder": "text_encoders", "video_vae": "vae", "audio_vae": "vae",
                 "lora": "loras"}
POSE = "a pose ControlNet file: this product does not run ControlNets"


@dataclass(frozen=True)
class ModelFile:
    """A file ComfyUI's MiniMax-H3 graphs load by name, where it is published, and what this product does with it."""

    name: str
    role: str                 # "dit" | "text_encoder" | "video_vae" | "audio_vae" | "lora" | "other"
    repo: str                 # Hugging Face repository
    repo_path: str            # its path there
    folder: str               # the ComfyUI models/ subfolder its loader lists
    partition: str = ""       # DiT: the MiniMax-H3 partition it holds (fl2va, ref2va)
    refusal: str = ""         # why this product does not load it ("": it does)
    instead: str = ""         # ... and the file it loads in its place


def _comfy(name: str, role: str, partition: str = "", refusal: str = "", folder: str = "",
           instead: str = "") -> ModelFile:
    folder = folder or COMFY_FOLDERS[role]
    return ModelFile(name, role, COMFY_REPO, f"{folder}/{name}", folder, partition, refusal, instead)


# One entry per file (name -> entry); a piece of the model this product learns to load changes its entry here.
MODEL_FILES: dict[str, ModelFile] = {f.name: f for f in (
    _comfy("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "dit", "fl2va"),
    _comfy("minimax_h3_fl2va_int8_convrot.safetensors", "dit", "fl2va"),
    _comfy("minimax_h3_ref2va_pruned_int8_convrot.safetensors", "dit", "ref2va"),
    _comfy("minimax_h3_ref2va_int8_convrot.safetensors", "dit", "ref2va"),
    _comfy("qwen3vl_32b_minimax_h3_int8_convrot.safetensors", "text_encoder"),
    _comfy("qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoder"),
    _comfy("qwen3vl_32b_minimax_h3_bf16.safetensors", "text_encoder"),
    _comfy("minimax_h3_video_vae_fp16.safetensors", "video_vae"),
    _comfy("minimax_h3_video_vae_int8_convrot.safetensors", "video_vae"),
    _comfy("minimax_h3_audio_vae_fp32.safetensors", "audio_vae"),
    ModelFile("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", "lora", "lightx2v/Minimax-h3-Turbo",
              "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", "loras"),
    _comfy("minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16.safetensors", "lora"),
    _comfy("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", "lora"),
    # FastVideo's FastH3 students (VSA-distilled; their graphs set BlockSparseAttention "vsa", docs/workflows.md)
    ModelFile("fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors", "dit", "FastVideo/FastVideo-FastH3-Comfy",
              "diffusion_models/fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors", "diffusion_models",
              "fl2va"),
    ModelFile("fasth3_omniref_8step_pruned_int8_convrot.safetensors", "dit", "FastVideo/FastH3-OmniRef-Comfy",
              "diffusion_models/fasth3_omniref_8step_pruned_int8_convrot.safetensors", "diffusion_models", "ref2va"),
    _comfy("minimax_h3_fun_controlnet_union_pruned_int8_convrot.safetensors", "other", refusal=POSE,
           folder="model_patches"),
    ModelFile("rt_detr_v4-x-hgnet_fp16.safetensors", "other", "Comfy-Org/SDPose",
              "diffusion_models/rt_detr_v4-x-hgnet_fp16.safetensors", "diffusion_models", refusal=POSE),
    ModelFile("sdpose_wholebody_fp16.safetensors", "other", "Comfy-Org/SDPose",
              "checkpoints/sdpose_wholebody_fp16.safetensors", "checkpoints", refusal=POSE),
)}
