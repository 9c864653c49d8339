"""MiniMax-H3 audio VAE: DAC encoder + causal-attention bottleneck + BigVGAN decoder (mono, 32 kHz).

Facts: docs/model.md §3.2 (latent layout), §5 (module tree), §9.1 (sizes).

* Mono model. Stereo is carried as two independent batch items: the DiT emits audio rows
  `[2*Ta, 32]` channel-major (first Ta rows = left channel), which we view as `[2, 32, Ta]`.
* Hop 800 samples (prod of the decoder rates) -> 40 latents/s at 32 kHz.
* Parameter / buffer names equal the ComfyUI single-file keys (weight norm folded into `weight`,
  Kaiser filters stored as `...upsample.filter` / `...downsample.lowpass.filter`, latent statistics
  stored as `latents_mean` / `latents_std`). The release / diffusers file keeps weight norm unfolded
  (`weight_g`, `weight_v`); `load_audio_vae` folds it at load time so only one module layout exists.
* fp32 only: the Snake/BigVGAN stack loses ~20 dB of signal in bf16, and the model is tiny next to
  the DiT, so there is no reason to run it in reduced precision.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimax_h3.contract import AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, AUDIO_SAMPLE_RATE
from stagekit.checkpoints import (FLOAT, IDENTITY, Checkpoint, CheckpointError, HeaderEntry, NameMap, TensorReader,
                                  TensorSpec, WeightSource, check_finite_tensor, check_latent_stats, key_report,
                                  open_checkpoint, tensor_entries)

# --------------------------------------------------------------------------------------------
# Constants named where the model defines them
# --------------------------------------------------------------------------------------------

# The rates and widths of H3's audio latents (minimax_h3.contract): 32 kHz, hop 800 (prod(encoder_rates) ==
# prod(decoder_rates)), 32 channels, two stereo channels encoded one by one.

# Anti-aliased activation resampler (BigVGAN / alias-free-torch): x2 up, activation, x2 down.
AA_RATIO = 2
AA_KERNEL_SIZE = 12
# Snake denominators use this epsilon (encoder Snake and decoder SnakeBeta alike).
SNAKE_EPS = 1e-9

# safetensors metadata key under which `write_tiny_audio_vae` records the config.
CONFIG_METADATA_KEY = "h3_audio_vae_config"

# Key prefixes some single-file repacks put in front of the bare module keys.
_KNOWN_PREFIXES = ("first_stage_model.", "audio_vae.", "vae.")
# Sub-trees that exist only for encoding; a decoder-only model skips them when loading.
_ENCODER_PREFIXES = ("encoder.", "pre_block.", "mean_proj.", "logs_proj.")


def _default_kernels(rates: tuple[int, ...]) -> tuple[int, ...]:
    # BigVGAN's upsampler kernel for stride u: 2u - (u mod 2)  ->  (9, 9, 4, 4, 4, 4, 4).
    return tuple(2 * u - (u % 2) for u in rates)


@dataclass(frozen=True)
class AudioVAEConfig:
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = AUDIO_LATENT_CHANNELS
    num_attention_heads: int = 8  # hard-coded in the release, configurable here for tiny tests
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] | None = None  # None -> 2u - (u mod 2)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sample_rate: int = AUDIO_SAMPLE_RATE
    # Per-channel latent statistics (release: audio_vae/config.json; ComfyUI: buffers in the file).
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    with_encoder: bool = True

    def __post_init__(self) -> None:
        # Normalise list inputs (JSON) to tuples so the config stays hashable and comparable.
        object.__setattr__(self, "encoder_rates", tuple(int(r) for r in self.encoder_rates))
        object.__setattr__(self, "decoder_rates", tuple(int(r) for r in self.decoder_rates))
        ks = self.decoder_kernel_sizes
        ks = _default_kernels(self.decoder_rates) if ks is None else tuple(int(k) for k in ks)
        object.__setattr__(self, "decoder_kernel_sizes", ks)
        object.__setattr__(self, "resblock_kernel_sizes", tuple(int(k) for k in self.resblock_kernel_sizes))
        object.__setattr__(
            self, "resblock_dilation_sizes", tuple(tuple(int(d) for d in ds) for ds in self.resblock_dilation_sizes)
        )
        for name in ("latents_mean", "latents_std"):
            v = getattr(self, name)
            if v is not None:
                v = tuple(float(x) for x in v)
                if len(v) != self.latent_channels:
                    raise ValueError(f"AudioVAEConfig.{name} must have {self.latent_channels} values, got {len(v)}")
                if not all(math.isfinite(x) for x in v):
                    raise ValueError(f"AudioVAEConfig.{name} must be finite")
                object.__setattr__(self, name, v)
        if self.latents_std is not None and not all(x > 0 for x in self.latents_std):
            raise ValueError("AudioVAEConfig.latents_std must be strictly positive")
        if math.prod(self.decoder_rates) != math.prod(self.encoder_rates):
            raise ValueError(
                f"decoder rates {self.decoder_rates} upsample by {math.prod(self.decoder_rates)} but encoder rates "
                f"{self.encoder_rates} downsample by {math.prod(self.encoder_rates)}; they must match"
            )
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("decoder_kernel_sizes must have one entry per decoder rate")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            raise ValueError("resblock_dilation_sizes must have one entry per resblock kernel size")
        if self.decoder_dim // 2 ** len(self.decoder_rates) < 1:
            raise ValueError(
                f"decoder_dim {self.decoder_dim} halves {len(self.decoder_rates)} times to zero channels; "
                f"use decoder_dim >= {2 ** len(self.decoder_rates)}"
            )
        if self.latent_dim % self.num_attention_heads != 0:
            raise ValueError("latent_dim must be divisible by num_attention_heads")

    @property
    def hop_length(self) -> int:
        return math.prod(self.decoder_rates)

    @classmethod
    def full(cls, **overrides) -> "AudioVAEConfig":
        """The released model (§5.1)."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> "AudioVAEConfig":
        """Small random-init model for tests. Same rates (hop 800) and latent width 32.

        decoder_dim is 256, not smaller: seven x2 channel halvings of anything below 128 reach zero
        channels, and 256 keeps 2 channels at conv_post so channel mix-ups stay observable.
        """
        kw = dict(encoder_dim=4, latent_dim=256, num_attention_heads=4, decoder_dim=256)
        kw.update(overrides)
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AudioVAEConfig":
        return cls(**json.loads(text))


