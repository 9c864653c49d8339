"""Qwen3-VL vision tower for fl2va keyframes: config, image preprocessing, presentation, M-RoPE positions.

Facts (docs/model.md §6): the keyframes are shown to the conditioner as
``"<Picture 1>: " + <|vision_start|> + image pads + <|vision_end|> [+ "<Picture 2>: " + block] + prompt``; an image
is resized to multiples of 32 (patch 16 x spatial merge 2; min/max pixel bounds), normalised with mean = std = 0.5,
cut into 16x16 patches repeated over the temporal patch of 2, and yields (H/16)(W/16)/4 merged tokens. Its features
replace the ``<|image_pad|>`` embeddings and its DeepStack features are added to the residual stream after the first
LM layers (transformers' Qwen3-VL does the same). Per-token DiT tags: 1 text, 0 for every vision-block token incl.
the start/end markers.

The tower itself is transformers' ``Qwen3VLVisionModel`` (parameter names == the ComfyUI ``visual.*`` keys minus the
prefix); this module owns only the glue. The M-RoPE positions follow transformers' ``Qwen3VLModel.get_rope_index``
for image blocks: text tokens advance one position each; an image block of (gh, gw) merged tokens is placed at
t = p, h = p + row, w = p + col, and the text after it resumes at p + max(gh, gw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

from minimax_h3.labels import VIDEO_NOT_PRESENTED
from stagekit.errors import InvalidArgument

# Qwen3-VL image-processor constants (preprocessor_config.json of the Qwen3-VL release).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS = 65536            # size.shortest_edge
MAX_PIXELS = 16777216         # size.longest_edge
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


def smart_resize(height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Qwen-VL's target size: multiples of `factor`, pixel count within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [H, W, 3] -> (pixel_values [gh*gw, 3*tp*p*p] float32, grid_thw [3] = (1, gh, gw)), patches in the
    merge-window order the vision tower's merger expects (transformers' Qwen2-VL image processor layout).
    H3 canvases are multiples of 32 within the pixel bounds, so the resize is the identity there; otherwise PIL
    bicubic, like the processor."""
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    h, w = int(image.shape[0]), int(image.shape[1])
    rh, rw = smart_resize(h, w, cfg.factor)
    arr = image.numpy()
    if (rh, rw) != (h, w):
        from PIL import Image

        arr = np.asarray(Image.fromarray(arr).resize((rw, rh), Image.Resampling.BICUBIC))
    x = torch.from_numpy(np.array(arr, dtype=np.uint8)).float().permute(2, 0, 1) / 255.0  # [3, H, W] fp32
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    x = (x - mean) / std
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = rh // p, rw // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = x.unsqueeze(5).expand(*x.shape[:5], tp, p, p)                            # repeat over the temporal patch
    return x.reshape(gh * gw, 3 * tp * p * p).contiguous(), torch.tensor([1, gh, gw], dtype=torch.long)


def reference_parts(encode, references) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    """ref2va presentation (docs/model.md §6) as (text ids before each image block, the images, the text ids after
    the last block): references in request order, labels numbered per kind; an audio reference, and a video's
    soundtrack, is its label alone. `references`: minimax_h3.media.ReferenceMedia; `encode`: text -> token ids."""
    labels, images, pending = [], [], []
    count = {"image": 0, "video": 0, "audio": 0}
    for ref in references:
        if ref.kind == "audio" or ref.audio is not None:  # an audio reference, or a video's soundtrack
            count["audio"] += 1
            pending += encode(AUDIO_LABEL.format(j=count["audio"]))
        if ref.kind == "video":
            raise ValueError(VIDEO_NOT_PRESENTED)
        if ref.kind == "image":
            count["image"] += 1
            pending += encode(PICTURE_LABEL.format(i=count["image"]))
            labels.append(pending)
            images.append(torch.from_numpy(ref.frames[0]))
            pending = []
    return labels, images, pending


def image_token_count(grid_thw: torch.Tensor, cfg: VisionConfig) -> int:
    return int(grid_thw.prod()) // cfg.spatial_merge_size ** 2


@dataclass
class Presentation:
    ids: torch.Tensor          # [L] int64
    tags: torch.Tensor         # [L] int64 DiT tags (1 text, 0 vision block)
    image_mask: torch.Tensor   # [L] bool, the <|image_pad|> rows (vision features go there)
    position_ids: torch.Tensor  # [3, L] int64 M-RoPE (t, h, w)


def build_presentation(label_ids: list[list[int]], prompt_ids: list[int], grids: list[torch.Tensor],
                       vision_start: int, vision_end: int, image_pad: int, cfg: VisionConfig) -> Presentation:
    """Token ids, DiT tags and M-RoPE positions of ``label_i + block_i ... + prompt`` (see module doc)."""
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
    for lab, grid in zip(label_ids, grids):
        text(lab, TEXT_TAG)
        text([vision_start], VISION_TAG)
        gh, gw = int(grid[1]) // m, int(grid[2]) // m
        n = gh * gw
        ids.extend([image_pad] * n)
        tags.extend([VISION_TAG] * n)
        is_pad.extend([True] * n)
        hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        pos.append(torch.stack([torch.zeros(n, dtype=torch.long), hh.reshape(-1), ww.reshape(-1)]) + p)
        p += max(gh, gw)
        text([vision_end], VISION_TAG)
    text(prompt_ids, TEXT_TAG)
    return Presentation(ids=torch.tensor(ids, dtype=torch.long), tags=torch.tensor(tags, dtype=torch.long),
                        image_mask=torch.tensor(is_pad, dtype=torch.bool), position_ids=torch.cat(pos, dim=1))
