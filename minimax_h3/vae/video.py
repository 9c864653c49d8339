"""MiniMax-H3 video VAE: causal 3D CNN encoder + non-causal ViT3D decoder (docs/model.md §3.1, §4).

Parameter names are the release / ComfyUI single-file keys (§4.4), so `VideoVAE.state_dict()` keys equal that file's
keys (the file may additionally carry the unused `decoder.mask_token` and the `latents_mean/std` buffers).

Public API used by the stages:
    cfg = VideoVAEConfig.full()
    vae = load_video_vae(path, None, torch.float32, device="cuda", parts="decoder")
    frames = vae.decode(latents)                        # [24, T, h, w] normalised -> [3, F, 16h, 16w] in [0, 1]
    plan = plan_decode(vae.cfg, T, h, w); out = decode_unit(vae, latents, plan[k]); frames = assemble(plan, outs)
    latents = vae.encode(video)                         # [3, F, H, W] in [0, 1] -> normalised posterior mean
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimax_h3.contract import FRAME_CLIP, VIDEO_LATENT_CHANNELS, one_video_latent
from minimax_h3.vae.tiling import (
                                   IMAGENET_MEAN,
                                   IMAGENET_STD,
                                   DecodeUnit,
                                   StreamingAssembler,
                                   assemble,
                                   num_decoded_frames,
                                   plan_decode,
                                   stitch_tiles,
                                   tile_splits,
                                   )
from minimax_h3.kernels.int8 import (QuantSpec, dequantize_convrot, encode_comfy_quant, int8_linear_specs,
                                     quantize_convrot, read_quant_spec)
from stagekit.checkpoints import (FLOAT, Checkpoint, CheckpointError, HeaderEntry, NameMap, TensorReader, TensorSpec,
                                  WeightSource, check_latent_stats, key_report, metadata_json, open_checkpoint)

__all__ = [
    "LATENTS_MEAN", "LATENTS_STD", "IMAGENET_MEAN", "IMAGENET_STD", "CheckpointError", "VideoVAEConfig", "VideoVAE",
    "DecodeUnit", "StreamingAssembler", "plan_decode", "decode_unit", "assemble", "num_decoded_frames",
    "load_video_vae", "inspect_video_vae", "write_tiny_video_vae", "comfy_to_diffusers_state_dict",
    "diffusers_to_comfy_state_dict", "detect_layout",
]

# Per-channel latent statistics (§3.1; `latents_mean/std` of the release `video_vae/config.json`, digits as ComfyUI
# hard-codes them). The DiT works on z_norm = (z - mean) / std.
LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)
LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.96531379222869875, 1.05698859691619875,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946841835975647,
    0.7996809482574463, 0.44988900423049925, 0.7197399735450745, 0.69362932443618775,
    2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525,
)

# Key of the safetensors `__metadata__` entry where `write_tiny_video_vae` stores the config (not in shipped files).
CONFIG_METADATA_KEY = "h3_video_vae_config"
# Threads moving the tensors of a host copy to the device (stagekit/host_copy.py).
STAGED_WORKERS = 8


# ----------------------------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class VideoVAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = VIDEO_LATENT_CHANNELS  # release z_channels = embed_dim
    # encoder (release names ch / ch_mult / num_res_blocks / space_down / time_down)
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 2, 4, 4, 8)
    num_res_blocks: int = 2
    space_down: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    time_down: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_groups: int = 32  # GroupNorm(32, eps 1e-6) applied per frame (`use_t_isolated_gn`)
    norm_eps: float = 1e-6
    padding_mode: str = "reflect"
    # ViT3D decoder (release vit_decoder_kwargs)
    dec_layers: int = 36
    dec_heads: int = 32
    dec_head_dim: int = 64
    dec_registers: int = 4
    dec_ffn_mult: int = 4
    rope_theta: float = 100.0
    rope_dim_ratio: float = 0.75
    dec_eps: float = 1e-5
    # temporal chunking / spatial tiling (vae_clip_length, vae_token_drop, vae_tile_size, vae_tile_overlap_min)
    clip_length: int = FRAME_CLIP
    token_drop: int = 3
    tile_px: int = 256
    tile_overlap_min_px: int = 64
    tiling: bool = True  # released outputs are tiled; switching it off changes the output

    @classmethod
    def full(cls) -> "VideoVAEConfig":
        return cls()

    @classmethod
    def tiny(cls) -> "VideoVAEConfig":
        # Same level structure (spatial /16, temporal /4, 6 levels) and latent format; small widths only.
        return cls(ch=8, norm_groups=4, dec_layers=2, dec_heads=2, dec_head_dim=16, dec_registers=4)

    def __post_init__(self):
        n = len(self.ch_mult)
        if len(self.space_down) != n or len(self.time_down) != n:
            raise ValueError("ch_mult, space_down and time_down must have the same number of levels")
        if any(f not in (1, 2) for f in self.space_down) or any(f not in (1, 2) for f in self.time_down):
            raise ValueError("down-sampling factors must be 1 or 2 per level")
        for c in [self.ch * m for m in self.ch_mult]:
            if c % self.norm_groups:
                raise ValueError(f"encoder width {c} is not divisible by norm_groups={self.norm_groups}")
        if self.rope_dim % 6 or self.rope_dim > self.dec_head_dim:
            raise ValueError(f"rope dim {self.rope_dim} must be a multiple of 6 and <= head dim {self.dec_head_dim}")
        if self.tiling and (self.tile_px % self.spatial_ratio or self.tile_overlap_min_px % self.spatial_ratio):
            raise ValueError(f"tile_px / tile_overlap_min_px must be multiples of {self.spatial_ratio}")

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.space_down)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.time_down)

    @property
    def dec_dim(self) -> int:
        return self.dec_heads * self.dec_head_dim

    @property
    def rope_dim(self) -> int:
        return int(self.dec_head_dim * self.rope_dim_ratio)

    @property
    def block_channels(self) -> tuple[int, ...]:
        return tuple(self.ch * m for m in self.ch_mult)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "VideoVAEConfig":
        d = json.loads(s)
        for k in ("ch_mult", "space_down", "time_down"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)


# ----------------------------------------------------------------------------------------------------------------
# encoder: causal 3D CNN (§4.2)


class CausalConv3d(nn.Conv3d):
    """Conv3d with symmetric spatial padding (`padding_mode`, reflect in the release) and causal temporal padding
    (`t_pad` zero frames in front, none behind), the conv itself unpadded."""

    def __init__(self, cin: int, cout: int, kernel: int, stride=1, s_pad: int = 0, t_pad: int = 0,
                 padding_mode: str = "reflect"):
        super().__init__(cin, cout, kernel_size=kernel, stride=stride, padding=0)
        self.s_pad, self.t_pad, self.pad_mode = s_pad, t_pad, padding_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.s_pad:
            x = F.pad(x, (self.s_pad,) * 4 + (0, 0), mode=self.pad_mode)
        if self.t_pad:
            x = F.pad(x, (0, 0, 0, 0, self.t_pad, 0))
        return F.conv3d(x, self.weight, self.bias, stride=self.stride)


class FrameGroupNorm(nn.Module):
    """GroupNorm whose statistics never mix frames (time folded into batch), computed in fp32."""

    def __init__(self, groups: int, channels: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w).float()
        with torch.autocast(x.device.type, enabled=False):
            y = F.group_norm(y, self.groups, self.weight.float(), self.bias.float(), self.eps)
        return y.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class ResnetBlock3D(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: VideoVAEConfig):
        super().__init__()
        self.norm1 = FrameGroupNorm(cfg.norm_groups, cin, cfg.norm_eps)
        self.conv1 = CausalConv3d(cin, cout, 3, s_pad=1, t_pad=2, padding_mode=cfg.padding_mode)
        self.norm2 = FrameGroupNorm(cfg.norm_groups, cout, cfg.norm_eps)
        self.conv2 = CausalConv3d(cout, cout, 3, s_pad=1, t_pad=2, padding_mode=cfg.padding_mode)
        self.nin_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x.float() + h.float()


class Downsample3D(nn.Module):
    """Stride (t, 2, 2) k3 conv; a spatial stride of 2 gets an extra reflect pad right/bottom so out = ceil(in/2)."""

    def __init__(self, channels: int, t_stride: int, s_stride: int, cfg: VideoVAEConfig):
        super().__init__()
        self.s_stride, self.pad_mode = s_stride, cfg.padding_mode
        self.conv = CausalConv3d(channels, channels, 3, stride=(t_stride, s_stride, s_stride), t_pad=2,
                                 padding_mode=cfg.padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.s_stride == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode=self.pad_mode)
        return self.conv(x)


class EncoderLevel(nn.Module):
    def __init__(self, cin: int, cout: int, level: int, cfg: VideoVAEConfig):
        super().__init__()
        self.block = nn.ModuleList(
            [ResnetBlock3D(cin if j == 0 else cout, cout, cfg) for j in range(cfg.num_res_blocks)])
        s, t = cfg.space_down[level], cfg.time_down[level]
        self.downsample = Downsample3D(cout, t, s, cfg) if s * t > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.block:
            x = blk(x)
        return self.downsample(x) if self.downsample is not None else x


class Encoder3D(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        chans = cfg.block_channels
        self.conv_in = CausalConv3d(cfg.in_channels, chans[0], 3, s_pad=1, t_pad=2, padding_mode=cfg.padding_mode)
        ins = (chans[0],) + chans[:-1]
        self.down = nn.ModuleList([EncoderLevel(ins[l], chans[l], l, cfg) for l in range(len(chans))])
        self.norm_out = FrameGroupNorm(cfg.norm_groups, chans[-1], cfg.norm_eps)
        self.conv_out = CausalConv3d(chans[-1], 2 * cfg.latent_channels, 3, s_pad=1, t_pad=2,
                                     padding_mode=cfg.padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ----------------------------------------------------------------------------------------------------------------
# decoder: ViT3D (§4.3)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x.to(layer.weight.dtype), layer.weight, layer.bias)


def _rms_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Explicitly outside autocast: the reference normalises in fp32 whatever the compute dtype.
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps)


class RMSNorm(nn.Module):
    """RMSNorm with gain, always computed in fp32 (the reference does so regardless of compute dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_fp32(x, self.weight, self.eps)


def rope_angles(t: int, h: int, w: int, n_suffix: int, rope_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, rope_dim] for a t x h x w token grid (order t, h, w) followed by `n_suffix` tokens at (0,0,0).

    Coordinates are length-normalised per axis to the cell centres in [-1, 1); the angle carries a 2*pi factor;
    each axis gets rope_dim/6 frequencies 1/theta^(j/(rope_dim/6)); axes are concatenated, then the whole vector is
    tiled twice for the split-half rotation."""
    n_freq = rope_dim // 6
    inv_freq = 1.0 / theta ** (torch.arange(n_freq, dtype=torch.float32, device=device) / n_freq)
    axes = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (t, h, w)]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    pos = torch.cat([pos, pos.new_zeros(n_suffix, 3)], dim=0)
    ang = (2.0 * math.pi * pos[:, :, None] * inv_freq[None, None, :]).flatten(1).tile(2)
    return ang.cos(), ang.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, S, H, D]; split-half rotation on the first rope_dim channels, the rest pass through.
    rd = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat([xr * cos + torch.cat([-x2, x1], dim=-1) * sin, xp], dim=-1)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        d = cfg.dec_dim
        self.heads, self.head_dim, self.eps = cfg.dec_heads, cfg.dec_head_dim, cfg.dec_eps
        self.to_qkv = nn.Linear(d, 3 * d)  # rows per head interleaved: [h: q(hd) k(hd) v(hd)]
        self.to_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = _linear(x, self.to_qkv).view(b, s, self.heads, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)
        # q/k RMSNorm without gain, in fp32 (as the reference), then back to the compute dtype.
        q = _rms_fp32(q, None, self.eps).to(v.dtype)
        k = _rms_fp32(k, None, self.eps).to(v.dtype)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return _linear(o.transpose(1, 2).reshape(b, s, -1), self.to_out)


class DecoderFeedForward(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        inner = cfg.dec_dim * cfg.dec_ffn_mult
        self.w1 = nn.Linear(cfg.dec_dim, 2 * inner)  # rows [gate; up]
        self.w2 = nn.Linear(inner, cfg.dec_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(x, self.w1).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, self.w2)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.dec_dim, cfg.dec_eps)
        self.attn = DecoderAttention(cfg)
        self.scale1 = nn.Parameter(torch.zeros(cfg.dec_dim))
        self.norm2 = RMSNorm(cfg.dec_dim, cfg.dec_eps)
        self.ff = DecoderFeedForward(cfg)
        self.scale2 = nn.Parameter(torch.zeros(cfg.dec_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Residual stream stays fp32 whatever the matmul dtype (the learned per-channel scales are small).
        x = x + self.attn(self.norm1(x), cos, sin).float() * self.scale1.float()
        return x + self.ff(self.norm2(x)).float() * self.scale2.float()


class ViT3DDecoder(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        d = cfg.dec_dim
        self.cfg = cfg
        self.x_embedder = nn.Linear(cfg.latent_channels, d)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.dec_registers, d))
        self.transformer_blocks = nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg.dec_layers)])
        self.norm_out = nn.LayerNorm(d, eps=cfg.dec_eps)
        self.proj_out = nn.Linear(d, cfg.out_channels * cfg.temporal_ratio * cfg.spatial_ratio ** 2)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, C, t, h, w] (after post_quant_conv) -> [B, 3, 4t, 16h, 16w] ImageNet-normalised pixels."""
        cfg = self.cfg
        b, c, t, h, w = z.shape
        x = _linear(z.permute(0, 2, 3, 4, 1).reshape(b, t * h * w, c), self.x_embedder).float()
        n = x.shape[1]
        # Suffix: learned register tokens + one all-zero token, all at position (0, 0, 0); dropped after the stack.
        x = torch.cat([x, self.register_tokens.float().expand(b, -1, -1), x.new_zeros(b, 1, x.shape[-1])], dim=1)
        cos, sin = rope_angles(t, h, w, cfg.dec_registers + 1, cfg.rope_dim, cfg.rope_theta, z.device)
        for blk in self.transformer_blocks:
            x = blk(x, cos, sin)
        with torch.autocast(x.device.type, enabled=False):
            x = F.layer_norm(x[:, :n], (x.shape[-1],), self.norm_out.weight.float(), self.norm_out.bias.float(),
                             self.norm_out.eps)
        x = _linear(x, self.proj_out).float()
        pt, ps, co = cfg.temporal_ratio, cfg.spatial_ratio, cfg.out_channels
        x = x.view(b, t, h, w, co, pt, ps, ps).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, co, t * pt, h * ps, w * ps)


