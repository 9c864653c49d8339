"""Reference media onto MiniMax-H3's own rates: 24 fps video, the audio VAE's sample rate (docs/references.md).

A reference is conditioned on at the model's clock, so a clip is resampled onto it from the rate its container
states, never assumed: frames through FFmpeg's `fps` filter (whole frames dropped or repeated, each held until the
slot of the next; the last one until the slot the stream's end falls on), audio through libswresample, both driven
by PyAV.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from minimax_h3.contract import (AUDIO_SAMPLE_RATE, FPS, FRAME_CLIP, FRAME_OFFSET, MIN_FRAMES, REF_IMAGE_SIZES,
                                 SIZE_MULTIPLE)
from minimax_h3.reference_files import (MAX_SOURCE_FPS, MAX_SOURCE_PIXELS, admit_reference, check_pixels,
                                        decodable_stream, decoder_errors, decoder_words, nonfinite_audio,
                                        refusal)
from stagekit.errors import InvalidArgument

# An image reference is encoded at a short edge of its own, whatever the render canvas (docs/model.md §3.4).
IMAGE_SHORT_EDGE = 2048
# A video reference goes onto the canvas of its own aspect, by the target's rule: short edge 768, area <= 768 x 1344.
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
MAX_ASPECT = 4.0
# Video references are VAE-encoded in whole clips: the frame count is snapped *down* to 17n + 5 (n >= 1), so a clip
# is never padded; a reference shorter than one clip is refused (docs/references.md).


@dataclass(frozen=True)
class ReferenceSizes:
    """The sizes references are put on: H3's own, or the embedded tiny family's smaller ones (its output is noise
    either way, and a 2048 px image or a 768 px clip costs its CPU VAE a minute)."""

    image_short_edge: int = IMAGE_SHORT_EDGE
    video_short_edge: int = CANVAS_SHORT_EDGE

    @property
    def video_max_pixels(self) -> int:
        """The canvas area cap, scaled with the short edge (768 x 1344 at H3's 768)."""
        return CANVAS_MAX_PIXELS * self.video_short_edge ** 2 // CANVAS_SHORT_EDGE ** 2

    def canvas(self, width: float, height: float) -> tuple[int, int]:
        """(height, width) of a video reference's canvas for frames of this size."""
        return canvas_for(width, height, self.video_short_edge, self.video_max_pixels)


EMBEDDED_REFERENCE_SIZES = ReferenceSizes(image_short_edge=256, video_short_edge=256)


@dataclass(frozen=True)
class ImageFit:
    """How an image reference is sized (RenderParams.ref_image_size, minimax_h3.contract.REF_IMAGE_SIZES): "" = the
    model's own pipeline, the short edge scaled to the stage's size (2048 px) up or down; ComfyUI's
    MiniMaxH3ReferenceToVideo `ref_image_size`: "max", scaled down only to that short edge, or "match", scaled down
    only to `pixels` (the render's width x height), the aspect kept either way."""

    mode: str = ""
    pixels: int = 0

    @classmethod
    def of(cls, mode: str, width: int, height: int) -> "ImageFit":
        """The fit a request asks for (`width` x `height`: the render's size). InvalidArgument for an unknown mode."""
        if mode not in REF_IMAGE_SIZES:
            raise InvalidArgument(f"ref_image_size {mode!r}: choose max or match (or leave it unset: the model's "
                                  "2048 px short edge)")
        if mode == "match" and not (width > 0 and height > 0):
            raise InvalidArgument("ref_image_size 'match' fits images to the render's size: send its width and height")
        return cls(mode, width * height if mode == "match" else 0)

    def scale(self, width: int, height: int, short_edge: int) -> float:
        """The factor an image of `width` x `height` is scaled by."""
        if self.mode == "match":
            return min(1.0, math.sqrt(self.pixels / (width * height)))
        to_edge = short_edge / min(width, height)
        return min(1.0, to_edge) if self.mode == "max" else to_edge


def resample_frames(frames: np.ndarray, fps: float, target_fps: int = FPS) -> np.ndarray:
    """uint8 [N, H, W, 3] frames at `fps` -> the same frames on a `target_fps` grid (FFmpeg `fps` filter)."""
    import av

    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if not fps > 0:
        raise ValueError(f"a video's frame rate must be positive, got {fps}")
    if fps == target_fps:
        return frames
    time_base = 1 / Fraction(fps).limit_denominator(1_001_000)
    graph = av.filter.Graph()
    src = graph.add_buffer(width=frames.shape[2], height=frames.shape[1], format="rgb24", time_base=time_base)
    fps_filter = graph.add("fps", fps=str(target_fps))
    sink = graph.add("buffersink")
    src.link_to(fps_filter)
    fps_filter.link_to(sink)
    graph.configure()
    out: list[np.ndarray] = []

    def drain() -> None:
        while True:
            try:
                out.append(graph.pull().to_ndarray())
            except (av.BlockingIOError, av.EOFError):
                return

    for i, pixels in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts, frame.time_base, frame.duration = i, time_base, 1  # the duration places the stream's end
        graph.push(frame)
        drain()
    graph.push(None)
    drain()
    return np.stack(out) if out else frames[:0]


def reference_clip_frames(frames: int) -> int:
    """Frames of a video reference the VAE encodes: snapped down to 17n + 5, n >= 1."""
    if frames < MIN_FRAMES:
        raise InvalidArgument(f"a video reference needs at least {MIN_FRAMES} frames at {FPS} fps "
                              f"({MIN_FRAMES / FPS:.2f} s), got {frames}")
    return (frames - FRAME_OFFSET) // FRAME_CLIP * FRAME_CLIP + FRAME_OFFSET


def canvas_for(width: float, height: float, short_edge: int = CANVAS_SHORT_EDGE,
               max_pixels: int = CANVAS_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) of the H3 canvas of an aspect: short edge `short_edge`, area capped at `max_pixels`, both
    sides rounded to multiples of 32 (docs/model.md §3.1)."""
    ratio = width / height
    if not 1 / MAX_ASPECT <= ratio <= MAX_ASPECT:
        raise InvalidArgument(f"MiniMax-H3 takes aspect ratios from 1:4 to 4:1, got {width:g}x{height:g}")
    w, h = (short_edge * ratio, float(short_edge)) if ratio >= 1 else (float(short_edge), short_edge / ratio)
    if w * h > max_pixels:
        scale = (max_pixels / (w * h)) ** 0.5
        w, h = w * scale, h * scale
    return (max(SIZE_MULTIPLE, round(h / SIZE_MULTIPLE) * SIZE_MULTIPLE),
            max(SIZE_MULTIPLE, round(w / SIZE_MULTIPLE) * SIZE_MULTIPLE))


@dataclass(frozen=True)
class ReferenceMedia:
    """One reference on the model's rates and sizes: uint8 frames [N, H, W, 3] (an image: N = 1) and/or float32
    stereo audio [2, samples] at 32 kHz."""

    kind: str
    frames: np.ndarray | None = None  # a video's every frame at 24 fps (the text encoder samples them at 2 fps)
    audio: np.ndarray | None = None
    source_fps: float | None = None  # the rate the container stated (video)
    source_rate: int | None = None  # the audio's own sample rate

    @property
    def vae_frames(self) -> np.ndarray | None:
        """The frames the video VAE encodes: a video's cut down to 17n + 5 (never padded), an image's one."""
        if self.frames is None or self.kind != "video":
            return self.frames
        return self.frames[:reference_clip_frames(self.frames.shape[0])]

    @property
    def seconds(self) -> float:
        if self.frames is not None and self.kind == "video":
            return self.vae_frames.shape[0] / FPS
        return 0.0 if self.audio is None else self.audio.shape[1] / AUDIO_SAMPLE_RATE

    def info(self) -> dict:
        """The EncodeReferenceDone fields (what the VAE encodes)."""
        n, h, w = (0, 0, 0) if self.frames is None else self.vae_frames.shape[:3]
        return {"width": w, "height": h, "frames": n, "seconds": self.seconds, "source_fps": self.source_fps or 0.0,
                "source_rate": self.source_rate or 0}


def _lanczos(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS)) for f in frames])


def normalize_image(pixels: np.ndarray, short_edge: int = IMAGE_SHORT_EDGE, fit: ImageFit = ImageFit()) -> np.ndarray:
    """uint8 [H, W, 3] -> [1, H', W', 3] scaled as `fit` says (default: to a `short_edge` px short edge), each side
    rounded to a multiple of 32 (at least 32), LANCZOS."""
    h, w = pixels.shape[:2]
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise InvalidArgument(f"an image reference must be within 1:4 and 4:1, got {w}x{h}")
    scale = fit.scale(w, h, short_edge)
    th = max(SIZE_MULTIPLE, round(h * scale / SIZE_MULTIPLE) * SIZE_MULTIPLE)
    tw = max(SIZE_MULTIPLE, round(w * scale / SIZE_MULTIPLE) * SIZE_MULTIPLE)
    return _lanczos(pixels[None], th, tw)


def normalize_video(frames: np.ndarray, fps: float, max_frames: int,
                    sizes: ReferenceSizes = ReferenceSizes()) -> np.ndarray:
    """Frames at `fps` -> 24 fps, cut to `max_frames`, onto the canvas of their own aspect (at least one VAE clip;
    the VAE's 17n + 5 cut is `ReferenceMedia.vae_frames`, the text encoder reads them all)."""
    frames = resample_frames(frames, fps)[:max_frames]
    reference_clip_frames(frames.shape[0])  # a clip shorter than the VAE's first one is refused here
    return _lanczos(frames, *sizes.canvas(frames.shape[2], frames.shape[1]))


def normalize_audio(waveform: np.ndarray, rate: int, max_seconds: float) -> np.ndarray:
    """float [channels, samples] at `rate` -> float32 stereo [2, n] at 32 kHz: cut to `max_seconds` at its own rate,
    mono repeated on both channels, resampled by libswresample."""
    import av

    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2) or waveform.shape[1] < 1:
        raise InvalidArgument(f"audio must be mono or stereo [channels, samples], got {list(waveform.shape)}")
    x = np.ascontiguousarray(waveform[:, :int(max_seconds * rate)], dtype=np.float32)
    if x.shape[0] == 1:
        x = np.repeat(x, 2, axis=0)
    if rate == AUDIO_SAMPLE_RATE:
        return x
    frame = av.AudioFrame.from_ndarray(x, format="fltp", layout="stereo")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=AUDIO_SAMPLE_RATE)
    out = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(out, axis=1).astype(np.float32)


