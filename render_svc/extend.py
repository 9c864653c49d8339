"""Extensions (docs/long_video.md, "Extend"): a finished job's latents kept beside its MP4, the guide an extension
cuts from them, and the extension's render request built from its source job.

A finished job keeps its final clean latents in `<job>.latents.safetensors` beside its MP4 (the span the DiT returned:
the whole clip, or for an extension its guide and what follows), removed with the MP4. An extension continues the
source from its last `guide_frames` frames: their latents cut from that file when it covers them, else re-encoded
from the source's MP4 by the decoder (EncodeTail).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save, save_file

from h3.v1 import render_pb2
from minimax_h3.contract import (FPS, FRAME_CLIP, LATENTS_PER_CLIP, TAIL_AUDIO, TAIL_VIDEO, RenderSpec,
                                 audio_latent_count, snap_frames, spec_from_proto)
from render_svc.store import latents_path
from stagekit.errors import FailedPrecondition, InvalidArgument

VIDEO, AUDIO = "video", "audio"  # the latents file's tensors


def save_latents(output: Path, video: torch.Tensor, audio: torch.Tensor, spec: RenderSpec) -> Path:
    """Keep a job's final latents beside its MP4 (written aside and renamed into place, as the MP4 is)."""
    dest = latents_path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        save_file({VIDEO: video.contiguous(), AUDIO: audio.contiguous()}, tmp,
                  metadata={"start_frame": str(spec.span_start), "frames": str(spec.frames)})
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def cut_guide(kept: Path, spec: RenderSpec) -> bytes | None:
    """The guide of extension `spec` (its source's latents of frames [span_start, prefix_frames)) cut from the
    source's kept latents `kept`, as a safetensors file's bytes; None when the file does not cover those frames (or is
    gone)."""
    try:
        with safe_open(str(kept), "pt") as f:
            meta = f.metadata() or {}
        start, frames = int(meta.get("start_frame", -1)), int(meta.get("frames", -1))
    except (OSError, ValueError):  # gone (retention) or unreadable: the MP4 is re-encoded instead
        return None
    if frames != spec.prefix_frames or not 0 <= start <= spec.span_start:
        return None
    t = load_file(str(kept))
    v0 = (spec.span_start - start) // FRAME_CLIP * LATENTS_PER_CLIP
    a0 = audio_latent_count(spec.span_start) - audio_latent_count(start)
    video = t[VIDEO][:, v0:v0 + spec.guide_latents]
    audio = t[AUDIO][..., a0:a0 + spec.guide_audio_latents]
    if video.shape[1] != spec.guide_latents or audio.shape[-1] != spec.guide_audio_latents:
        return None
    return save({TAIL_VIDEO: video.contiguous(), TAIL_AUDIO: audio.contiguous()})


def load_guide(path: Path) -> dict[str, torch.Tensor]:
    """The guide tensors (minimax_h3.contract's TAIL_VIDEO, TAIL_AUDIO) of a stored guide file."""
    return load_file(str(path))


def extension_frames(source_frames: int, seconds: float) -> int:
    """The stitched total of a clip of `source_frames` frames extended by `seconds`: the smallest valid frame count
    lasting at least that long."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"seconds must be a positive number of seconds to add, got {seconds!r}")
    return snap_frames(source_frames + math.ceil(seconds * FPS - 1e-9))


def extension_request(source: render_pb2.RenderRequest, ext: render_pb2.ExtendRequest,
                      source_id: str) -> render_pb2.RenderRequest:
    """The render request of an extension of the finished job `source_id` (request `source`): its own prompt(s) and
    stitched total (`ext.params.frames`, or the source's length plus `ext.seconds`), the source's canvas, MP4 settings and LoRAs, its other sampling settings
    the source's unless `ext.params` sets them. InvalidArgument naming the field."""
    src, want = source.params, ext.params
    if not want.prompt.strip():
        raise InvalidArgument("an extension needs a prompt: what happens next (picture and sound)")
    if want.HasField("frames") == bool(ext.seconds):
        raise InvalidArgument("an extension needs its length: seconds to add, or frames (the stitched total of "
                              "source and extension), not both")
    src_spec = spec_from_proto(src)
    frames = want.frames if want.HasField("frames") else extension_frames(src_spec.frames, ext.seconds)
    for name in ("width", "height"):
        if want.HasField(name) and getattr(want, name) != getattr(src_spec, name):
            raise InvalidArgument(f"an extension keeps its source's canvas ({src_spec.width}x{src_spec.height}); "
                                  f"leave {name} out")
    req = render_pb2.RenderRequest(crf=source.crf, upscale_width=source.upscale_width,
                                   upscale_height=source.upscale_height, idempotency_key=ext.idempotency_key,
                                   label=ext.label, extend_job_id=source_id, loras=source.loras)
    p = req.params
    p.CopyFrom(src)
    p.width, p.height = src_spec.width, src_spec.height
    p.prompt, p.frames, p.prefix_frames = want.prompt, frames, src_spec.frames
    p.ClearField("more_prompts")
    p.ClearField("prompt_starts")
    p.more_prompts.extend(want.more_prompts)
    p.prompt_starts.extend(want.prompt_starts)
    p.window_frames, p.window_overlap, p.window_mode = want.window_frames, want.window_overlap, want.window_mode
    p.window_fuse = ""
    if want.HasField("steps"):
        p.steps = want.steps
    for name in ("seed", "sampler", "scheduler", "video_shift", "audio_shift"):
        if getattr(want, name):
            setattr(p, name, getattr(want, name))
    return req


def check_source(source_state: int, source_id: str, expired: bool, output: str) -> Path:
    """The source job's MP4, or FailedPrecondition naming why it cannot be extended."""
    if source_state != render_pb2.JOB_SUCCEEDED:
        state = render_pb2.JobState.Name(source_state).removeprefix("JOB_").lower()
        raise FailedPrecondition(f"job {source_id} is {state}: only a finished (succeeded) job can be extended")
    path = Path(output)
    if expired or not path.is_file():
        raise FailedPrecondition(f"job {source_id}'s MP4 was removed by the retention limits (--keep-jobs / "
                                 "--keep-bytes-gb / --keep-age-s): it can no longer be extended")
    return path
