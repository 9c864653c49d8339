"""MP4 / WAV output for the decoder stage: H.264 (yuv420p) + AAC 32 kHz stereo, via PyAV.

Contract (tested in tests/test_mux.py):
* video has exactly F frames at `fps` (24) with constant frame duration;
* audio is 32000 Hz, 2 channels; it is trimmed / zero-padded to round(F * 32000 / fps) samples so the
  two streams have the same nominal duration (AAC priming is hidden by the MP4 edit list);
* outputs are never half-written: we encode into a temp file next to the target and `os.replace` it; the
  temp file is removed on every failure, cancellation included (`check_cancel`, called once per frame).

Long clips stream: `frames` may be a `FrameStream`, chunks of frames that arrive while the mux runs (the decoder's
temporal chunks, as each finishes), so neither the frames nor their uint8 copy of the whole clip are ever held. An
extension opens with its source clip (`prefix`: frames already at the output size, muxed as they are).

Upscaled output (`size=(W, H)` differing from the frames'): every frame is scaled in the mux by a *resizer* from
`RESIZERS` — by default libswscale's Lanczos through PyAV (`VideoFrame.reformat(..., interpolation="LANCZOS")`),
which converts to yuv420p in the same pass. A resizer takes the clip's frames in order and yields one frame of the
output size per input frame, so a learned (temporal) upscaler plugs in as one more entry (docs/render_service.md).

Speed: the decoder stage shares a few CPU cores, so the default x264 preset is "veryfast" (see the
measurements in the decoder report); `preset` / `crf` are parameters, not constants in the code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Union

import numpy as np

from minimax_h3.contract import AUDIO_CHANNELS, AUDIO_SAMPLE_RATE, FPS, audio_samples
from stagekit.errors import Internal, InvalidArgument

DEFAULT_CRF = 20
DEFAULT_PRESET = "veryfast"
DEFAULT_AUDIO_BITRATE = 128_000
DEFAULT_CHUNK_BYTES = 1 << 20

X264_PRESETS = (
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow", "placebo",
)

PathOrFile = Union[str, os.PathLike, IO[bytes]]


def lanczos(frames: Iterator, width: int, height: int) -> Iterator:
    """libswscale Lanczos (PyAV), scaling and converting to yuv420p in one pass."""
    for frame in frames:
        yield frame.reformat(width=width, height=height, format="yuv420p", interpolation="LANCZOS")


# The resize hook: name -> fn(frames: Iterator[av.VideoFrame], width, height) -> Iterator[av.VideoFrame], one output
# frame per input frame, in order. A learned upscaler (e.g. a video super-resolution model) is one more entry.
RESIZERS: dict[str, Callable[[Iterator, int, int], Iterator]] = {"lanczos": lanczos}


@dataclass(frozen=True)
class MuxInfo:
    num_frames: int
    width: int
    height: int
    fps: int
    audio_samples: int  # per channel, after trim/pad
    sample_rate: int
    num_bytes: int
    encode_seconds: float


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.dtype in (torch.bfloat16, torch.float16):
                x = x.float()
            return x.numpy()
    except ImportError:  # pragma: no cover - torch is always present in this repo
        pass
    raise ValueError(f"expected a numpy array or torch tensor, got {type(x).__name__}")


class _FrameSource:
    """Validated view over the input video that converts one frame at a time to uint8 [H, W, 3].

    Converting per frame (inside the encode loop) keeps the working set at a few MB instead of a
    second full copy of the clip (124 x 832 x 480 x 3 floats = 600 MB) and is ~8 ms/frame.
    """

    def __init__(self, frames, value_range: tuple[float, float] = (0.0, 1.0)):
        a = _to_numpy(frames)
        if a.dtype == np.uint8:
            if a.ndim != 4 or a.shape[-1] != 3:
                raise ValueError(f"uint8 frames must have shape [F, H, W, 3], got {a.shape}")
            self.num_frames, self.height, self.width = a.shape[:3]
            self._float = False
        elif np.issubdtype(a.dtype, np.floating):
            if a.ndim == 5 and a.shape[0] == 1:
                a = a[0]
            if a.ndim != 4 or a.shape[0] != 3:
                raise ValueError(f"float frames must have shape [3, F, H, W] (or [1, 3, F, H, W]), got {a.shape}")
            lo, hi = float(value_range[0]), float(value_range[1])
            if not hi > lo:
                raise ValueError(f"value_range must be increasing, got {value_range}")
            self._lo, self._scale = lo, 255.0 / (hi - lo)
            self.num_frames, self.height, self.width = a.shape[1:]
            self._float = True
            self._buf = np.empty((3, self.height, self.width), np.float32)
        else:
            raise ValueError(f"frames must be uint8 [F,H,W,3] or float [3,F,H,W], got dtype {a.dtype}")
        if self.num_frames < 1 or self.height < 2 or self.width < 2:
            raise ValueError(f"need at least 1 frame of 2x2 pixels, got {a.shape}")
        self._a = a

    def __len__(self) -> int:
        return self.num_frames

    def __getitem__(self, i: int) -> np.ndarray:
        if not self._float:
            return np.ascontiguousarray(self._a[i])
        f = self._buf
        np.subtract(self._a[:, i], self._lo, out=f, casting="unsafe")
        if not np.isfinite(f).all():
            raise ValueError(f"float frames contain NaN or Inf (frame {i})")
        f *= self._scale
        f += 0.5  # round half up, then truncate in the uint8 cast
        np.clip(f, 0.0, 255.0, out=f)
        return np.ascontiguousarray(f.astype(np.uint8).transpose(1, 2, 0))

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(self.num_frames))


@dataclass
class FrameStream:
    """A clip's frames arriving in chunks while the mux runs: `num_frames` frames of `height` x `width` in `chunks`,
    each uint8 [n, H, W, 3] or float [3, n, H, W] in [0, 1] (a torch tensor or a numpy array). One chunk is
    converted at a time; the chunks must add up to `num_frames`."""

    num_frames: int
    height: int
    width: int
    chunks: Iterable

    def __len__(self) -> int:
        return self.num_frames

    def __iter__(self) -> Iterator[np.ndarray]:
        n = 0
        for chunk in self.chunks:
            src = _FrameSource(chunk)
            if (src.height, src.width) != (self.height, self.width):
                raise ValueError(f"a chunk of {src.width}x{src.height} frames in a {self.width}x{self.height} stream")
            for frame in src:
                n += 1
                if n > self.num_frames:
                    raise ValueError(f"the stream holds more than its {self.num_frames} frames")
                yield frame
        if n != self.num_frames:
            raise ValueError(f"the stream ended after {n} of its {self.num_frames} frames")


def frames_to_uint8(frames, value_range: tuple[float, float] = (0.0, 1.0)) -> np.ndarray:
    """Video -> contiguous uint8 `[F, H, W, 3]`.

    Accepts uint8 `[F, H, W, 3]` (returned as is when contiguous) or floating `[3, F, H, W]` /
    `[1, 3, F, H, W]` (VAE layout) in `value_range` (default [0, 1]); floats are clipped and rounded.
    """
    src = _FrameSource(frames, value_range)
    if not src._float:
        return np.ascontiguousarray(src._a)
    out = np.empty((src.num_frames, src.height, src.width, 3), np.uint8)
    for i in range(src.num_frames):
        out[i] = src[i]
    return out


def _prepare_audio(audio, num_samples: int | None) -> np.ndarray:
    a = _to_numpy(audio)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"audio must be floating point in [-1, 1], got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[0] != AUDIO_CHANNELS:
        raise ValueError(f"audio must have shape [2, samples] (stereo, channel-first), got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("audio contains NaN or Inf")
    a = np.clip(a.astype(np.float32), -1.0, 1.0)
    if num_samples is not None:
        if a.shape[1] >= num_samples:
            a = a[:, :num_samples]
        else:
            a = np.pad(a, ((0, 0), (0, num_samples - a.shape[1])))
    return np.ascontiguousarray(a)


def _encode(
    target,
    video: _FrameSource | FrameStream,
    audio: np.ndarray | None,
    fps: int,
    crf: int,
    preset: str,
    audio_bitrate: int,
    threads: int,
    faststart: bool,
    size: tuple[int, int],
    resizer: str,
    check_cancel: Callable[[], None] | None = None,
    prefix: tuple[int, Iterable[np.ndarray]] | None = None,
) -> None:
    import av

    n_prefix, prefix_frames = prefix or (0, ())
    f = n_prefix + video.num_frames
    w, h = size
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(target, mode="w", format="mp4", options=options) as container:
        vs = container.add_stream("libx264", rate=Fraction(fps, 1))
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        vs.codec_context.time_base = Fraction(1, fps)
        vs.options = {"crf": str(crf), "preset": preset}
        if threads > 0:
            vs.codec_context.thread_count = threads
        astream = None
        if audio is not None:
            astream = container.add_stream("aac", rate=AUDIO_SAMPLE_RATE, layout="stereo")
            astream.bit_rate = audio_bitrate

        def source(pixels: Iterable[np.ndarray]):
            for rgb in pixels:
                if check_cancel is not None:
                    check_cancel()  # e.g. the client left: stop encoding now (the caller removes the temp file)
                yield av.VideoFrame.from_ndarray(rgb, format="rgb24")

        frames = source(video)
        if (w, h) != (video.width, video.height):
            frames = RESIZERS[resizer](frames, w, h)
        if n_prefix:  # the source clip an extension continues, at the output size already
            frames = _chain(_counted(source(prefix_frames), n_prefix, "the prefix"), frames)
        # Interleave: after each video frame, feed the audio up to that frame's end time, so the
        # muxer never has to buffer a whole stream. PyAV re-chunks to AAC's 1024-sample frames.
        sent, n = 0, 0
        for i, frame in enumerate(frames):
            if (frame.width, frame.height) != (w, h):
                raise Internal(f"resizer {resizer!r} gave a {frame.width}x{frame.height} frame, not {w}x{h}")
            frame.pts = i
            frame.time_base = Fraction(1, fps)
            container.mux(vs.encode(frame))
            n = i + 1
            if astream is not None:
                upto = audio.shape[1] if i == f - 1 else min(audio.shape[1], (i + 1) * AUDIO_SAMPLE_RATE // fps)
                if upto > sent:
                    aframe = av.AudioFrame.from_ndarray(
                        np.ascontiguousarray(audio[:, sent:upto]), format="fltp", layout="stereo"
                    )
                    aframe.sample_rate = AUDIO_SAMPLE_RATE
                    aframe.pts = sent
                    aframe.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
                    container.mux(astream.encode(aframe))
                    sent = upto
        if n != f:
            raise Internal(f"resizer {resizer!r} gave {n} frames for {f}")
        container.mux(vs.encode(None))
        if astream is not None:
            container.mux(astream.encode(None))


def _chain(*parts: Iterable) -> Iterator:
    for part in parts:
        yield from part


def _counted(frames: Iterable, n: int, what: str) -> Iterator:
    """Exactly `n` of `frames`; fewer is an error naming `what`."""
    k = 0
    for frame in frames:
        if k == n:
            return
        k += 1
        yield frame
    if k < n:
        raise ValueError(f"{what} holds {k} frames, {n} are needed")


def _check_args(fps: int, crf: int, preset: str) -> None:
    if not isinstance(fps, int) or fps < 1:
        raise InvalidArgument(f"fps must be a positive integer, got {fps!r}")
    if not 0 <= crf <= 51:
        raise InvalidArgument(f"crf must be in [0, 51] (x264), got {crf}")
    if preset not in X264_PRESETS:
        raise InvalidArgument(f"unknown x264 preset {preset!r}; choose one of {X264_PRESETS}")


def _encode_to_temp(
    frames, audio, fps, crf, preset, audio_bitrate, threads, faststart, tmp_dir, match_audio, value_range, size,
    resizer, check_cancel=None, prefix=None,
):
    video = frames if isinstance(frames, FrameStream) else _FrameSource(frames, value_range)
    f = video.num_frames + (prefix[0] if prefix else 0)
    w, h = size or (video.width, video.height)
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs even width and height, got {w}x{h}")
    if resizer not in RESIZERS:
        raise InvalidArgument(f"unknown resizer {resizer!r}; one of {sorted(RESIZERS)}")
    n_audio = audio_samples(f, fps) if match_audio else None
    pcm = None if audio is None else _prepare_audio(audio, n_audio)
    fd, tmp = tempfile.mkstemp(prefix=".mux-", suffix=".mp4.tmp", dir=tmp_dir)
    os.close(fd)
    t0 = time.perf_counter()
    try:
        _encode(tmp, video, pcm, fps, crf, preset, audio_bitrate, threads, faststart, (w, h), resizer, check_cancel,
                prefix)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    info = MuxInfo(
        num_frames=f,
        width=w,
        height=h,
        fps=fps,
        audio_samples=0 if pcm is None else pcm.shape[1],
        sample_rate=AUDIO_SAMPLE_RATE,
        num_bytes=os.path.getsize(tmp),
        encode_seconds=time.perf_counter() - t0,
    )
    return tmp, info


def write_mp4(
    path_or_file: PathOrFile,
    frames,
    audio=None,
    *,
    fps: int = FPS,
    crf: int = DEFAULT_CRF,
    preset: str = DEFAULT_PRESET,
    audio_bitrate: int = DEFAULT_AUDIO_BITRATE,
    threads: int = 0,
    faststart: bool = True,
    match_audio_to_video: bool = True,
    value_range: tuple[float, float] = (0.0, 1.0),
    size: tuple[int, int] | None = None,
    resizer: str = "lanczos",
    check_cancel: Callable[[], None] | None = None,
    prefix: tuple[int, Iterable[np.ndarray]] | None = None,
) -> MuxInfo:
    """Encode frames (+ optional stereo 32 kHz audio) as H.264 yuv420p / AAC in MP4.

    `frames`: uint8 `[F, H, W, 3]` or float `[3, F, H, W]` in [0, 1], or a `FrameStream` of such chunks; `audio`:
    float `[2, N]` at 32000 Hz, for the whole MP4 (prefix included). `prefix` (n, frames): an extension's source
    clip, n uint8 `[H, W, 3]` frames already at the output size, muxed before `frames`.
    `path_or_file`: a path (temp file in the same directory + atomic rename) or a writable binary
    file object (receives the finished bytes only after encoding succeeded). `threads=0` lets x264
    pick (all cores). `match_audio_to_video` trims / zero-pads the audio to round(F * 32000 / fps)
    samples. `value_range` applies to float frames only. `size` (width, height): the output size when it differs
    from the frames' (scaled by `RESIZERS[resizer]`, see the module notes). `check_cancel` is called before each
    frame and may raise to abandon the encode (nothing is left behind). Returns a `MuxInfo`.
    """
    _check_args(fps, crf, preset)
    is_path = isinstance(path_or_file, (str, os.PathLike))
    if is_path:
        dest = Path(path_or_file)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = dest.parent
    else:
        if not hasattr(path_or_file, "write"):
            raise ValueError("path_or_file must be a path or a writable binary file object")
        tmp_dir = None
    tmp, info = _encode_to_temp(
        frames, audio, fps, crf, preset, audio_bitrate, threads, faststart, tmp_dir, match_audio_to_video, value_range,
        size, resizer, check_cancel, prefix,
    )
    try:
        if is_path:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
        else:
            with open(tmp, "rb") as fh:
                shutil.copyfileobj(fh, path_or_file, DEFAULT_CHUNK_BYTES)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return info


def write_wav(
    path: str | os.PathLike,
    audio,
    sample_rate: int = AUDIO_SAMPLE_RATE,
    subtype: str = "PCM_16",
) -> Path:
    """Stereo float `[2, N]` in [-1, 1] -> WAV via soundfile (temp file + atomic rename)."""
    import soundfile as sf

    pcm = _prepare_audio(audio, None)
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        sf.write(tmp, pcm.T, sample_rate, subtype=subtype, format="WAV")
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


__all__ = [
    "DEFAULT_CRF",
    "DEFAULT_PRESET",
    "FrameStream",
    "MuxInfo",
    "RESIZERS",
    "frames_to_uint8",
    "write_mp4",
    "write_wav",
]
