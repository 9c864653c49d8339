"""Keyframe images: decode PNG/JPEG bytes and fit them onto the render canvas.

Shared by the decoder (VAE-encodes the keyframe) and the encoder (shows the same pixels to the vision tower), so
both stages see exactly the same canvas-sized image. Errors are InvalidArgument with the reason.

Canvas fit: "cover" — scale so the image covers width x height (LANCZOS), then center-crop. diffusers' fl2va
stretches the first keyframe onto the canvas and cover-crops the second; cover-cropping both keeps the aspect of
either one (an image already at the canvas size is untouched in both recipes).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from stagekit.errors import InvalidArgument

if TYPE_CHECKING:  # numpy and torch are imported where pixels are made: the client checks files with PIL alone
    import torch
    from PIL import Image

MAX_IMAGE_BYTES = 6 << 20          # one gRPC message (8 MiB limit) with room for the rest of the request
MAX_IMAGE_PIXELS = 64 << 20        # refuse decompression bombs before decoding them
CANVAS_MULTIPLE = 32               # H3 canvases (VAE /16, DiT patch 2)


def open_image(data: bytes) -> "Image.Image":
    """PNG/JPEG/WebP/BMP bytes -> an RGB PIL image (alpha dropped over black, palette/greyscale expanded), or
    InvalidArgument saying why not. Needs only PIL (the client checks a keyframe file with it before a render)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidArgument("keyframe image is empty (0 bytes); send PNG or JPEG file bytes")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidArgument(f"keyframe image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES} bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise InvalidArgument(f"keyframe image is {im.width}x{im.height}, more than {MAX_IMAGE_PIXELS} pixels")
            if im.format not in ("PNG", "JPEG", "WEBP", "BMP"):
                raise InvalidArgument(f"keyframe image format {im.format} is not supported; use PNG or JPEG")
            im.load()
            return im.convert("RGB")
    except InvalidArgument:
        raise
    except UnidentifiedImageError:  # its message names the in-memory buffer, which tells the user nothing
        raise InvalidArgument("keyframe is not a readable PNG/JPEG image (not an image format PIL knows)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidArgument(f"keyframe is not a readable PNG/JPEG image ({type(e).__name__}: {e})") from None


def decode_image(data: bytes) -> "torch.Tensor":
    """PNG/JPEG/WebP/BMP bytes -> uint8 [H, W, 3] RGB (see `open_image`)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(open_image(data), dtype=np.uint8).copy())


def check_canvas(width: int, height: int) -> None:
    for name, v in (("width", width), ("height", height)):
        if v <= 0 or v % CANVAS_MULTIPLE:
            raise InvalidArgument(f"keyframe target {name}={v} must be a positive multiple of {CANVAS_MULTIPLE} "
                                  "(the render size)")


def fit_to_canvas(image: "torch.Tensor", width: int, height: int) -> "torch.Tensor":
    """uint8 [H, W, 3] -> uint8 [height, width, 3]: cover-resize (LANCZOS) + center crop; identity at the size."""
    import numpy as np
    import torch
    from PIL import Image

    check_canvas(width, height)
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


def load_keyframe(data: "bytes | torch.Tensor", width: int, height: int) -> "torch.Tensor":
    """File bytes (or uint8 [H, W, 3] pixels) -> the canvas-sized uint8 [height, width, 3] keyframe."""
    import torch

    img = data if isinstance(data, torch.Tensor) else decode_image(bytes(data))
    return fit_to_canvas(img, width, height)