# --------------------------------------------------------------------------------------------
# Anti-aliased activation building blocks
# --------------------------------------------------------------------------------------------


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass, `[1, 1, kernel_size]`, normalised to sum 1 (§5.4).

    Window beta from the standard Kaiser design: attenuation A = 2.285 (N/2 - 1) pi (4 half_width) + 7.95.
    Computed in float64 and rounded once to fp32; stored checkpoint buffers match it to ~1 ulp.
    """
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4.0 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21.0) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    # Explicit CPU device: the taps are constants, and building them under a meta-device context
    # (how `load_audio_vae` skips weight init) would otherwise cost ~4 ms each through the meta dispatcher.
    cpu = torch.device("cpu")
    window = torch.kaiser_window(kernel_size, periodic=False, beta=beta, dtype=torch.float64, device=cpu)
    if kernel_size % 2 == 0:
        # Even length: taps sit half-way between samples so the filter is symmetric about 0.
        t = torch.arange(kernel_size, dtype=torch.float64, device=cpu) - half + 0.5
    else:
        t = torch.arange(kernel_size, dtype=torch.float64, device=cpu) - half
    taps = 2.0 * cutoff * window * torch.sinc(2.0 * cutoff * t)
    taps = taps / taps.sum()  # unit DC gain: a constant input passes unchanged
    return taps.to(torch.float32).view(1, 1, kernel_size)


class UpSample1d(nn.Module):
    """x`ratio` upsampler: replicate-pad, depthwise transposed conv with the Kaiser filter, x`ratio` gain, crop."""

    def __init__(self, ratio: int = AA_RATIO, kernel_size: int = AA_KERNEL_SIZE):
        super().__init__()
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        # Crop so that output length is exactly ratio * input length and aligned with the input.
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        y = F.pad(x, (self.pad, self.pad), mode="replicate")
        # Zero-stuffing spreads energy over `ratio` samples, hence the gain to keep amplitude.
        y = F.conv_transpose1d(y, self.filter.expand(c, 1, -1), stride=self.ratio, groups=c) * self.ratio
        return y[..., self.crop_left : y.shape[-1] - self.crop_right]


class LowPassFilter1d(nn.Module):
    """Depthwise Kaiser low-pass with stride (the anti-aliased downsampler), replicate padding."""

    def __init__(self, cutoff: float, half_width: float, stride: int, kernel_size: int):
        super().__init__()
        self.stride = stride
        self.pad_left = kernel_size // 2 - (1 if kernel_size % 2 == 0 else 0)
        self.pad_right = kernel_size // 2
        self.register_buffer("filter", kaiser_sinc_filter(cutoff, half_width, kernel_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(c, 1, -1), stride=self.stride, groups=c)


class DownSample1d(nn.Module):
    def __init__(self, ratio: int = AA_RATIO, kernel_size: int = AA_KERNEL_SIZE):
        super().__init__()
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class Snake(nn.Module):
    """Encoder Snake: x + sin^2(alpha x) / (alpha + eps); `alpha` [1, C, 1] in linear space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(self.alpha * x).pow(2) / (self.alpha + SNAKE_EPS)


class SnakeBeta(nn.Module):
    """Decoder SnakeBeta: x + sin^2(e^alpha x) / (e^beta + eps); `alpha`, `beta` [C] in log space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freq = self.alpha.exp().view(1, -1, 1)
        mag = self.beta.exp().view(1, -1, 1)
        return x + torch.sin(freq * x).pow(2) / (mag + SNAKE_EPS)


class AntiAliasedSnakeBeta(nn.Module):
    """Upsample x2 -> SnakeBeta -> low-pass + downsample x2 (the periodic nonlinearity would alias at 1x)."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d()
        self.downsample = DownSample1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


