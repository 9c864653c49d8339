"""Keyframe images: decode PNG/JPEG bytes and fit them onto the render canvas.

Shared by the decoder (VAE-encodes the keyframe) and the encoder (shows the same pixels to the vision tower), so
both stages see exactly the same canvas-sized image. Errors are InvalidArgument with the reason.

Admission (docs/reliability.md, "Image bombs"): a stage reads only the image header in its request handler
(`admit_keyframe`: format, pixel count against what the render canvas can use), and decodes the image as part of the
job, on the stage's one worker thread, with the decode's memory counted in the job's estimate (`Keyframe.load`).

Canvas fit: "cover" — scale so the image covers width x height (LANCZOS), then center-crop. diffusers' fl2va
stretches the first keyframe onto the canvas and cover-crops the second; cover-cropping both keeps the aspect of
either one (an image already at the canvas size is untouched in both recipes).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minimax_h3.contract import SIZE_MULTIPLE, check_canvas as check_render_canvas
from stagekit.errors import InvalidArgument

if TYPE_CHECKING:  # imported where pixels are made: the client admits a keyframe file with PIL alone
    import torch

MAX_IMAGE_BYTES = 6 << 20          # one gRPC message (8 MiB limit) with room for the rest of the request
# A keyframe may have up to this many times the canvas's pixels per side (16x its area) before it is decoded: more
# is never needed to cover the canvas, and it bounds what a small file can cost (an 8000x8000 PNG is a few hundred
# KB but 190 MB of pixels). JPEGs above it are decoded at a reduced DCT scale when that brings them under it.
KEYFRAME_MAX_SCALE = 4
DECODE_BYTES_PER_PIXEL = 8         # the decoded image (up to RGBA) + its RGB conversion, while it is fitted


def check_canvas(width: int, height: int) -> None:
    """The keyframe's target: a valid render canvas (the render size), checked before any image is read."""
    for name, v in (("width", width), ("height", height)):
        if v <= 0 or v % SIZE_MULTIPLE:
            raise InvalidArgument(f"keyframe target {name}={v} must be a positive multiple of {SIZE_MULTIPLE} "
                                  "(the render size)")
    check_render_canvas(width, height)


def keyframe_pixel_cap(width: int, height: int) -> int:
    return KEYFRAME_MAX_SCALE * KEYFRAME_MAX_SCALE * width * height


@dataclass(frozen=True)
class Keyframe:
    """A keyframe admitted from its header alone (nothing decoded yet): `load()` decodes and fits it, on the
    stage's worker thread; `decode_bytes` is what that costs, counted in the job's memory estimate."""

    data: bytes | torch.Tensor     # file bytes, or uint8 [H, W, 3] pixels
    width: int                     # canvas
    height: int
    decoded: tuple[int, int]       # (w, h) the decode produces
    draft: bool = False            # JPEG decoded at a reduced DCT scale

    @property
    def decode_bytes(self) -> int:
        return self.decoded[0] * self.decoded[1] * DECODE_BYTES_PER_PIXEL

    def load(self) -> torch.Tensor:
        """-> the canvas-sized uint8 [height, width, 3] keyframe."""
        if not isinstance(self.data, (bytes, bytearray)):
            return fit_to_canvas(self.data, self.width, self.height)
        return fit_to_canvas(_decode(self.data, self.width, self.height, self.draft), self.width, self.height)


