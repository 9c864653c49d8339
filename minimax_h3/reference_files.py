"""A ref2va reference file checked before any job holds it: torch- and numpy-free (docs/references.md).

The same checks run in three places, so a file is refused as early as anything can tell: the thin client on its
`--ref` files before it starts anything (exit 2), the render service at Submit before the job is stored
(INVALID_ARGUMENT naming the reference), and the decoder stage again as it decodes (`minimax_h3.media`). What they
read stays bounded whatever the file claims: an image's size comes from its header and is capped before its pixels
are decoded; of a video only the first frame is decoded; audio only as far as the render's duration reaches.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from minimax_h3.contract import FPS, FRAME_CLIP, FRAME_OFFSET, MAX_ASPECT, MIN_FRAMES, REFERENCE_KINDS
from stagekit.errors import InvalidArgument
from stagekit.uploads import MAX_FILE_BYTES

# Admission (docs/reliability.md): a reference file is at most as large as an upload (larger than one gRPC message:
# sent with the Upload RPCs, stagekit/uploads.py), its frames at most this many pixels before they are decoded, and a
# video is decoded frame by frame straight onto its canvas, only as far as the render's duration reaches.
MAX_REFERENCE_BYTES = MAX_FILE_BYTES
MAX_SOURCE_PIXELS = 4096 * 4096
MAX_SOURCE_FPS = 120
# PyAV sample formats that can hold NaN / infinity (integer PCM cannot): the array code their samples read as.
FLOAT_SAMPLES = {"flt": "f", "fltp": "f", "dbl": "d", "dblp": "d"}


@dataclass(frozen=True)
class ReferenceFile:
    """What the checks read of a reference file: its size (image / video), its duration (video / audio), whether a
    video has a soundtrack (it then takes an `<Audio j>` label), and the picture (the image, or a video's first
    frame, as a PIL image) the web page's thumbnail is made from."""

    kind: str
    width: int = 0
    height: int = 0
    seconds: float = 0.0
    sound: bool = False
    picture: Any = None


def admit_reference(kind: str, data: bytes, frames: int) -> None:
    """What a stage checks in its request handler, before any decoding: kind, size, render length."""
    if kind not in REFERENCE_KINDS:
        raise InvalidArgument(f"a reference is one of {', '.join(REFERENCE_KINDS)}, got {kind!r}")
    if not data:
        raise InvalidArgument(f"the {kind} reference is empty")
    if len(data) > MAX_REFERENCE_BYTES:
        raise InvalidArgument(f"the {kind} reference is {len(data)} bytes; a reference file may have at most "
                              f"{MAX_REFERENCE_BYTES} bytes: send a shorter or smaller file")
    if frames < MIN_FRAMES or frames % FRAME_CLIP != FRAME_OFFSET:
        raise InvalidArgument(f"references need the render's frame count (17n + 5, at least {MIN_FRAMES}), "
                              f"got {frames}")


def decoder_errors() -> tuple[type[BaseException], ...]:
    """What FFmpeg (PyAV) and Pillow raise for a file they refuse: the file's fault, said to the caller. Pillow's
    UnidentifiedImageError and a truncated file are OSErrors, a broken PNG chunk a SyntaxError; a decompression bomb
    is an error of its own."""
    import av
    from PIL import Image

    return av.FFmpegError, OSError, SyntaxError, Image.DecompressionBombError


def refusal(kind: str, name: str = "") -> Callable[[str], InvalidArgument]:
    """The refusal of one reference file: `refusal(kind, name)(why)` is InvalidArgument `the <kind> reference <name>
    cannot be used: <why>` (the words of the client, Submit and the decoder alike)."""
    return lambda why: InvalidArgument(f"the {kind} reference{' ' + name if name else ''} cannot be used: {why}")


def decoder_words(e: BaseException) -> str:
    """A decoder's refusal in words its sender can act on: FFmpeg's reason without PyAV's `[Errno N]` and stand-in
    file name, Pillow's without the in-memory buffer it read from."""
    import av
    from PIL import UnidentifiedImageError

    if isinstance(e, av.FFmpegError):
        why = e.strerror or "an error it does not name"
        return f"FFmpeg cannot read it ({why[0].lower()}{why[1:]}): send a file in a format FFmpeg decodes"
    if isinstance(e, UnidentifiedImageError):
        return "it is not an image Pillow reads: send a PNG, JPEG or WebP file"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def decodable_stream(container, kind: str, refuse: Callable[[str], InvalidArgument]):
    """The container's first `kind` ("video" / "audio") stream; `refuse(why)` is raised when it has none, or one
    whose codec FFmpeg does not know (PyAV then gives it no codec context)."""
    streams = getattr(container.streams, kind)
    if not streams:
        raise refuse(f"it has no {kind} stream")
    if streams[0].codec_context is None:
        raise refuse(f"its {kind} stream's codec is not one FFmpeg decodes")
    return streams[0]