def _decode_audio_stream(av, container, stream, max_seconds: float,
                         refuse: Callable[[str], InvalidArgument]) -> tuple[np.ndarray, int]:
    """An audio stream's samples, float32 [channels, n] at its own rate, up to `max_seconds` (and a second more);
    `refuse(why)` for a stream without samples or with a non-finite one (a NaN would reach the audio VAE)."""
    rate = int(stream.codec_context.sample_rate)
    resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)  # format only, own rate
    chunks, total, limit = [], 0, int(max_seconds * rate) + rate
    for frame in container.decode(stream):
        for f in resampler.resample(frame):
            chunks.append(f.to_ndarray())
            total += chunks[-1].shape[1]
        if total >= limit:
            break
    else:
        chunks += [f.to_ndarray() for f in resampler.resample(None)]
    if not chunks:
        raise refuse("the audio stream holds no samples")
    wave = np.concatenate(chunks, axis=1).astype(np.float32)
    if not np.isfinite(wave).all():
        raise refuse(nonfinite_audio(max_seconds))
    return wave, rate


def reference_decode_bytes(kind: str, frames: int) -> int:
    """Host bytes a reference's decode may take (counted in the job's memory estimate)."""
    if kind == "image":
        return MAX_SOURCE_PIXELS * 8
    audio = int(frames / FPS * 48_000 * 2 * 4 * 4) + (1 << 20)  # up to 48 kHz stereo, a few float copies
    if kind == "audio":
        return audio
    return MAX_SOURCE_PIXELS * 4 + 3 * frames * 5 * CANVAS_MAX_PIXELS * 3 + audio  # canvas frames at <= 120 fps