# --------------------------------------------------------------------------------------------
# DAC encoder (§5.2) and attention bottleneck (§5.3)
# --------------------------------------------------------------------------------------------


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation),
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        # "Same" padding keeps lengths equal; the crop only matters for odd setups, kept for fidelity.
        trim = (x.shape[-1] - y.shape[-1]) // 2
        if trim > 0:
            x = x[..., trim:-trim]
        return x + y


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int):
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake(half),
            nn.Conv1d(half, dim, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        d = cfg.encoder_dim
        layers: list[nn.Module] = [nn.Conv1d(1, d, kernel_size=7, padding=3)]
        for stride in cfg.encoder_rates:
            d *= 2
            layers.append(EncoderBlock(d, stride))
        layers += [Snake(d), nn.Conv1d(d, cfg.latent_dim, kernel_size=3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class CausalAttention(nn.Module):
    """Causal attention that *narrows* width: heads are averaged, then the head dim is pooled to out_dim."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = in_dim // num_heads
        self.out_dim = out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        # The release has no key bias; it stores a zero buffer so the fused bias is [q; 0; v].
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).view(b, t, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.mean(dim=1)  # [B, T, D]: heads averaged, not concatenated
        o = F.adaptive_avg_pool1d(o, self.out_dim)  # D -> out_dim (groups of D/out_dim averaged)
        return self.proj(o)


class GeGluMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        return self.w2(F.gelu(self.w0(n), approximate="tanh") * self.w1(n))


class AttnProjection(nn.Module):
    """`pre_block`: [B, T, latent_dim] -> [B, T, latent_channels]."""

    MLP_RATIO = 2

    def __init__(self, in_dim: int, out_dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, num_heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGluMlp(out_dim, out_dim * self.MLP_RATIO)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Note the norm pairing: norm3 feeds the linear skip, norm1 the attention.
        y = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return y + self.mlp(self.norm2(y))


# --------------------------------------------------------------------------------------------
# BigVGAN decoder (§5.4)
# --------------------------------------------------------------------------------------------


class AMPBlock1(nn.Module):
    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2)
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        # One activation before every conv: index 2m precedes convs1[m], 2m+1 precedes convs2[m].
        self.activations = nn.ModuleList(AntiAliasedSnakeBeta(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            y = c1(self.activations[2 * m](x))
            y = c2(self.activations[2 * m + 1](y))
            x = x + y
        return x


class BigVGAN(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        d0 = cfg.decoder_dim
        self.conv_pre = nn.Conv1d(cfg.latent_dim, d0, 7, padding=3)
        # Each upsampler sits in a one-element ModuleList in the release (`ups.{i}.0`); kept for key parity.
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (u, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes)):
            c_in, c_out = d0 // 2**i, d0 // 2 ** (i + 1)
            self.ups.append(nn.ModuleList([nn.ConvTranspose1d(c_in, c_out, k, stride=u, padding=(k - u) // 2)]))
            for rk, dil in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock1(c_out, rk, dil))
        c_last = d0 // 2 ** len(cfg.decoder_rates)
        self.activation_post = AntiAliasedSnakeBeta(c_last)
        self.conv_post = nn.Conv1d(c_last, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            acc = blocks[0](x)
            for blk in blocks[1:]:
                acc = acc + blk(x)
            x = acc / self.num_kernels  # multi-receptive-field fusion = mean of the AMP blocks
        x = self.conv_post(self.activation_post(x))
        return x.clamp(-1.0, 1.0)  # the release ends with a clamp, not tanh


# --------------------------------------------------------------------------------------------
# Top-level model

# Latents decoded at once (30 s); a longer soundtrack is decoded in chunks with this many latents of context a side.
DECODE_CHUNK_LATENTS = 1200
DECODE_CONTEXT_LATENTS = 48
# --------------------------------------------------------------------------------------------


class AudioVAE(nn.Module):
    """Mono audio VAE. `state_dict()` keys equal the ComfyUI single-file keys (minus encoder parts when
    `cfg.with_encoder` is False)."""

    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.latent_channels
        if cfg.with_encoder:
            self.encoder = Encoder(cfg)
            self.pre_block = AttnProjection(cfg.latent_dim, c, cfg.num_attention_heads)
            self.mean_proj = nn.Conv1d(c, c, 1)
            self.logs_proj = nn.Conv1d(c, c, 1)  # log-std head: unused at inference, kept for key parity
        self.dec_in_proj = nn.Conv1d(c, cfg.latent_dim, 1)
        self.decoder = BigVGAN(cfg)
        # NaN marks "unknown": de-normalising with unknown statistics must fail loudly, not silently.
        mean = torch.full((c,), float("nan")) if cfg.latents_mean is None else torch.tensor(cfg.latents_mean)
        std = torch.full((c,), float("nan")) if cfg.latents_std is None else torch.tensor(cfg.latents_std)
        self.register_buffer("latents_mean", mean.float())
        self.register_buffer("latents_std", std.float())

    @property
    def hop_length(self) -> int:
        return self.cfg.hop_length

    # ---- validation -------------------------------------------------------------------------

    def _check_latents(self, z: torch.Tensor) -> None:
        if not isinstance(z, torch.Tensor) or not z.is_floating_point():
            raise ValueError("audio latents must be a floating-point torch.Tensor")
        if z.ndim != 3 or z.shape[1] != self.cfg.latent_channels or z.shape[2] < 1:
            raise ValueError(
                f"audio latents must have shape [batch, {self.cfg.latent_channels}, Ta>=1], got {tuple(z.shape)}"
            )
        if not torch.isfinite(z).all():
            raise ValueError("audio latents contain NaN or Inf")

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (torch.isfinite(self.latents_mean).all() and torch.isfinite(self.latents_std).all()):
            raise ValueError(
                "audio latent statistics (latents_mean/latents_std) are unknown: load a file that stores them "
                "(ComfyUI layout) or pass AudioVAEConfig(latents_mean=..., latents_std=...) from audio_vae/config.json"
            )
        return (
            self.latents_mean.view(1, -1, 1).to(z.device, z.dtype),
            self.latents_std.view(1, -1, 1).to(z.device, z.dtype),
        )

    # ---- decode -----------------------------------------------------------------------------

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """De-normalised latents `[B, 32, Ta]` -> waveform `[B, 1, 800*Ta]` in [-1, 1] (fp32)."""
        self._check_latents(latents)
        x = latents.to(self.dec_in_proj.weight.device, torch.float32)
        return self.decoder(self.dec_in_proj(x))

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z * std + mean

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return (z - mean) / std

    @staticmethod
    def rows_to_batch(rows: torch.Tensor, num_channels: int = AUDIO_CHANNELS) -> torch.Tensor:
        """DiT audio rows `[C*Ta, 32]` (channel-major) -> VAE batch `[C, 32, Ta]`."""
        if rows.ndim != 2 or rows.shape[0] % num_channels != 0 or rows.shape[0] == 0:
            raise ValueError(
                f"audio rows must have shape [{num_channels}*Ta, channels] (channel-major), got {tuple(rows.shape)}"
            )
        ta = rows.shape[0] // num_channels
        return rows.reshape(num_channels, ta, rows.shape[1]).permute(0, 2, 1).contiguous()

    @staticmethod
    def batch_to_rows(z: torch.Tensor) -> torch.Tensor:
        """VAE batch `[C, 32, Ta]` -> rows `[C*Ta, 32]` (inverse of `rows_to_batch`)."""
        return z.permute(0, 2, 1).reshape(-1, z.shape[1]).contiguous()

    @torch.no_grad()
    def decode_rows(self, rows: torch.Tensor, num_channels: int = AUDIO_CHANNELS,
                    chunk_latents: int = DECODE_CHUNK_LATENTS) -> torch.Tensor:
        """Normalised DiT audio rows `[2*Ta, 32]` -> stereo waveform `[2, 800*Ta]` at 32 kHz in [-1, 1].

        A soundtrack longer than `chunk_latents` is decoded a chunk at a time, each with DECODE_CONTEXT_LATENTS of
        its neighbours' latents on either side (beyond the decoder's receptive field, ~20 latents) and cut back to
        its own samples, so memory is bounded by the chunk however long the clip; a shorter one is decoded whole."""
        if rows.ndim != 2 or rows.shape[1] != self.cfg.latent_channels:
            raise ValueError(
                f"audio rows must have shape [{num_channels}*Ta, {self.cfg.latent_channels}], got {tuple(rows.shape)}"
            )
        z = self.rows_to_batch(rows.float(), num_channels)
        self._check_latents(z)
        z = self.denormalize(z.to(self.dec_in_proj.weight.device))
        ta = z.shape[-1]
        if ta <= chunk_latents:
            return self.decode(z)[:, 0, :]
        hop, ctx, parts = self.hop_length, DECODE_CONTEXT_LATENTS, []
        for s in range(0, ta, chunk_latents):
            e = min(ta, s + chunk_latents)
            a, b = max(0, s - ctx), min(ta, e + ctx)
            parts.append(self.decode(z[..., a:b])[:, 0, (s - a) * hop:(e - a) * hop])
        return torch.cat(parts, dim=1)

    # ---- encode -----------------------------------------------------------------------------

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """Mono waveform `[B, 1, N]` -> posterior mean `[B, 32, ceil(N/800)]` (raw, not normalised).

        The input is right-padded with zeros to a multiple of the hop (800)."""
        if not self.cfg.with_encoder:
            raise ValueError("this AudioVAE was built without the encoder (AudioVAEConfig.with_encoder=False)")
        if not isinstance(waveform, torch.Tensor) or not waveform.is_floating_point():
            raise ValueError("waveform must be a floating-point torch.Tensor")
        if waveform.ndim != 3 or waveform.shape[1] != 1 or waveform.shape[2] < 1:
            raise ValueError(f"waveform must have shape [batch, 1, samples>=1], got {tuple(waveform.shape)}")
        if not torch.isfinite(waveform).all():
            raise ValueError("waveform contains NaN or Inf")
        x = waveform.to(self.dec_in_proj.weight.device, torch.float32)
        pad = -x.shape[-1] % self.hop_length
        if pad:
            x = F.pad(x, (0, pad))
        h = self.encoder(x)
        h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)
        return self.mean_proj(h)

    @torch.no_grad()
    def encode_rows(self, audio: torch.Tensor) -> torch.Tensor:
        """Stereo waveform `[2, N]` at 32 kHz -> normalised rows `[2*Ta, 32]`, Ta = ceil(N/800) (reference audio)."""
        if audio.ndim != 2 or audio.shape[0] != AUDIO_CHANNELS:
            raise ValueError(f"reference audio must have shape [2, samples], got {tuple(audio.shape)}")
        z = self.encode(audio.unsqueeze(1))
        return self.batch_to_rows(self.normalize(z))


# --------------------------------------------------------------------------------------------
# Checkpoint loading
# --------------------------------------------------------------------------------------------

LAYOUT_COMFY = "comfy"  # weight norm folded into `weight`, latents_mean/std buffers present
LAYOUT_RELEASE = "release"  # torch weight_norm spelling `weight_g` / `weight_v` (release == diffusers save)
LAYOUT_PARAMETRIZED = "parametrized"  # torch.nn.utils.parametrizations spelling (`parametrizations.weight.original0/1`)

_WG, _WV = ".weight_g", ".weight_v"
_PG, _PV = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
_NORM_SUFFIXES = {LAYOUT_RELEASE: (_WG, _WV), LAYOUT_PARAMETRIZED: (_PG, _PV)}
# diffusers' AutoencoderKLMiniMaxH3Audio config.json names that differ from AudioVAEConfig's.
_DIFFUSERS_CONFIG_NAMES = {"sampling_rate": "sample_rate"}


def _source_names(keys: Iterable[str]) -> NameMap:
    """Our names <-> the file's: some single-file repacks put a prefix in front of every key."""
    keys = list(keys)
    for p in _KNOWN_PREFIXES:
        if keys and all(k.startswith(p) for k in keys):
            return NameMap.prefix(p)
    return IDENTITY


def detect_layout(keys: Iterable[str]) -> str:
    """Classify a checkpoint by its key names (header only)."""
    keys = list(keys)
    if any(k.endswith(_WG) or k.endswith(_WV) for k in keys):
        return LAYOUT_RELEASE
    if any(k.endswith(_PG) or k.endswith(_PV) for k in keys):
        return LAYOUT_PARAMETRIZED
    if any(k.endswith("decoder.conv_pre.weight") for k in keys):
        return LAYOUT_COMFY
    raise CheckpointError("<audio VAE>", "not a MiniMax-H3 audio VAE file: found no `decoder.conv_pre.weight` "
                                         "(ComfyUI) nor weight-norm `*.weight_g`/`*.weight_v` keys (release). "
                                         f"First keys: {', '.join(sorted(keys)[:5])}")


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w = g * v / ||v||, norm over every dim but 0 (torch weight_norm's default dim=0).

    For Conv1d dim 0 is out-channels, for ConvTranspose1d it is in-channels (weight [in, out, k]);
    `g` has shape [dim0, 1, 1] either way, so one formula serves both.
    """
    if g.shape[0] != v.shape[0] or g.numel() != v.shape[0]:
        raise ValueError(f"weight_g shape {tuple(g.shape)} does not match weight_v shape {tuple(v.shape)}")
    v64 = v.double()
    norm = v64.flatten(1).norm(dim=1).view(-1, *([1] * (v.ndim - 1)))
    return (v64 * (g.double().view_as(norm) / norm)).to(torch.float32)


def _folded_names(keys: Iterable[str], layout: str) -> dict[str, tuple[str, ...]]:
    """Our (ComfyUI) name -> the source key(s) it is made of: (g, v) for a weight-norm pair, else itself. A g
    without its v (or v without g) keeps its own name, so the key report names it as unexpected."""
    keys = set(keys)
    if layout == LAYOUT_COMFY:
        return {k: (k,) for k in keys}
    g_suf, v_suf = _NORM_SUFFIXES[layout]
    out: dict[str, tuple[str, ...]] = {}
    for k in sorted(keys):
        if k.endswith(g_suf) and k[: -len(g_suf)] + v_suf in keys:
            out[k[: -len(g_suf)] + ".weight"] = (k, k[: -len(g_suf)] + v_suf)
        elif not (k.endswith(v_suf) and k[: -len(v_suf)] + g_suf in keys):
            out[k] = (k,)
    return out


def to_comfy_layout(sd: Mapping[str, torch.Tensor], layout: str | None = None) -> dict[str, torch.Tensor]:
    """Any supported layout -> ComfyUI keys (weight norm folded). Prefixes are stripped."""
    names = _source_names(sd.keys())
    sd = {names.from_source(k): v for k, v in sd.items()}
    layout = layout or detect_layout(sd.keys())
    return {ours: fold_weight_norm(sd[src[0]], sd[src[1]]) if len(src) == 2 else sd[src[0]]
            for ours, src in _folded_names(sd, layout).items()}


# Keys a file may lack; they are then rebuilt (filters, zero_k_bias) or taken from the config (stats).
def _fill_value(key: str, like: torch.Tensor, cfg: AudioVAEConfig) -> torch.Tensor | None:
    if key.endswith(".filter"):
        return _aa_filter()
    if key.endswith("zero_k_bias"):
        return torch.zeros(like.shape)
    if key in ("latents_mean", "latents_std"):
        v = getattr(cfg, key)
        return torch.full(like.shape, float("nan")) if v is None else torch.tensor(v, dtype=torch.float32)
    return None


def _rebuilt(key: str) -> bool:
    return key.endswith((".filter", "zero_k_bias")) or key in ("latents_mean", "latents_std")


def _aa_filter() -> torch.Tensor:
    # Every anti-aliased activation in the release uses ratio 2 / kernel 12 for both directions,
    # so one filter (cutoff 0.25, half-width 0.3) serves all `...upsample.filter` / `...lowpass.filter`.
    return kaiser_sinc_filter(0.5 / AA_RATIO, 0.6 / AA_RATIO, AA_KERNEL_SIZE)


def _expected(cfg: AudioVAEConfig) -> dict[str, TensorSpec]:
    with torch.device("meta"):
        own = AudioVAE(cfg).state_dict()
    return {k: TensorSpec(tuple(v.shape), FLOAT) for k, v in own.items()}


def _describe(cfg: AudioVAEConfig, source: str) -> str:
    what = (f"the H3 audio VAE (config from the {source}: decoder_dim={cfg.decoder_dim}, latent_dim={cfg.latent_dim}, "
            f"latent_channels={cfg.latent_channels}, encoder_dim={cfg.encoder_dim}, with_encoder={cfg.with_encoder}")
    if source == "H3 release geometry":
        what += "; for another geometry pass a folder with its diffusers config.json"
    return what + ")"


def load_comfy_state_dict(model: AudioVAE, sd: Mapping[str, torch.Tensor], *, filter_atol: float = 1e-6,
                          source: str = "<state dict>") -> None:
    """Strictly load a ComfyUI-layout state dict into `model` (which may live on the meta device).

    * encoder-only keys are skipped when the model has no encoder;
    * Kaiser filter buffers in the file are compared with the formula (|diff| <= filter_atol) and then used;
      absent filters / `zero_k_bias` are rebuilt;
    * `latents_mean/std` come from the file, else from the config (both present and different -> error);
      if both are absent, decoding raises later.
    Missing / unexpected / misshapen / non-float keys raise CheckpointError naming them (stagekit's key report).
    """
    own = model.state_dict()
    if not model.cfg.with_encoder:
        sd = {k: v for k, v in sd.items() if not k.startswith(_ENCODER_PREFIXES)}
    want = {k: TensorSpec(tuple(v.shape), FLOAT) for k, v in own.items()}
    key_report(tensor_entries(sd, source), want, optional=[k for k in own if _rebuilt(k)]).raise_if_bad(
        source, _describe(model.cfg, "given config"))
    check_buffers(sd, model.cfg, source, "AudioVAEConfig", filter_atol)
    for k, t in sd.items():  # a state dict given in memory, or a weight folded from a zero-norm v
        check_finite_tensor(source, k, t)
    merged = {k: (sd[k] if k in sd else _fill_value(k, own[k], model.cfg)).to(torch.float32) for k in own}
    on_meta = any(t.is_meta for t in own.values())
    # A meta-built model takes the file tensors as they are (no default init, no second copy).
    model.load_state_dict(merged, strict=True, assign=on_meta)


def check_buffers(buffers: Mapping[str, torch.Tensor], cfg: AudioVAEConfig, source: str | os.PathLike,
                  config_file: str | os.PathLike, filter_atol: float = 1e-6) -> None:
    """The buffers the architecture defines, checked against their definitions (our names; absent ones are rebuilt):
    each Kaiser-sinc filter against its formula (|diff| <= filter_atol), each `zero_k_bias` zero, and the latent
    statistics (positive std; agreeing with the config's when both give them, `check_latent_stats`). Raises
    CheckpointError naming the file (and the config) and the key."""
    reference = _aa_filter()
    for k, t in buffers.items():
        if k.endswith(".filter"):
            diff = (t.float() - reference).abs().max().item()
            if not diff <= filter_atol:
                raise CheckpointError(source, f"stored Kaiser-sinc filter differs from the formula (kernel 12, cutoff "
                                              f"0.25, half-width 0.3; max |diff| {diff:.3g})", k)
        elif k.endswith("zero_k_bias") and bool(t.any()):
            raise CheckpointError(source, "must be all zeros (the attention's key projection has no bias)", k)
    for k in ("latents_mean", "latents_std"):
        check_latent_stats(k, buffers.get(k), source, getattr(cfg, k), config_file, rtol=1e-5)


def _config_from_diffusers(d: dict, with_encoder: bool) -> AudioVAEConfig:
    fields = {f.name for f in dataclasses.fields(AudioVAEConfig)}
    kw = {_DIFFUSERS_CONFIG_NAMES.get(k, k): v for k, v in d.items()}
    return AudioVAEConfig(**{k: v for k, v in kw.items() if k in fields}, with_encoder=with_encoder)


@dataclass
class AudioVAEInfo:
    """An audio VAE checkpoint as validated from its headers (no tensor data read)."""

    path: Path
    layout: str  # comfy | release | parametrized
    cfg: AudioVAEConfig
    config_source: str  # "given config" | "config.json" | "metadata" | "H3 release geometry"
    ckpt: Checkpoint
    entries: dict[str, HeaderEntry]  # the file's tensors, prefix stripped (disk_key: the name in the file)
    sources: dict[str, tuple[str, ...]]  # our name -> entries key(s) ((g, v) for a weight-norm pair)

    @property
    def has_stats(self) -> bool:
        """Latent statistics available (in the file or the config): decoding needs them."""
        return ("latents_mean" in self.sources and "latents_std" in self.sources) or \
            (self.cfg.latents_mean is not None and self.cfg.latents_std is not None)


def inspect_audio_vae(path: str | os.PathLike, cfg: AudioVAEConfig | None = None, *,
                      with_encoder: bool | None = None) -> AudioVAEInfo:
    """Layout, config and a check of every tensor (keys, shapes, float dtypes; weight-norm pairs complete), from
    the headers. A file or a diffusers folder (config.json + safetensors) is accepted.

    `cfg=None`: a folder's config.json, else the config our writer stores in the metadata, else the H3 release
    geometry -- never widths guessed from shapes (they cannot show the attention head count). `with_encoder`
    overrides the config's flag (False = decoder-only: encoder tensors are ignored). Raises CheckpointError naming
    the file and the first offending key."""
    ckpt = open_checkpoint(path)
    names = _source_names(ckpt.tensors)
    entries = {names.from_source(k): replace(e, disk_key=k) for k, e in ckpt.tensors.items()}
    try:
        layout = detect_layout(entries)
    except CheckpointError as e:
        raise CheckpointError(ckpt.files[0], e.problem) from None
    has_enc = any(k.startswith("encoder.") for k in entries)
    flag = has_enc if with_encoder is None else with_encoder
    source = "given config"
    if cfg is None:
        try:
            if ckpt.config:
                cfg, source = _config_from_diffusers(ckpt.config, flag), "config.json"
            elif CONFIG_METADATA_KEY in ckpt.metadata:
                cfg, source = AudioVAEConfig.from_json(ckpt.metadata[CONFIG_METADATA_KEY]), "metadata"
            else:
                cfg, source = AudioVAEConfig.full(with_encoder=flag), "H3 release geometry"
        except (TypeError, ValueError) as e:
            raise CheckpointError(ckpt.config_file or ckpt.files[0], f"not an audio VAE config: {e}") from e
    if with_encoder is not None and with_encoder != cfg.with_encoder:
        cfg = AudioVAEConfig(**{**asdict(cfg), "with_encoder": with_encoder})
    sources = _folded_names(entries, layout)
    ours: dict[str, HeaderEntry] = {}
    for k, src in sources.items():
        e = entries[src[-1]]  # the folded weight has v's shape
        if len(src) == 2:
            g = entries[src[0]]
            if g.numel != e.shape[0] or g.shape[0] != e.shape[0]:
                e = replace(e, shape=(-1,))  # reported as misshapen
        ours[k] = e
    ignored = set() if cfg.with_encoder else {k for k in ours if k.startswith(_ENCODER_PREFIXES)}
    want = _expected(cfg)
    key_report(ours, want, optional=[k for k in want if _rebuilt(k)], ignored=ignored).raise_if_bad(
        path, _describe(cfg, source))
    # The buffers are data the architecture defines (filters, zero bias, latent statistics): a few KiB, read and
    # checked now, so a damaged one stops the stage before it serves rather than at its first job.
    reader = TensorReader(entries)
    buffers = {k: reader.whole(k) for k in ours if _rebuilt(k) and k not in ignored}
    reader.close()
    file = ckpt.files[0]
    check_buffers(buffers, cfg, file, ckpt.config_file if source == "config.json" else f"the config ({source})")
    return AudioVAEInfo(Path(path), layout, cfg, source, ckpt, entries,
                        {k: v for k, v in sources.items() if k not in ignored})


def load_audio_vae(
    path: str | os.PathLike,
    cfg: AudioVAEConfig | None = None,
    *,
    device: str | torch.device = "cpu",
    with_encoder: bool | None = None,
    source: WeightSource | None = None,
) -> AudioVAE:
    """Load a ComfyUI / release / parametrized-weight-norm file, or a diffusers folder, into an fp32 `AudioVAE`,
    after `inspect_audio_vae` validated it (again: a file changed since start-up fails here with a CheckpointError).

    Latent statistics: file buffers if present, else `cfg.latents_mean/std` (the release keeps them in
    audio_vae/config.json). `source`: where the load reads the file (stagekit.checkpoints.WeightSource: from the
    stage's host copy when it keeps one); None: the disk.
    """
    info = inspect_audio_vae(path, cfg, with_encoder=with_encoder)
    reader = TensorReader(info.entries, source=source)
    sd = {}
    for ours, src in info.sources.items():
        parts = [reader.whole(k) for k in src]
        sd[ours] = fold_weight_norm(*parts) if len(parts) == 2 else parts[0]
    reader.close()
    with torch.device("meta"):  # skip the default random init of ~151 M parameters
        model = AudioVAE(info.cfg)
    load_comfy_state_dict(model, sd, source=str(info.ckpt.files[0]))
    return model.to(device).eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------
# Deterministic tiny checkpoint writer (tests, smoke runs)
# --------------------------------------------------------------------------------------------


def random_init_(model: AudioVAE, seed: int) -> AudioVAE:
    """Deterministic, audible (non-degenerate) random weights; buffers are left as built."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".alpha") and p.ndim == 3:  # encoder Snake, linear space, must stay > 0
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(".alpha") or name.endswith(".beta"):  # SnakeBeta, log space
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name.split(".")[-2] and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                mod = model.get_submodule(name.rsplit(".", 1)[0])
                if isinstance(mod, nn.ConvTranspose1d):
                    # weight [in, out, k]: each output sample sees in * k / stride taps
                    fan_in = p.shape[0] * p.shape[2] / mod.stride[0]
                else:
                    fan_in = p.shape[1] * (p.shape[2] if p.ndim == 3 else 1)
                scale = 1.0 / math.sqrt(fan_in)
                # Damp the residual branches and the output head so the random waveform stays mostly
                # inside the [-1, 1] clamp (a saturated output would make parity tests meaningless).
                if ".convs2." in name:
                    scale *= 0.25
                elif name.startswith("decoder.conv_post"):
                    scale *= 0.15
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        c = model.cfg.latent_channels
        model.latents_mean.copy_(0.2 * torch.randn(c, generator=g))
        model.latents_std.copy_(0.5 + torch.rand(c, generator=g))
    return model


def write_tiny_audio_vae(path: str | os.PathLike, cfg: AudioVAEConfig | None = None, seed: int = 0) -> Path:
    """Write a deterministic random `AudioVAE` as a real safetensors file in the ComfyUI layout.

    The config is stored in the header metadata (`h3_audio_vae_config`) so `load_audio_vae(path)` needs no cfg.
    Written to a temp file in the same directory, then renamed (no partial file on failure).
    """
    from safetensors.torch import save_file

    cfg = cfg or AudioVAEConfig.tiny()
    model = random_init_(AudioVAE(cfg), seed)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(sd, tmp, metadata={CONFIG_METADATA_KEY: cfg.to_json(), "format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def unfold_weight_norm_state_dict(sd: Mapping[str, torch.Tensor], model: AudioVAE) -> dict[str, torch.Tensor]:
    """ComfyUI layout -> release layout (`weight_g`/`weight_v`), for tests and converters.

    Every Conv1d / ConvTranspose1d weight except `dec_in_proj`, `mean_proj`, `logs_proj` (which the
    release stores plain) is split as g = ||w|| over dims != 0, v = w.
    """
    plain = {"dec_in_proj", "mean_proj", "logs_proj"}
    conv_weights = {
        f"{name}.weight"
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.Conv1d, nn.ConvTranspose1d)) and name.split(".")[0] not in plain
    }
    out: dict[str, torch.Tensor] = {}
    for k, w in sd.items():
        if k in conv_weights:
            base = k[: -len(".weight")]
            out[base + _WG] = w.flatten(1).norm(dim=1).view(-1, *([1] * (w.ndim - 1))).contiguous()
            out[base + _WV] = w.clone()
        else:
            out[k] = w
    return out


__all__ = [
    "AudioVAE",
    "AudioVAEConfig",
    "detect_layout",
    "fold_weight_norm",
    "kaiser_sinc_filter",
    "inspect_audio_vae",
    "load_audio_vae",
    "load_comfy_state_dict",
    "to_comfy_layout",
    "unfold_weight_norm_state_dict",
    "write_tiny_audio_vae",
]