def check_pixels(width: int, height: int, what: str, refuse: Callable[[str], InvalidArgument]) -> None:
    """A picture's size from its header: at most MAX_SOURCE_PIXELS, an aspect from 1:4 to 4:1 (the model's)."""
    if width * height > MAX_SOURCE_PIXELS:
        side = int(MAX_SOURCE_PIXELS ** 0.5)
        raise refuse(f"{width}x{height} is more than {MAX_SOURCE_PIXELS} pixels{' ' + what if what else ''} "
                     f"({side}x{side}): scale it down first")
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT * min(width, height):
        raise refuse(f"{width}x{height} is not within 1:4 and 4:1, the aspect ratios MiniMax-H3 takes")


def finite_samples(frame) -> bool:
    """Whether a decoded PyAV AudioFrame's samples are all finite (float formats; integer PCM always is)."""
    code = FLOAT_SAMPLES.get(frame.format.name)
    if code is None:
        return True
    count = frame.samples * (1 if frame.format.is_planar else len(frame.layout.channels))
    for plane in frame.planes:  # a plane's buffer may be padded past its samples
        values = memoryview(plane).cast("B")[:count * frame.format.bytes].cast(code)
        if not all(map(math.isfinite, values)):
            return False
    return True


def nonfinite_audio(seconds: float) -> str:
    """Why a clip whose decoded samples include NaN or infinity is refused."""
    return (f"its audio holds NaN or infinite samples (within the first {seconds:.2f} s, what the render uses): "
            "export it again as PCM, or as float samples that are all finite")


def _check_sound(container, stream, seconds: float, refuse: Callable[[str], InvalidArgument]) -> None:
    """Decode an audio stream as far as `seconds` (and a second more, as the stage does): it holds samples, and
    every one is finite (a NaN would reach the audio VAE)."""
    rate = int(stream.codec_context.sample_rate or 0)
    if rate <= 0:
        raise refuse("its audio stream states no sample rate")
    limit, total = int(seconds * rate) + rate, 0
    for frame in container.decode(stream):
        if not finite_samples(frame):
            raise refuse(nonfinite_audio(seconds))
        total += frame.samples
        if total >= limit:
            break
    if not total:
        raise refuse("the audio stream holds no samples")


def check_reference_file(kind: str, data: bytes, frames: int, name: str = "") -> ReferenceFile:
    """A reference file's bytes for a render of `frames` frames, checked as far as can be without decoding it onto
    the model's rates: its kind, size and the render length (`admit_reference`); an image's header (size, aspect)
    and then its pixels; a video's stream, frame size, aspect, frame rate, length, first frame and soundtrack; an
    audio clip's samples up to the render's duration. Raises InvalidArgument `the <kind> reference <name> cannot be
    used: <why>`."""
    import av
    from PIL import Image

    admit_reference(kind, data, frames)
    seconds = frames / FPS

    refuse = refusal(kind, name)

    try:
        if kind == "image":
            with warnings.catch_warnings():  # Pillow's bomb warning: the cap below is far lower
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im = Image.open(io.BytesIO(data))  # the header only (an in-memory file: nothing to close)
            check_pixels(im.width, im.height, "", refuse)
            im.load()  # the pixels decode (a cut-off or damaged file fails here), bounded by the cap above
            return ReferenceFile(kind, im.width, im.height, picture=im)
        with av.open(io.BytesIO(data)) as container:
            duration = (container.duration or 0) / 1e6
            if kind == "audio":
                _check_sound(container, decodable_stream(container, "audio", refuse), seconds, refuse)
                return ReferenceFile(kind, seconds=duration)
            stream = decodable_stream(container, "video", refuse)
            check_pixels(stream.width, stream.height, "a frame", refuse)
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            if not 0 < fps <= MAX_SOURCE_FPS:
                raise refuse(f"its frame rate {fps:g} is unknown or above {MAX_SOURCE_FPS} fps")
            # One frame's margin: the stage counts the frames its 24 fps resampling makes and has the last word.
            if 0 < duration * FPS < MIN_FRAMES - 1:
                raise refuse(f"it lasts {duration:.2f} s; a video reference needs at least {MIN_FRAMES} frames at "
                             f"{FPS} fps ({MIN_FRAMES / FPS:.2f} s)")
            first = next(container.decode(stream), None)
            if first is None:
                raise refuse("it holds no frames")
            picture = first.to_image()
            sound = bool(container.streams.audio)
            if sound:
                container.seek(0)
                _check_sound(container, decodable_stream(container, "audio", refuse), seconds, refuse)
            return ReferenceFile(kind, stream.width, stream.height, duration, sound, picture)
    except decoder_errors() as e:
        raise refuse(decoder_words(e)) from None
