"""Where a stage finds its weights: `--weights FILE`, `--models-dir DIR`, or the embedded tiny model.

The embedded default is a tiny H3-shaped model family written once as real
safetensors files into a cache dir, so a first run exercises the same loaders
as real checkpoints. Its output is noise.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from stagekit.errors import FailedPrecondition

EMBEDDED_VERSION = "embedded-v3"
EMBEDDED_NOTE = ("using the embedded tiny model: its output is noise. For real video, download the MiniMax-H3 "
                 "files and pass --models-dir DIR (see README 'Real checkpoints').")


# What each part of the model is found by under --models-dir (first pattern with a match wins; a file or a diffusers
# folder), and its name in messages. The stages resolve their weights with these, `client models check` and the
# client's early --models-dir check read the same table.
CHECKPOINT_PARTS: dict[str, tuple[str, list[str]]] = {
    "encoder": ("Qwen3-VL text encoder for MiniMax-H3",
                ["*qwen3vl*minimax_h3*.safetensors", "*qwen3*vl*32b*.safetensors", "text_encoder"]),
    "dit": ("MiniMax-H3 DiT checkpoint",
            ["*minimax_h3*int8_convrot*.safetensors", "*minimax_h3*.safetensors", "transformer"]),
    "video_vae": ("MiniMax-H3 video VAE",
                  ["*minimax_h3*video*vae*.safetensors", "*minimax*h3*vae*.safetensors", "video_vae"]),
    "audio_vae": ("MiniMax-H3 audio VAE",
                  ["*minimax_h3*audio*vae*.safetensors", "*minimax*h3*audio*.safetensors", "audio_vae"]),
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h3-stages"


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


def find_checkpoint(models_dir: str | Path, patterns: list[str], what: str) -> Path:
    """First file under models_dir (recursively) matching one of `patterns`, in pattern order."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise FailedPrecondition(f"models dir {root} does not exist or is not a directory")
    for pat in patterns:
        hits = sorted(p for p in root.rglob(pat) if p.is_file() or p.is_dir())
        if hits:
            return hits[0]
    raise FailedPrecondition(
        f"no {what} found under {root}: looked for {', '.join(patterns)}; pass the file explicitly with --weights")


def resolve_checkpoint(explicit: str, models_dir: str, part: str,
                       embedded: Callable[[], Path]) -> tuple[Path, bool]:
    """(path, is_embedded) of `part` (a key of CHECKPOINT_PARTS): an explicit --weights path, else a match under
    --models-dir, else the embedded model."""
    what, patterns = CHECKPOINT_PARTS[part]
    if explicit:
        p = Path(explicit).expanduser()
        if not p.exists():
            raise FailedPrecondition(f"{what} weights {p} do not exist")
        return p, False
    if models_dir:
        return find_checkpoint(models_dir, patterns, what), False
    return embedded(), True


def safe_name(name: str, default: str) -> str:
    """A bare file name for outputs: no directories, no traversal, no hidden files."""
    base = os.path.basename(name or "")
    if not base or base in (".", "..") or base.startswith(".") or base != name:
        if name and base != name:
            raise ValueError(f"output name {name!r} must be a bare file name (no directories)")
        return default
    if any(c in base for c in "\x00\n\r"):
        raise ValueError(f"output name {name!r} contains control characters")
    return base