def load_reference(data: bytes, kind: str, frames: int, sizes: ReferenceSizes = ReferenceSizes(),
                   name: str = "", fit: ImageFit = ImageFit()) -> ReferenceMedia:
    """A reference file's bytes -> ReferenceMedia on the model's rates for a render of `frames` frames at 24 fps
    (video and audio are cut to its duration; an image sized as `fit` says). Raises InvalidArgument naming the
    reference (`name`, its file name) and what is wrong with the file: each check raises it (the checks
    `reference_files.check_reference_file` makes before a job holds it, again here), and so does a file the decoders
    refuse (FFmpeg's and Pillow's errors); anything else is a fault of this code, never the caller's."""
    import av
    from PIL import Image

    admit_reference(kind, data, frames)
    seconds = frames / FPS

    refused = refusal(kind, name)

    try:
        if kind == "image":
            with Image.open(io.BytesIO(data)) as im:
                check_pixels(im.width, im.height, "", refused)
                pixels = np.asarray(im.convert("RGB"))
            return ReferenceMedia("image", frames=normalize_image(pixels, sizes.image_short_edge, fit))
        with av.open(io.BytesIO(data)) as container:
            if kind == "audio":
                wave, rate = _decode_audio_stream(av, container, decodable_stream(container, "audio", refused), seconds,
                                                 refused)
                return ReferenceMedia("audio", audio=normalize_audio(wave, rate, seconds), source_rate=rate)
            stream = decodable_stream(container, "video", refused)
            check_pixels(stream.width, stream.height, "a frame", refused)
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            if not 0 < fps <= MAX_SOURCE_FPS:
                raise refused(f"its frame rate {fps:g} is unknown or above {MAX_SOURCE_FPS} fps")
            need = int(seconds * fps) + 2  # the frames the render's duration can use
            pixels, canvas = [], None
            for frame in container.decode(stream):
                rgb = frame.to_ndarray(format="rgb24")
                turns = round(frame.rotation / 90.0) % 4  # display-matrix rotation, as a player shows it
                if turns:
                    rgb = np.ascontiguousarray(np.rot90(rgb, k=-turns))
                if canvas is None:
                    canvas = sizes.canvas(rgb.shape[1], rgb.shape[0])
                pixels.append(_lanczos(rgb[None], *canvas)[0])  # per frame, so it commutes with the rate change
                if len(pixels) >= need:
                    break
            if not pixels:
                raise refused("it holds no frames")
            video = np.stack(pixels)
            del pixels
            sound, rate = None, None
            if container.streams.audio:
                container.seek(0)
                wave, rate = _decode_audio_stream(av, container, decodable_stream(container, "audio", refused), seconds,
                                                 refused)
                sound = normalize_audio(wave, rate, seconds)
            return ReferenceMedia("video", frames=normalize_video(video, fps, frames, sizes), audio=sound,
                                  source_fps=fps, source_rate=rate)
    except decoder_errors() as e:
        raise refused(decoder_words(e)) from None


