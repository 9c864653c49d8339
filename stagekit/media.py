"""Reference media onto MiniMax-H3's own rates: 24 fps video, the audio VAE's sample rate (docs/references.md).

A reference is conditioned on at the model's clock, so a clip is resampled onto it from the rate its container
states, never assumed: frames through FFmpeg's `fps` filter (whole frames dropped or repeated, each held until the
slot of the next; the last one until the slot the stream's end falls on), audio through libswresample, both driven
by PyAV.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

MODEL_FPS = 24
# Video references are VAE-encoded in whole clips: the frame count is snapped *down* to 17n + 5 (n >= 1), so a clip
# is never padded; a reference shorter than one clip is refused (docs/references.md).
CLIP_FRAMES = 17
CLIP_TAIL = 5
MIN_REFERENCE_FRAMES = CLIP_FRAMES + CLIP_TAIL


def resample_frames(frames: np.ndarray, fps: float, target_fps: int = MODEL_FPS) -> np.ndarray:
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
    if frames < MIN_REFERENCE_FRAMES:
        raise ValueError(f"a video reference needs at least {MIN_REFERENCE_FRAMES} frames at {MODEL_FPS} fps "
                         f"({MIN_REFERENCE_FRAMES / MODEL_FPS:.2f} s), got {frames}")
    return (frames - CLIP_TAIL) // CLIP_FRAMES * CLIP_FRAMES + CLIP_TAIL
