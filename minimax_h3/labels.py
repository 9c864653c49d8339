"""The prompt's reference labels (`<Picture i>`, `<Video k>`, `<Audio j>`) checked against a request's references.

Torch- and numpy-free: the thin client checks a render before anything starts, and the render service checks what
reaches it, with the same rules (docs/references.md). Labels are numbered per kind in request order; a video with
a soundtrack takes an audio number too (its sound is labelled `<Audio j>` right before `<Video k>`). A ComfyUI
graph's prompt is taken as the graph gives it (ComfyUI binds a label only to an input connected in that order and
passes any other as text; its H3 templates name inputs they leave unconnected): its label problems are notes of the
render, not refusals (docs/workflows.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from stagekit.errors import InvalidArgument

LABEL = re.compile(r"<(Picture|Video|Audio) (\d+)>")
KIND_OF_LABEL = {"Picture": "image", "Video": "video", "Audio": "audio"}
EXTENSIONS = {
    "image": (".png", ".jpg", ".jpeg", ".webp", ".bmp"),
    "video": (".mp4", ".mov", ".m4v", ".webm", ".mkv", ".avi"),
    "audio": (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac"),
}


def kind_of(path: str) -> str:
    """A reference file's kind from its extension (`KIND:PATH` on the command line overrides it)."""
    ext = Path(path).suffix.lower()
    for kind, exts in EXTENSIONS.items():
        if ext in exts:
            return kind
    raise InvalidArgument(f"{path}: cannot tell whether this is an image, a video or an audio reference from its "
                          "extension; write image:PATH, video:PATH or audio:PATH")


def reference_labels(kinds: Sequence[str], has_sound: Sequence[bool]) -> list[str]:
    """The label of each reference in request order (a video's soundtrack label is not listed)."""
    count = {"Picture": 0, "Video": 0, "Audio": 0}
    out = []
    for kind, sound in zip(kinds, has_sound):
        if kind == "image":
            count["Picture"] += 1
            out.append(f"<Picture {count['Picture']}>")
            continue
        count["Audio"] += kind == "audio" or sound
        if kind == "video":
            count["Video"] += 1
            out.append(f"<Video {count['Video']}>")
        else:
            out.append(f"<Audio {count['Audio']}>")
    return out


def label_problems(prompt: str, kinds: Sequence[str], has_sound: Sequence[bool],
                   names: Sequence[str] = ()) -> list[str]:
    """What is wrong with the prompt's labels: a label no reference has, then the references it never names."""
    labels = reference_labels(kinds, has_sound)
    soundtracks, n_audio = set(), 0
    for kind, sound in zip(kinds, has_sound):
        n_audio += kind == "audio" or sound
        if kind == "video" and sound:
            soundtracks.add(f"<Audio {n_audio}>")
    used = {f"<{m.group(1)} {m.group(2)}>" for m in LABEL.finditer(prompt)}
    pairs = list(zip(labels, list(names) + [""] * len(labels)))  # each label with its file name, if known
    named = [f"{lab} = {n}" if n else lab for lab, n in pairs]
    out = []
    unknown = sorted(used - set(labels) - soundtracks)
    if unknown:
        out.append(f"the prompt names {', '.join(unknown)}, but the references are: {', '.join(named) or 'none'} "
                   "(labels count per kind, in --ref order)")
    unnamed = [f"{lab} ({n})" if n else lab for lab, n in pairs if lab not in used]
    if unnamed:
        out.append(f"the prompt never names {', '.join(unnamed)}; say in the prompt what each reference is for, e.g. "
                   "\"<Picture 1> walks through <Video 1>'s street\"")
    return out


def check_labels(prompt: str, kinds: Sequence[str], has_sound: Sequence[bool], names: Sequence[str] = ()) -> None:
    """InvalidArgument when the prompt names a reference the request lacks, or leaves a reference unnamed."""
    problems = label_problems(prompt, kinds, has_sound, names)
    if problems:
        raise InvalidArgument(problems[0])


GRAPH_LABELS_NOTE = ("the text encoder reads the prompt as the graph gives it, as ComfyUI does: a label binds only to "
                     "an input connected in that order, any other is plain text")