# ----------------------------------------------------------------------------------------------------------------
# the VAE


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class VideoVAE(nn.Module):
    """H3 video VAE. `parts` = "all" | "encoder" | "decoder" builds only what a stage needs."""

    def __init__(self, cfg: VideoVAEConfig, parts: str = "all"):
        super().__init__()
        if parts not in ("all", "encoder", "decoder"):
            raise ValueError(f"parts must be 'all', 'encoder' or 'decoder', got {parts!r}")
        self.cfg, self.parts = cfg, parts
        # Latent statistics are plain attributes (not buffers) so the state dict stays exactly the file's weights;
        # load_video_vae overrides them when a file carries its own `latents_mean/std`.
        self.latents_mean: tuple[float, ...] = LATENTS_MEAN
        self.latents_std: tuple[float, ...] = LATENTS_STD
        if cfg.latent_channels != len(LATENTS_MEAN):
            self.latents_mean, self.latents_std = (0.0,) * cfg.latent_channels, (1.0,) * cfg.latent_channels
        lc = cfg.latent_channels
        if parts in ("all", "encoder"):
            self.encoder = Encoder3D(cfg)
            self.quant_conv = nn.Conv3d(2 * lc, 2 * lc, 1)
        if parts in ("all", "decoder"):
            self.post_quant_conv = nn.Conv3d(lc, lc, 1)
            self.decoder = ViT3DDecoder(cfg)

    def _stats(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.tensor(self.latents_mean, dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        s = torch.tensor(self.latents_std, dtype=torch.float32, device=device).view(-1, 1, 1, 1)
        return m, s

    # ---- decode -------------------------------------------------------------------------------------------------

    def check_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Validate a `[C, T, h, w]` (or `[1, C, T, h, w]`) normalised latent; returns the 4-D view."""
        if not isinstance(latents, torch.Tensor):
            raise ValueError(f"latents must be a torch.Tensor, got {type(latents).__name__}")
        latents = one_video_latent(latents, "decode")
        c = self.cfg.latent_channels
        if latents.shape[0] != c:
            raise ValueError(f"latents have {latents.shape[0]} channels, the H3 video VAE expects {c} "
                             f"(shape {tuple(latents.shape)} must be [{c}, T, h, w])")
        if min(latents.shape[1:]) < 1:
            raise ValueError(f"latents have an empty axis: shape {tuple(latents.shape)}")
        if not latents.is_floating_point():
            raise ValueError(f"latents must be floating point, got {latents.dtype}")
        if not torch.isfinite(latents).all():
            bad = (~torch.isfinite(latents)).sum().item()
            raise ValueError(f"latents contain {bad} non-finite values (NaN/Inf); refusing to decode")
        return latents

    def decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        """De-normalised latent [B, C, t, h, w] -> raw decoder output [B, 3, 4t, 16h, 16w] (no tiling)."""
        return self.decoder(self.post_quant_conv(z.to(self.post_quant_conv.weight.dtype)))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, autocast_dtype: torch.dtype | None = None,
               finalize: bool = True, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Normalised latents [24, T, h, w] -> frames [3, F, 16h, 16w] float32 in [0, 1] (F = 17n+5 for T = 5n+2).

        Runs the plan unit by unit and streams each finished chunk into the output, so only one chunk's tiles are
        alive at a time. `autocast_dtype=torch.float16` is the reference recipe (fp16 autocast over fp32 weights);
        loading the weights in fp16 (`load_video_vae(..., dtype=torch.float16)`) gives the same matmul precision
        without autocast's per-context weight casts and is the faster serving choice."""
        latents = self.check_latents(latents)
        plan = plan_decode(self.cfg, *latents.shape[1:])
        asm = StreamingAssembler(plan, finalize=finalize, device=out_device)
        # One autocast context for the whole plan: its weight-cast cache then lives for the decode, not per unit.
        with _autocast(self.post_quant_conv.weight.device, autocast_dtype):
            for unit in plan:
                asm.add(unit, decode_unit(self, latents, unit, autocast_dtype=autocast_dtype, validate=False))
        return asm.finish()

    # ---- encode -------------------------------------------------------------------------------------------------

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet-normalised [1, 3, f, H, W] -> moments [1, 2C, t, H/16, W/16], spatially tiled in pixel space and
        blended in latent space (overlap / 16)."""
        r = self.cfg.spatial_ratio
        th, tw = tile_splits(self.cfg, x.shape[-2], x.shape[-1])
        rows = [[self.quant_conv(self.encoder(x[..., hs:hs + hl, ws:ws + wl]).to(self.quant_conv.weight.dtype))
                 .float() for ws, wl in zip(tw.starts, tw.lengths)] for hs, hl in zip(th.starts, th.lengths)]
        return stitch_tiles(rows, [o // r for o in th.overlaps], [o // r for o in tw.overlaps])

    @torch.no_grad()
    def encode_moments(self, video: torch.Tensor, *, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Video [3, F, H, W] in [0, 1] (or uint8) -> raw posterior moments [2C, T, H/16, W/16] (mean; logvar).

        F = 1 is a still image (1 latent frame). Otherwise frames go in 17-frame clips (the last padded by repeating
        its final frame), each clip encoded alone, and the last `token_drop` latent frames of the concatenation
        dropped: F = 17n+5 -> T = 5n+2."""
        if not hasattr(self, "encoder"):
            raise ValueError("this VideoVAE was built with parts='decoder'; load it with parts='all' or 'encoder'")
        x = self._check_video(video)
        dev = self.quant_conv.weight.device
        shape = (1, 3, 1, 1, 1)
        mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=dev).view(shape)
        std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=dev).view(shape)
        n = x.shape[2]
        cl = self.cfg.clip_length
        with _autocast(dev, autocast_dtype):
            if n == 1:
                return self._encode_clip((x.to(dev) - mean) / std)[0]
            parts = []
            for s in range(0, n, cl):
                clip = x[:, :, s:s + cl]
                if clip.shape[2] < cl:
                    clip = torch.cat([clip, clip[:, :, -1:].expand(-1, -1, cl - clip.shape[2], -1, -1)], dim=2)
                parts.append(self._encode_clip((clip.to(dev) - mean) / std))
        moments = torch.cat(parts, dim=2)
        if self.cfg.token_drop > 0:
            moments = moments[:, :, : moments.shape[2] - self.cfg.token_drop]
        return moments[0]

    @torch.no_grad()
    def encode(self, video: torch.Tensor, *, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Video [3, F, H, W] in [0, 1] -> normalised posterior mean [24, T, H/16, W/16] float32 (what the DiT
        consumes; ComfyUI conditions on the mean)."""
        moments = self.encode_moments(video, autocast_dtype=autocast_dtype)
        m, s = self._stats(moments.device)
        return (moments[: self.cfg.latent_channels] - m) / s

    def _check_video(self, video: torch.Tensor) -> torch.Tensor:
        if not isinstance(video, torch.Tensor):
            raise ValueError(f"video must be a torch.Tensor, got {type(video).__name__}")
        if video.ndim == 3:
            video = video.unsqueeze(1)  # [3, H, W] image
        if video.ndim != 4 or video.shape[0] != self.cfg.in_channels:
            raise ValueError(f"video must be [3, F, H, W] (or an image [3, H, W]); got shape {tuple(video.shape)}")
        r = self.cfg.spatial_ratio
        if video.shape[-2] % r or video.shape[-1] % r or min(video.shape[1:]) < 1:
            raise ValueError(f"video height/width must be positive multiples of {r} (H3 canvases are multiples "
                             f"of 32); got {tuple(video.shape[-2:])} — resize or crop first")
        if video.dtype == torch.uint8:
            video = video.float() / 255.0
        elif not video.is_floating_point():
            raise ValueError(f"video must be float in [0, 1] or uint8, got {video.dtype}")
        else:
            video = video.float()
            if not torch.isfinite(video).all():
                raise ValueError("video contains non-finite values (NaN/Inf)")
            lo, hi = video.min().item(), video.max().item()
            if lo < -1e-3 or hi > 1 + 1e-3:
                raise ValueError(f"video values must be in [0, 1] (got min {lo:.4g}, max {hi:.4g}); "
                                 "a [-1, 1] input must be mapped with (x + 1) / 2 first")
        return video.unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------------
# work units


@torch.no_grad()
def decode_unit(model: VideoVAE, latents: torch.Tensor, unit: DecodeUnit, *,
                autocast_dtype: torch.dtype | None = None, validate: bool = True) -> torch.Tensor:
    """Decode one unit of `plan_decode(model.cfg, T, h, w)` from the full normalised latent `[C, T, h, w]`.

    Returns `unit.output_shape()` float32 raw decoder output (ImageNet space; body then tail frames). For speed load
    the weights in fp16/bf16 rather than passing `autocast_dtype` (autocast re-casts all decoder weights, ~4.8 GB,
    on every call made outside an enclosing autocast context). The latent is
    de-normalised per channel (z * std + mean) on the unit's slice only; indices past T-1 repeat the last latent."""
    if not hasattr(model, "decoder"):
        raise ValueError("this VideoVAE was built with parts='encoder'; load it with parts='all' or 'decoder'")
    if validate:
        latents = model.check_latents(latents)
    elif latents.ndim == 5:
        latents = latents[0]
    g = unit.geom
    if (g.latent_t, g.latent_h, g.latent_w) != tuple(latents.shape[1:]):
        raise ValueError(f"unit was planned for latent (T, h, w) = {(g.latent_t, g.latent_h, g.latent_w)}, "
                         f"got {tuple(latents.shape[1:])}")
    dev = model.post_quant_conv.weight.device
    idx = torch.tensor(unit.latent_frame_indices(), device=latents.device)
    z = latents[:, :, unit.h0:unit.h1, unit.w0:unit.w1].index_select(1, idx).to(dev, torch.float32)
    m, s = model._stats(dev)
    z = z * s + m
    with _autocast(dev, autocast_dtype):
        out = model.decode_tile(z[None])[0]
    (a0, a1), (b0, b1) = g.main_frames, g.tail_frames
    keep = out[:, a0:a1] if b1 == b0 else torch.cat([out[:, a0:a1], out[:, b0:b1]], dim=1)
    return keep.float().contiguous()


# ----------------------------------------------------------------------------------------------------------------
# checkpoints

_FP32_PARAM = re.compile(r"(norm1|norm2|norm_out)\.(weight|bias)$|scale[12]$")


def _expected(cfg: VideoVAEConfig, parts: str) -> dict[str, TensorSpec]:
    with torch.device("meta"):
        model = VideoVAE(cfg, parts)
    return {k: TensorSpec(tuple(v.shape), FLOAT) for k, v in model.state_dict().items()}


# The only layers an int8 ConvRot video VAE (ComfyUI's `minimax_h3_video_vae_int8_convrot.safetensors`) stores
# quantised: ComfyUI builds the attention and feed-forward linears of the decoder's blocks with the ops of the file's
# quantisation (one `comfy_quant` descriptor per layer) and every other layer (convolutions, x_embedder, proj_out,
# norms) as a plain float layer, so a descriptor anywhere else describes a file ComfyUI would not load either.
QUANTIZABLE = re.compile(r"^decoder\.transformer_blocks\.\d+\.(attn\.to_qkv|attn\.to_out|ff\.w1|ff\.w2)$")
# ComfyUI's older way of naming the quantised layers: `{"layers": {layer: descriptor}}` in the safetensors metadata
# instead of a U8 `comfy_quant` tensor per layer (ComfyUI turns the one into the other when it loads a file).
QUANT_METADATA_KEY = "_quantization_metadata"
_QUANT_WHERE = ("ComfyUI quantises only the attention and feed-forward linears of the decoder's blocks (attn.to_qkv, "
                "attn.to_out, ff.w1, ff.w2)")


def _quant_layers(ckpt: Checkpoint, layout: str) -> dict[str, QuantSpec]:
    """Layer -> descriptor of every layer the file stores quantised: one with a `comfy_quant` tensor, an entry in the
    metadata's `_quantization_metadata`, or an int8 weight (which then needs one of those). Each descriptor is read
    and checked (int8, its ConvRot group dividing the layer's in_features); both forms of one layer must agree.
    Raises CheckpointError naming file and key."""
    tensors = ckpt.tensors
    meta = metadata_json(ckpt, QUANT_METADATA_KEY) or {}
    if meta and not isinstance(meta.get("layers"), dict):
        raise CheckpointError(ckpt.files[0], f"metadata {QUANT_METADATA_KEY!r} has no 'layers' object")
    described = meta.get("layers", {})
    layers = set(described) | {k[: -len(".comfy_quant")] for k in tensors if k.endswith(".comfy_quant")}
    layers |= {k[: -len(".weight")] for k, e in tensors.items() if k.endswith(".weight") and e.dtype == "I8"}
    if layers and layout == "diffusers":
        layer = min(layers)
        raise CheckpointError(ckpt.files[0], "a quantised layer in a diffusers-layout video VAE: the int8 ConvRot "
                                             "video VAE is a ComfyUI single file", layer + ".weight")
    out: dict[str, QuantSpec] = {}
    reader = TensorReader(tensors)
    try:
        for layer in sorted(layers):
            weight = layer + ".weight"
            if not QUANTIZABLE.match(layer):
                e = tensors.get(weight) or tensors.get(layer + ".comfy_quant")
                raise CheckpointError(e.file if e else ckpt.files[0], f"stored quantised, but {_QUANT_WHERE}",
                                      weight)
            if weight not in tensors:
                raise CheckpointError(ckpt.files[0], "a quantisation descriptor without its weight",
                                      layer + ".comfy_quant")
            spec = read_quant_spec(reader, tensors, weight, described.get(layer),
                                   f"metadata {QUANT_METADATA_KEY!r}")
            if layer in described and layer + ".comfy_quant" in tensors:
                tensor_spec = read_quant_spec(reader, tensors, weight)
                if tensor_spec != spec:
                    raise CheckpointError(tensors[weight].file, f"its comfy_quant tensor ({tensor_spec}) contradicts "
                                                                f"metadata {QUANT_METADATA_KEY!r} ({spec})",
                                          layer + ".comfy_quant")
            out[layer] = spec
    finally:
        reader.close()
    return out


def _file_specs(cfg: VideoVAEConfig, parts: str, quant: dict[str, QuantSpec],
                tensors: dict[str, HeaderEntry]) -> dict[str, TensorSpec]:
    """What the file must hold for `parts`: `_expected`, with each quantised layer's weight as int8 beside its per-row
    scale (and its `comfy_quant` tensor when the file describes it that way)."""
    specs = _expected(cfg, parts)
    for layer in quant:
        spec = specs.get(layer + ".weight")
        if spec is None:  # a layer of the other half, or of a block the config does not have (reported unexpected)
            continue
        int8 = int8_linear_specs(layer, *spec.shape, make=lambda shape, dtypes, _store: TensorSpec(shape, dtypes))
        if layer + ".comfy_quant" not in tensors:
            del int8[layer + ".comfy_quant"]
        specs.update(int8)
    return specs


# Our (release / ComfyUI) names <-> diffusers' AutoencoderKLMiniMaxH3, beyond which two tensors change form: the fused
# per-head interleaved `attn.to_qkv` [h: q k v] is diffusers' separate to_q / to_k / to_v, and `ff.w1` rows
# [gate; up] are diffusers' `ff.net.0.proj` rows [up; gate] (docs/checkpoints.md).
DIFFUSERS_NAMES = NameMap((
    ("^decoder.x_embedder.", "^decoder.proj_in."),
    ("^encoder.down.#.block.#.", "^encoder.down_blocks.#.resnets.#."),
    ("^encoder.down.#.downsample.conv.", "^encoder.down_blocks.#.downsamplers.0.conv."),
    (".nin_shortcut.", ".conv_shortcut."),
    (".attn.to_out.", ".attn.to_out.0."),
    (".ff.w2.", ".ff.net.2."),
    (".ff.w1.", ".ff.net.0.proj."),
    (".attn.to_qkv.", ".attn.to_q."),
))
_QKV_PARTS = ("to_q", "to_k", "to_v")


def _qkv_parts(diffusers_q_key: str) -> list[str]:
    return [diffusers_q_key.replace(".attn.to_q.", f".attn.{p}.") for p in _QKV_PARTS]


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def comfy_to_diffusers_state_dict(sd: dict[str, torch.Tensor], cfg: VideoVAEConfig) -> dict[str, torch.Tensor]:
    """Native (release/ComfyUI) state dict -> `AutoencoderKLMiniMaxH3` state dict. Extra buffers are dropped."""
    known = set(_expected(cfg, "all"))
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k not in known:
            continue
        name = DIFFUSERS_NAMES.to_source(k)
        if ".attn.to_qkv." in k:  # per-head interleaved [h: q k v] -> separate to_q / to_k / to_v
            t = v.reshape(cfg.dec_heads, 3, cfg.dec_head_dim, *v.shape[1:])
            for n, part in enumerate(_qkv_parts(name)):
                out[part] = t[:, n].reshape(cfg.dec_dim, *v.shape[1:]).clone()
        else:
            out[name] = _swap_halves(v) if ".ff.w1." in k else v  # native [gate; up], diffusers [up; gate]
    return out


def diffusers_to_comfy_state_dict(sd: dict[str, torch.Tensor], cfg: VideoVAEConfig) -> dict[str, torch.Tensor]:
    """`AutoencoderKLMiniMaxH3` state dict -> native keys. Unknown keys are kept under their diffusers name so the
    key check reports them."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if ".attn.to_k." in k or ".attn.to_v." in k:
            if k.replace(".to_k.", ".to_q.").replace(".to_v.", ".to_q.") not in sd:
                out[k] = v  # without its to_q: reported as unexpected
            continue
        ours = DIFFUSERS_NAMES.from_source(k)
        if ".attn.to_q." in k:
            parts = _qkv_parts(k)
            missing = [p for p in parts if p not in sd]
            if missing:
                raise CheckpointError("<state dict>", f"incomplete q/k/v set: missing {missing}", k)
            rest = v.shape[1:]
            t = torch.stack([sd[p].reshape(cfg.dec_heads, cfg.dec_head_dim, *rest) for p in parts], dim=1)
            out[ours] = t.reshape(3 * cfg.dec_dim, *rest)
        else:
            out[ours] = _swap_halves(v) if ".ff.w1." in ours else v
    return out


def _config_from_diffusers(d: dict) -> tuple[VideoVAEConfig, tuple | None, tuple | None]:
    boc = tuple(d.get("block_out_channels", (128, 256, 256, 512, 512, 1024)))
    ch = boc[0]
    cfg = VideoVAEConfig(
        in_channels=d.get("in_channels", 3), out_channels=d.get("out_channels", 3),
        latent_channels=d.get("latent_channels", VIDEO_LATENT_CHANNELS), ch=ch, ch_mult=tuple(c // ch for c in boc),
        num_res_blocks=d.get("layers_per_block", 2),
        space_down=tuple(d.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1))),
        time_down=tuple(d.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1))),
        norm_groups=d.get("norm_num_groups", 32), norm_eps=d.get("norm_eps", 1e-6),
        padding_mode=d.get("spatial_padding_mode", "reflect"), dec_layers=d.get("decoder_num_layers", 36),
        dec_heads=d.get("decoder_num_attention_heads", 32), dec_head_dim=d.get("decoder_attention_head_dim", 64),
        dec_registers=d.get("decoder_num_register_tokens", 4), dec_ffn_mult=d.get("decoder_ffn_mult", 4),
        rope_theta=d.get("decoder_rope_theta", 100.0), rope_dim_ratio=d.get("decoder_rope_dim_ratio", 0.75),
        dec_eps=d.get("decoder_norm_eps", 1e-5), clip_length=d.get("clip_length", FRAME_CLIP),
        token_drop=d.get("token_drop", 3),
    )
    lm, ls = d.get("latents_mean"), d.get("latents_std")
    return cfg, (tuple(lm) if lm else None), (tuple(ls) if ls else None)


_TOLERATED_EXTRA = ("decoder.mask_token", "latents_mean", "latents_std")


def detect_layout(path: str) -> str:
    """'diffusers' (diffusers names, e.g. `decoder.proj_in`), 'release' (fp32 native keys) or 'comfy' (native,
    fp16/bf16); a folder is judged by the files in it."""
    return _layout(open_checkpoint(path).tensors)


def _layout(tensors: dict[str, HeaderEntry]) -> str:
    if "decoder.proj_in.weight" in tensors or any(k.startswith("encoder.down_blocks.") for k in tensors):
        return "diffusers"
    dtypes = {e.dtype for k, e in tensors.items() if not k.startswith("latents_")}
    return "release" if dtypes == {"F32"} else "comfy"


@dataclass
class VideoVAEInfo:
    """A video VAE checkpoint as validated from its headers (no tensor data read)."""

    path: str
    layout: str  # "comfy" | "release" | "diffusers"
    cfg: VideoVAEConfig
    config_source: str  # "given config" | "config.json" | "metadata" | "H3 release geometry"
    ckpt: Checkpoint
    latents_mean: tuple[float, ...] | None = None  # the file's, else a diffusers config.json's (checked)
    latents_std: tuple[float, ...] | None = None
    quant: dict[str, QuantSpec] = field(default_factory=dict)  # int8 ConvRot layers (dequantised at load)

    @property
    def storage(self) -> str:
        """How the weights are stored: "int8_convrot" (with how many linears, when not all of the decoder's), or the
        float dtype(s) of the file ("fp16", "fp32", ...)."""
        if self.quant:
            total = 4 * self.cfg.dec_layers
            return "int8_convrot" + ("" if len(self.quant) == total else f" ({len(self.quant)} of {total} linears)")
        names = {"F16": "fp16", "BF16": "bf16", "F32": "fp32", "F64": "fp64"}
        dtypes = {e.dtype for k, e in self.ckpt.tensors.items() if not k.startswith("latents_")}
        return "+".join(sorted(names.get(d, d) for d in dtypes))


def inspect_video_vae(path: str, cfg: VideoVAEConfig | None = None, parts: str = "all") -> VideoVAEInfo:
    """Layout, config and a check of every tensor `parts` needs (keys, shapes, float dtypes), from the headers.

    The config is, in order: `cfg`; a diffusers folder's config.json; the file's config metadata (our writer); else
    the H3 release geometry -- never inferred from shapes, which cannot show the decoder's head count. Raises
    CheckpointError naming the file and the first offending key."""
    ckpt = open_checkpoint(path)
    layout = _layout(ckpt.tensors)
    lat_mean = lat_std = None
    source = "given config"
    if ckpt.config:
        try:
            folder_cfg, lat_mean, lat_std = _config_from_diffusers(ckpt.config)
        except (TypeError, ValueError) as e:
            raise CheckpointError(ckpt.config_file, f"not a video VAE config: {e}") from e
    if cfg is None:
        if ckpt.config:
            cfg, source = folder_cfg, "config.json"
        elif CONFIG_METADATA_KEY in ckpt.metadata:
            try:
                cfg = VideoVAEConfig.from_json(ckpt.metadata[CONFIG_METADATA_KEY])
            except (TypeError, ValueError) as e:
                raise CheckpointError(ckpt.files[0], f"metadata {CONFIG_METADATA_KEY} is not a video VAE config: {e}") \
                    from e
            source = "metadata"
        else:
            cfg, source = VideoVAEConfig.full(), "H3 release geometry"
    quant = _quant_layers(ckpt, layout)
    info = VideoVAEInfo(str(path), layout, cfg, source, ckpt, lat_mean, lat_std, quant)
    expected = _file_specs(cfg, parts, quant, ckpt.tensors)
    other = set(_file_specs(cfg, "all", quant, ckpt.tensors)) - set(expected)  # the half a stage does not load
    shapes = _our_entries(info)
    what = f"the H3 video VAE ({parts}; config from the {source}"
    if source == "H3 release geometry":
        what += "; for another geometry pass a folder with its diffusers config.json"
    key_report(shapes, expected, ignored=other | set(_TOLERATED_EXTRA)).raise_if_bad(path, what + ")")
    # The latent statistics are data, read now (a few floats): finite, a positive std, and the file's agreeing
    # with the config.json's, before the stage serves.
    reader = TensorReader(ckpt.tensors)
    stats = {}
    for k, configured in (("latents_mean", lat_mean), ("latents_std", lat_std)):
        e = shapes.get(k)
        if e is not None and (e.numel != cfg.latent_channels or e.dtype not in FLOAT):
            raise CheckpointError(e.file, f"{e.dtype}{list(e.shape)}: expected {cfg.latent_channels} float values", k)
        if configured is not None and len(configured) != cfg.latent_channels:
            raise CheckpointError(ckpt.config_file, f"{len(configured)} values, expected {cfg.latent_channels}", k)
        stored = None if e is None else reader.whole(e.disk_key or k)
        stats[k] = check_latent_stats(k, stored, path if e is None else e.file, configured, ckpt.config_file)
    reader.close()
    info.latents_mean, info.latents_std = stats["latents_mean"], stats["latents_std"]
    return info


def _our_entries(info: VideoVAEInfo) -> dict[str, HeaderEntry]:
    """Header entries under our names (diffusers q/k/v parts assembled into to_qkv's shape)."""
    if info.layout != "diffusers":
        return dict(info.ckpt.tensors)
    src = info.ckpt.tensors
    out: dict[str, HeaderEntry] = {}
    for k, e in src.items():
        if ".attn.to_k." in k or ".attn.to_v." in k:
            if k.replace(".to_k.", ".to_q.").replace(".to_v.", ".to_q.") not in src:
                out[k] = e
            continue
        ours = DIFFUSERS_NAMES.from_source(k)
        if ".attn.to_q." in k:
            parts = [src.get(p) for p in _qkv_parts(k)]
            ok = all(p is not None and p.shape == e.shape for p in parts)
            e = replace(e, shape=(3 * e.shape[0], *e.shape[1:]) if ok else (-1,))
        out[ours] = replace(e, disk_key=k)
    return out


def load_video_vae(path: str, cfg: VideoVAEConfig | None = None, dtype: torch.dtype = torch.float32, *,
                   device: torch.device | str = "cpu", parts: str = "all", source: WeightSource | None = None
                   ) -> VideoVAE:
    """Load the H3 video VAE from a ComfyUI single file (fp16, or int8 ConvRot), the release file (fp32) or a
    diffusers folder (config.json + safetensors), after `inspect_video_vae` validated it (again: a file changed since
    start-up fails here with a CheckpointError). Only the tensors of `parts` are read, one at a time.

    Matmul weights are cast to `dtype`; norm weights and residual scales stay fp32 (cheap, and the reference
    computes those in fp32). An int8 ConvRot linear is dequantised on `device` to `dtype` (`dequantize_convrot`:
    exact, the same bits on the CPU and any GPU) and then computes like a float one. `source`: where the load reads
    the file (stagekit.checkpoints.WeightSource: from the stage's host copy when it keeps one); None: the disk."""
    info = inspect_video_vae(path, cfg, parts)
    cfg = info.cfg
    expected = _expected(cfg, parts)
    entries = _our_entries(info)
    # A file the stage process keeps in host memory: views of its copy, moved through pinned staging buffers and cast
    # on the device (stagekit/host_copy.py), the same bits as casting first.
    staged = source is not None and all(source.has_copy(f) for f in info.ckpt.files)
    reader = TensorReader(info.ckpt.tensors, source=source, views=staged)

    def read(k: str) -> torch.Tensor:
        e = entries[k]
        disk = e.disk_key or k
        if info.layout == "diffusers" and ".attn.to_q." in disk:
            rest = e.shape[1:]
            t = torch.stack([reader.whole(p).reshape(cfg.dec_heads, cfg.dec_head_dim, *rest) for p in _qkv_parts(disk)],
                            dim=1)
            return t.reshape(3 * cfg.dec_dim, *rest)
        t = reader.whole(disk)
        return _swap_halves(t) if info.layout == "diffusers" and ".ff.w1." in k else t

    with torch.device("meta"):
        model = VideoVAE(cfg, parts)

    def load(k: str) -> torch.Tensor:
        dt = torch.float32 if _FP32_PARAM.search(k) else dtype
        spec = info.quant.get(k[: -len(".weight")]) if k.endswith(".weight") else None
        if spec is not None:  # int8 codes and row scales go to the device as stored; dequantised there, exactly
            q, s = read(k), reader.whole(k[: -len(".weight")] + ".weight_scale")
            if staged:
                q, s = source.to_device(q, device), source.to_device(s, device, torch.float32)
            else:
                q, s = q.to(device), s.to(device=device, dtype=torch.float32)
            return dequantize_convrot(q, s, spec.groupsize, dt)
        return source.to_device(read(k), device, dt) if staged else read(k).to(device=device, dtype=dt)

    if staged:  # views of the host copy: the reads and copies of different tensors overlap on several threads
        with ThreadPoolExecutor(STAGED_WORKERS, thread_name_prefix="vae-load") as pool:
            state = dict(zip(expected, pool.map(load, expected)))
    else:
        state = {k: load(k) for k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    if info.latents_mean is not None:  # the file's or config.json's, checked by inspect_video_vae
        model.latents_mean = info.latents_mean
    if info.latents_std is not None:
        model.latents_std = info.latents_std
    reader.close()
    return model.eval().requires_grad_(False)


def tiny_state_dict(cfg: VideoVAEConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights (fp32) with magnitudes that keep activations O(1) through the stack."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in VideoVAE(cfg).state_dict().items()}
    sd = {}
    for k in sorted(shapes):
        shp = shapes[k]
        r = torch.randn(shp, generator=g)
        if k.endswith("register_tokens"):
            t = r * 0.5
        elif _FP32_PARAM.search(k) and k.endswith(("scale1", "scale2")):
            t = 0.5 + 0.1 * r
        elif re.search(r"norm\w*\.weight$", k):
            t = 1.0 + 0.1 * r
        elif k.endswith(".bias"):
            t = 0.05 * r
        else:
            fan_in = math.prod(shp[1:])
            t = r / math.sqrt(fan_in)
        sd[k] = t.contiguous()
    return sd


def write_tiny_video_vae(path: str, cfg: VideoVAEConfig | None = None, seed: int = 0, *,
                         dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Write a ComfyUI-layout safetensors file (plus `decoder.mask_token` and `latents_mean/std`, like Comfy's
    module) with deterministic random weights; the config goes into the header metadata. Returns the state dict
    (as stored)."""
    from safetensors.torch import save_file

    cfg = cfg or VideoVAEConfig.tiny()
    sd = {k: v.to(dtype) for k, v in tiny_state_dict(cfg, seed).items()}
    sd["decoder.mask_token"] = torch.zeros(1, 1, cfg.dec_dim, dtype=dtype)
    if cfg.latent_channels == len(LATENTS_MEAN):
        sd["latents_mean"] = torch.tensor(LATENTS_MEAN, dtype=torch.float32)
        sd["latents_std"] = torch.tensor(LATENTS_STD, dtype=torch.float32)
    # One metadata entry only: safetensors stores metadata in a hash map, so several entries serialise in random
    # order and the file would not be byte-deterministic.
    save_file(sd, path, metadata={CONFIG_METADATA_KEY: cfg.to_json()})
    return sd


def write_int8_convrot_video_vae(src: str, dst: str, groupsize: int | None = None) -> int:
    """An fp16 video VAE file -> its int8 ConvRot form, as ComfyUI stores `minimax_h3_video_vae_int8_convrot`: every
    QUANTIZABLE linear's weight ConvRot-quantised (int8 codes, fp32 `weight_scale` [out, 1] and a U8 `comfy_quant`
    descriptor), every other tensor and the file's metadata as they are. `groupsize`: the largest power of 4 up to
    256 that divides every quantised layer's in_features, unless given. For benchmark files (the published one is
    ComfyUI's); returns the number of layers quantised."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from minimax_h3.dit.tiny_checkpoint import convrot_groupsize

    with safe_open(src, "pt") as f:
        metadata = dict(f.metadata() or {})
        sd = {k: f.get_tensor(k) for k in f.keys()}
    layers = [k[: -len(".weight")] for k in sd if k.endswith(".weight") and QUANTIZABLE.match(k[: -len(".weight")])]
    if not layers:
        raise CheckpointError(src, "no decoder block linears to quantise: not a MiniMax-H3 video VAE file")
    g = groupsize or convrot_groupsize(*{sd[f"{layer}.weight"].shape[1] for layer in layers}, cap=256)
    for layer in layers:
        q, scale = quantize_convrot(sd[f"{layer}.weight"].float(), g)
        sd[f"{layer}.weight"], sd[f"{layer}.weight_scale"] = q, scale.float()
        sd[f"{layer}.comfy_quant"] = encode_comfy_quant(g)
    save_file(sd, dst, metadata=metadata)
    return len(layers)