# ---- an extension's source clip: a finished MP4 of this product ------------------------------------------------
def clip_frames(path: str | os.PathLike, start: int, count: int, size: tuple[int, int] | None = None
                ) -> Iterator[np.ndarray]:
    """Frames [start, start + count) of a finished MP4 (24 fps, as the decoder muxed it), one uint8 [H, W, 3] at a
    time (the clip is never held whole); `size` (width, height): fitted to it (cover-resize and centre crop, as a
    keyframe), else as they are. InvalidArgument when the file holds fewer frames."""
    import av
    import torch

    from minimax_h3.images import fit_to_canvas

    refused = refusal("video", Path(path).name)
    n = 0
    try:
        with av.open(str(path)) as container:
            stream = decodable_stream(container, "video", refused)
            for frame in container.decode(stream):
                if n >= start + count:
                    break
                if n >= start:
                    rgb = frame.to_ndarray(format="rgb24")
                    if size is not None:
                        rgb = fit_to_canvas(torch.from_numpy(rgb), *size).numpy()
                    yield rgb
                n += 1
    except decoder_errors() as e:
        raise refused(decoder_words(e)) from None
    if n < start + count:
        raise refused(f"it holds {n} frames; the extension continues frame {start + count - 1}")


def clip_audio(path: str | os.PathLike, start: int, samples: int) -> np.ndarray:
    """Samples [start, start + samples) of a finished MP4's soundtrack, float32 stereo [2, samples] at the audio VAE's
    rate (zeros past its end)."""
    import av

    refused = refusal("video", Path(path).name)
    try:
        with av.open(str(path)) as container:
            stream = decodable_stream(container, "audio", refused)
            wave, rate = _decode_audio_stream(av, container, stream, (start + samples) / AUDIO_SAMPLE_RATE, refused)
    except decoder_errors() as e:
        raise refused(decoder_words(e)) from None
    wave = normalize_audio(wave, rate, (start + samples) / AUDIO_SAMPLE_RATE + 1.0)[:, start:start + samples]
    return np.pad(wave, ((0, 0), (0, samples - wave.shape[1])))


def clip_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of a finished MP4's video stream."""
    import av

    refused = refusal("video", Path(path).name)
    try:
        with av.open(str(path)) as container:
            stream = decodable_stream(container, "video", refused)
            return int(stream.codec_context.width), int(stream.codec_context.height)
    except decoder_errors() as e:
        raise refused(decoder_words(e)) from None
