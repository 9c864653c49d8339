"""Qwen3-VL vision tower glue: config, image and video preprocessing, presentations, M-RoPE positions.

Facts (docs/model.md §6): keyframes (fl2va) are shown to the conditioner as
``"<Picture 1>: " + <|vision_start|> + image pads + <|vision_end|> [+ "<Picture 2>: " + block] + prompt``; an image
is resized to multiples of 32 (patch 16 x spatial merge 2; min/max pixel bounds), normalised with mean = std = 0.5,
cut into 16x16 patches repeated over the temporal patch of 2, and yields (H/16)(W/16)/4 merged tokens. A ref2va
video reference is read at 2 fps from its 24 fps frames (every 12th frame), the sampled frames are paired over the
temporal patch (the last repeated when their count is odd) and each pair is one vision block of ``<|video_pad|>``
tokens after its ``"<T.T seconds>"`` label (the mean of the pair's 2 fps timestamps, ``%.1f``). Vision features
replace the pad embeddings and the DeepStack features are added to the residual stream after the first LM layers
(transformers' Qwen3-VL does the same). Per-token DiT tags: 1 text, 0 for every vision-block token incl. the
start/end markers.

The tower itself is transformers' ``Qwen3VLVisionModel`` (parameter names == the ComfyUI ``visual.*`` keys minus the
prefix); this module owns only the glue. The tower attends within one temporal patch at a time, so a video of grid
(t, gh, gw) is the same work as t blocks of grid (1, gh, gw), which is how it is run here. The M-RoPE positions
follow transformers' ``Qwen3VLModel.get_rope_index``: text tokens advance one position each; a vision block of
(gh, gw) merged tokens (an image, or one temporal patch of a video) is placed at t = p, h = p + row, w = p + col, and
the text after it resumes at p + max(gh, gw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

from minimax_h3.contract import FPS
from stagekit.errors import InvalidArgument

# Qwen3-VL image-processor constants (preprocessor_config.json of the Qwen3-VL release).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS = 65536            # size.shortest_edge
MAX_PIXELS = 16777216         # size.longest_edge
# Qwen3-VL video-processor constants (video_preprocessor_config.json): bounds on frames x height x width.
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824
VIDEO_SAMPLE_FPS = 2          # the rate the conditioner reads a video reference at
TEXT_TAG, VISION_TAG = 1, 0   # DiT modality tags of presentation rows (§2.6: vision blocks use the video tag)
PICTURE_LABEL = "<Picture {i}>: "
AUDIO_LABEL = "<Audio {j}>: "
VIDEO_LABEL = "<Video {k}>: "


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 5120           # = the LM hidden size
    num_position_embeddings: int = 2304   # learned 48x48 position grid, resampled per image
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def full(cls) -> "VisionConfig":
        # Qwen3-VL's vision tower (the 32B checkpoint's dims are inferred from the file when it carries them).
        return cls()

    @classmethod
    def tiny(cls, out_hidden_size: int = 64) -> "VisionConfig":
        return cls(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=out_hidden_size,
                   num_position_embeddings=64, deepstack_visual_indexes=(0, 2))

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge_size

    def hf_config(self, attn_implementation: str = "sdpa") -> Qwen3VLVisionConfig:
        c = Qwen3VLVisionConfig(
            depth=self.depth, hidden_size=self.hidden_size, hidden_act=self.hidden_act,
            intermediate_size=self.intermediate_size, num_heads=self.num_heads, in_channels=3,
            patch_size=self.patch_size, spatial_merge_size=self.spatial_merge_size,
            temporal_patch_size=self.temporal_patch_size, out_hidden_size=self.out_hidden_size,
            num_position_embeddings=self.num_position_embeddings,
            deepstack_visual_indexes=list(self.deepstack_visual_indexes),
        )
        c._attn_implementation = attn_implementation
        return c


def infer_vision_config(shapes: dict[str, tuple[int, ...]], base: VisionConfig) -> VisionConfig:
    """Dims from the ``visual.*`` shapes (module-relative names); head count / deepstack layer indexes cannot be
    read off shapes and come from ``base`` (scaled to the depth when it differs)."""
    import re

    def count(pattern: str) -> int:
        ids = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
        return max(ids) + 1 if ids else 0

    pe = shapes["patch_embed.proj.weight"]  # [hidden, 3, tp, p, p]
    depth = count(r"blocks\.(\d+)\.")
    n_ds = count(r"deepstack_merger_list\.(\d+)\.")
    ds = base.deepstack_visual_indexes
    if len(ds) != n_ds or (ds and max(ds) >= depth):
        ds = tuple(round((j + 1) * depth / (n_ds + 1)) - 1 for j in range(n_ds))
    return VisionConfig(
        depth=depth, hidden_size=pe[0], num_heads=base.num_heads if pe[0] % base.num_heads == 0 else pe[0] // 64,
        intermediate_size=shapes["blocks.0.mlp.linear_fc1.weight"][0], patch_size=pe[-1], temporal_patch_size=pe[2],
        spatial_merge_size=int(math.isqrt(shapes["merger.linear_fc1.weight"][1] // pe[0])),
        out_hidden_size=shapes["merger.linear_fc2.weight"][0],
        num_position_embeddings=shapes["pos_embed.weight"][0], deepstack_visual_indexes=ds,
        hidden_act=base.hidden_act)


def smart_resize(height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                 frames: int = 1, temporal_patch: int = 1) -> tuple[int, int]:
    """Qwen-VL's target size: multiples of `factor`, aspect kept, the pixel count within [min_pixels, max_pixels].
    A video counts its `frames` (rounded to the temporal patch, half to even) times its pixels (the video processor's
    rule, with VIDEO_MIN_PIXELS / VIDEO_MAX_PIXELS); an image is one frame."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_patch) * temporal_patch
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalize(x: torch.Tensor, fused: bool) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32 (x / 255 - mean) / std: the image processor's two steps, or the video
    processor's one (mean and std scaled by 255 instead), which round differently in the last bit."""
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    if fused:
        return (x.float() - mean * 255) / (std * 255)
    return (x.float() / 255.0 - mean) / std