def admit_keyframe(data: bytes | torch.Tensor, width: int, height: int) -> Keyframe:
    """Check a keyframe from its header only (format, size against the canvas); raises InvalidArgument."""
    check_canvas(width, height)
    cap = keyframe_pixel_cap(width, height)
    if not isinstance(data, (bytes, bytearray, memoryview)):  # uint8 [H, W, 3] pixels
        h, w = int(data.shape[0]), int(data.shape[1])
        _check_pixels(w, h, width, height, cap)
        return Keyframe(data, width, height, (w, h))
    from PIL import Image

    data = bytes(data)
    with _open(data) as im:
        size, draft = im.size, False
        if size[0] * size[1] > cap and im.format == "JPEG":
            scale = max(width / size[0], height / size[1])
            im.draft("RGB", (math.ceil(size[0] * scale), math.ceil(size[1] * scale)))
            size, draft = im.size, True
        _check_pixels(size[0], size[1], width, height, cap)
        if size[0] * size[1] > Image.MAX_IMAGE_PIXELS:
            raise InvalidArgument(f"keyframe image is {size[0]}x{size[1]}, too large to decode")
    return Keyframe(data, width, height, size, draft)


def _check_pixels(w: int, h: int, width: int, height: int, cap: int) -> None:
    if w * h > cap:
        raise InvalidArgument(
            f"keyframe image is {w}x{h} ({w * h / 1e6:.1f} MP); a {width}x{height} render needs at most {cap / 1e6:.1f} "
            f"MP ({KEYFRAME_MAX_SCALE}x the canvas per side): downscale the image to about {width}x{height} first")


def _open(data: bytes):
    """PIL image over `data` with its header read (nothing decoded); InvalidArgument for anything unreadable."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidArgument("keyframe image is empty (0 bytes); send PNG or JPEG file bytes")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidArgument(f"keyframe image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes")
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # its message names the in-memory buffer, which tells the user nothing
        raise InvalidArgument("keyframe is not a readable PNG/JPEG image (not an image format PIL knows)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidArgument(f"keyframe is not a readable PNG/JPEG image ({type(e).__name__}: {e})") from None
    if im.format not in ("PNG", "JPEG", "WEBP", "BMP"):
        im.close()
        raise InvalidArgument(f"keyframe image format {im.format} is not supported; use PNG or JPEG")
    return im


def _decode(data: bytes, width: int, height: int, draft: bool) -> torch.Tensor:
    """PNG/JPEG/WebP bytes -> uint8 [H, W, 3] RGB (alpha dropped over black, palette/greyscale expanded)."""
    import numpy as np
    import torch
    from PIL import Image

    with _open(data) as im:
        try:
            if draft:
                scale = max(width / im.width, height / im.height)
                im.draft("RGB", (math.ceil(im.width * scale), math.ceil(im.height * scale)))
            im.load()
            rgb = im.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise InvalidArgument(f"keyframe is not a readable PNG/JPEG image ({type(e).__name__}: {e})") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


def fit_to_canvas(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """uint8 [H, W, 3] -> uint8 [height, width, 3]: cover-resize (LANCZOS) + center crop; identity at the size."""
    import numpy as np
    import torch
    from PIL import Image

    for name, v in (("width", width), ("height", height)):
        if v <= 0 or v % SIZE_MULTIPLE:
            raise InvalidArgument(f"keyframe target {name}={v} must be a positive multiple of {SIZE_MULTIPLE}")
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3 \
            or min(image.shape[:2]) < 1:
        got = f"{image.dtype} {list(image.shape)}" if isinstance(image, torch.Tensor) else type(image).__name__
        raise InvalidArgument(f"keyframe pixels must be uint8 [H, W, 3] RGB, got {got}")
    h, w = int(image.shape[0]), int(image.shape[1])
    if (w, h) == (width, height):
        return image.contiguous()
    scale = max(width / w, height / h)
    size = (max(width, round(w * scale)), max(height, round(h * scale)))
    im = Image.fromarray(image.numpy()).resize(size, Image.Resampling.LANCZOS)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    im = im.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy())


def load_keyframe(data: bytes | torch.Tensor, width: int, height: int) -> torch.Tensor:
    """File bytes (or uint8 [H, W, 3] pixels) -> the canvas-sized uint8 [height, width, 3] keyframe (admission and
    decode in one go; stages split them with `admit_keyframe` + `Keyframe.load`)."""
    return admit_keyframe(data, width, height).load()