def _patchify(x: torch.Tensor, cfg: VisionConfig) -> torch.Tensor:
    """float [T, 3, H, W] (T a multiple of the temporal patch) -> [T/tp * H/p * W/p, 3 * tp * p * p]: patches in the
    merge-window order the tower's merger expects (t, then merged rows, merged columns, the window's rows/columns),
    each patch channel-major over (channel, frame of the temporal patch, y, x)."""
    t, c, h, w = x.shape
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gt, gh, gw = t // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p).contiguous()


def preprocess_image(image: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [H, W, 3] -> (pixel_values [gh*gw, 3*tp*p*p] float32, grid_thw [3] = (1, gh, gw)), the image repeated
    over the temporal patch (transformers' Qwen2-VL image processor layout). H3 canvases are multiples of 32 within
    the pixel bounds, so the resize is the identity there; otherwise PIL bicubic, like the processor."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    h, w = int(image.shape[0]), int(image.shape[1])
    rh, rw = smart_resize(h, w, cfg.factor)
    arr = image.numpy()
    if (rh, rw) != (h, w):
        from PIL import Image

        arr = np.asarray(Image.fromarray(arr).resize((rw, rh), Image.Resampling.BICUBIC))
    x = _normalize(torch.from_numpy(np.array(arr, dtype=np.uint8)).permute(2, 0, 1), fused=False)  # [3, H, W]
    x = x.unsqueeze(0).expand(cfg.temporal_patch_size, -1, -1, -1)
    return _patchify(x, cfg), torch.tensor([1, rh // cfg.patch_size, rw // cfg.patch_size], dtype=torch.long)


def _resize_bicubic(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> uint8 [N, 3, height, width]: antialiased bicubic (the video processor's resize)."""
    x = torch.nn.functional.interpolate(frames.float(), size=(height, width), mode="bicubic", antialias=True,
                                        align_corners=False)
    return x.clamp_(0, 255).round_().to(torch.uint8)


def preprocess_video(frames: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, H, W, 3] sampled frames -> (pixel_values [gt*gh*gw, 3*tp*p*p] float32, grid_thw [3] = (gt, gh, gw)):
    the video processor's size rule over all N frames, the last frame repeated up to a multiple of the temporal
    patch, consecutive frames paired in each patch (transformers' Qwen3-VL video processor layout)."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"video frames must be uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    n, h, w = (int(d) for d in frames.shape[:3])
    tp = cfg.temporal_patch_size
    if n < tp:
        raise ValueError(f"a video shows the vision tower at least {tp} frames, got {n}")
    rh, rw = smart_resize(h, w, cfg.factor, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, frames=n, temporal_patch=tp)
    x = frames.permute(0, 3, 1, 2)  # [N, 3, H, W]
    if (rh, rw) != (h, w):
        x = _resize_bicubic(x, rh, rw)
    x = _normalize(x, fused=True)
    if pad := -n % tp:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    grid = torch.tensor([x.shape[0] // tp, rh // cfg.patch_size, rw // cfg.patch_size], dtype=torch.long)
    return _patchify(x, cfg), grid


def sample_video(frames: int, temporal_patch: int, fps: float = FPS,
                 sample_fps: float = VIDEO_SAMPLE_FPS) -> tuple[list[int], list[float]]:
    """The frames of a `fps` clip the conditioner reads (every fps / sample_fps-th, rounded half to even, no repeats)
    and the timestamp of each vision block: the mean of its temporal patch's sampled timestamps (i / sample_fps), the
    last one repeated to fill the patch."""
    stride = fps / sample_fps
    indices, cursor = [], 0.0
    while round(cursor) < frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        raise InvalidArgument(f"a video reference is read at {sample_fps:g} fps in pairs of frames: it needs at "
                              f"least {round((temporal_patch - 1) * stride) + 1} frames at {fps:g} fps, got {frames}")
    stamps = [i / sample_fps for i in range(len(indices))]
    stamps += [stamps[-1]] * (-len(stamps) % temporal_patch)
    blocks = [(stamps[i] + stamps[i + temporal_patch - 1]) / 2 for i in range(0, len(stamps), temporal_patch)]
    return indices, blocks


@dataclass(frozen=True)
class VisionItem:
    """What one keyframe or reference shows the vision tower, with the text ids before each of its vision blocks."""

    kind: str                    # "image": pixels [1, H, W, 3]; "video": [N, H, W, 3] frames sampled at 2 fps
    pixels: torch.Tensor         # uint8
    labels: list[list[int]]      # one per block: an image has 1, a video ceil(N / temporal patch)


def keyframe_items(encode, images: list[torch.Tensor]) -> list[VisionItem]:
    """fl2va: ``"<Picture i>: "`` before each keyframe image (uint8 [H, W, 3], canvas-sized, packed order)."""
    return [VisionItem("image", img.unsqueeze(0), [encode(PICTURE_LABEL.format(i=i + 1))])
            for i, img in enumerate(images)]


def reference_parts(encode, references, temporal_patch: int) -> tuple[list[VisionItem], list[int]]:
    """ref2va presentation (docs/model.md §6) as (vision items, the text ids after the last block): references in
    request order, labels numbered per kind; an audio reference, and a video's soundtrack, is its label alone, right
    before the video's; a video is ``"<Video k>: "`` then ``"<T.T seconds>"`` + a block per temporal patch of its 2 fps
    frames. `references`: minimax_h3.media.ReferenceMedia (video frames at 24 fps); `encode`: text -> token ids."""
    items, pending = [], []
    count = {"image": 0, "video": 0, "audio": 0}
    for ref in references:
        if ref.kind == "audio" or ref.audio is not None:  # an audio reference, or a video's soundtrack
            count["audio"] += 1
            pending += encode(AUDIO_LABEL.format(j=count["audio"]))
        if ref.kind == "image":
            count["image"] += 1
            items.append(VisionItem("image", torch.from_numpy(ref.frames[:1]),
                                    [pending + encode(PICTURE_LABEL.format(i=count["image"]))]))
            pending = []
        elif ref.kind == "video":
            count["video"] += 1
            indices, stamps = sample_video(ref.frames.shape[0], temporal_patch)
            pending += encode(VIDEO_LABEL.format(k=count["video"]))
            labels = []
            for stamp in stamps:
                labels.append(pending + encode(f"<{stamp:.1f} seconds>"))
                pending = []
            items.append(VisionItem("video", torch.from_numpy(ref.frames[indices]), labels))
    return items, pending


@dataclass
class Presentation:
    ids: torch.Tensor          # [L] int64
    tags: torch.Tensor         # [L] int64 DiT tags (1 text, 0 vision block)
    vision_mask: torch.Tensor  # [L] bool, the image / video pad rows (vision features go there, in order)
    position_ids: torch.Tensor  # [3, L] int64 M-RoPE (t, h, w)


def build_presentation(blocks: list[tuple[list[int], torch.Tensor, int]], prompt_ids: list[int], vision_start: int,
                       vision_end: int, cfg: VisionConfig) -> Presentation:
    """Token ids, DiT tags and M-RoPE positions of ``label_i + block_i ... + prompt`` (see module doc). `blocks`:
    (text ids before the block, its grid_thw (1, gh, gw), its pad token id) in order."""
    ids: list[int] = []
    tags: list[int] = []
    pos: list[torch.Tensor] = []
    is_pad: list[bool] = []
    p = 0

    def text(toks: list[int], tag: int):
        nonlocal p
        ids.extend(toks)
        tags.extend([tag] * len(toks))
        is_pad.extend([False] * len(toks))
        pos.append(torch.arange(p, p + len(toks)).view(1, -1).expand(3, -1))
        p += len(toks)

    m = cfg.spatial_merge_size
    for lab, grid, pad in blocks:
        text(lab, TEXT_TAG)
        text([vision_start], VISION_TAG)
        gh, gw = int(grid[1]) // m, int(grid[2]) // m
        n = gh * gw
        ids.extend([pad] * n)
        tags.extend([VISION_TAG] * n)
        is_pad.extend([True] * n)
        hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        pos.append(torch.stack([torch.zeros(n, dtype=torch.long), hh.reshape(-1), ww.reshape(-1)]) + p)
        p += max(gh, gw)
        text([vision_end], VISION_TAG)
    text(prompt_ids, TEXT_TAG)
    return Presentation(ids=torch.tensor(ids, dtype=torch.long), tags=torch.tensor(tags, dtype=torch.long),
                        vision_mask=torch.tensor(is_pad, dtype=torch.bool), position_ids=torch.cat(pos, dim=1))
