"""Configuration of the MiniMax-H3 DiT (release `transformer/config.json`, diffusers names in comments).

Field names follow the diffusers port where one exists; the release (sglang) name is noted next to each field.
Facts: docs/model.md §2.1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from minimax_h3.contract import AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS

# Modality tags of the per-row AdaLN table (row index = timestep_index * NUM_MODALITIES + tag).
TAG_VIDEO = 0
TAG_TEXT = 1
TAG_AUDIO = 2
NUM_MODALITIES = 3

# Six AdaLN chunks per block (shift/scale/gate for attention and MLP), two for the final layer (shift, scale).
BLOCK_ADALN_CHUNKS = 6
FINAL_ADALN_CHUNKS = 2


@dataclass(frozen=True)
class DiTConfig:
    num_heads: int = 56  # num_attention_heads
    head_dim: int = 128  # attention_head_dim
    hidden: int = 5376  # hidden_size
    num_layers: int = 50
    num_refiner_layers: int = 2  # token_refiner_num_layers
    ffn: int = 14336  # ffn_hidden_size / ffn_dim
    in_channels: int = VIDEO_LATENT_CHANNELS  # latents_dim
    audio_in_channels: int = AUDIO_LATENT_CHANNELS  # audio_latents_dim
    patch: tuple[int, int, int] = (1, 2, 2)  # (t, h, w)
    text_dim: int = 5120
    freq_dim: int = 256  # timestep_input_dim: sinusoid width
    time_embed_hidden: int = 5376  # time_embed_hidden_size
    time_embed_dim: int = 2688  # input width of every (MLP-form) AdaLN projection
    rope_freq_dim: int = 16  # rope_inv_freq_len: frequencies per axis (t, h, w)
    rope_theta: float = 1e4
    eps: float = 1e-5  # norm_eps == qk_norm_eps == final_norm_eps in the release
    # "mlp": release form, AdaLN input = silu(time_embedder(sinusoid(t))).
    # "curve": Comfy "pruned" form, AdaLN input = lerp of a [adaln_curve_grid, adaln_curve_rank] table, no silu,
    #          no time_embedder (docs/model.md §2.10 item 3).
    adaln_form: Literal["mlp", "curve"] = "mlp"
    adaln_curve_grid: int = 1025
    adaln_curve_rank: int = 8
    # FastH3 (VSA-distilled) checkpoints: every block's attention has `to_gate_compress` [attn_inner, hidden], the
    # gate of VSA's coarse branch (docs/model.md §2.11).
    vsa_gates: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def attn_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Rotated channels per head: 3 axes x rope_freq_dim angles, duplicated for rotate_half."""
        return 2 * 3 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch
        return self.in_channels * pt * ph * pw

    @property
    def adaln_in(self) -> int:
        """Input width of the AdaLN projections for the configured form."""
        return self.time_embed_dim if self.adaln_form == "mlp" else self.adaln_curve_rank

    @property
    def adaln_out(self) -> int:
        return BLOCK_ADALN_CHUNKS * NUM_MODALITIES * self.hidden

    @property
    def final_adaln_out(self) -> int:
        return FINAL_ADALN_CHUNKS * self.hidden

    # ---- constructors ---------------------------------------------------------------------------------------------
    @classmethod
    def full(cls, **overrides) -> "DiTConfig":
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> "DiTConfig":
        """Test-size model with the release ratios (3/4 of each head rotated, attn inner == hidden here)."""
        base = dict(
            num_heads=4,
            head_dim=16,
            hidden=64,
            num_layers=2,
            num_refiner_layers=1,
            ffn=128,
            text_dim=64,
            freq_dim=32,
            time_embed_hidden=64,
            time_embed_dim=32,
            rope_freq_dim=2,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "DiTConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        positive = dict(
            num_heads=self.num_heads, head_dim=self.head_dim, hidden=self.hidden, num_layers=self.num_layers,
            ffn=self.ffn, in_channels=self.in_channels, audio_in_channels=self.audio_in_channels,
            text_dim=self.text_dim, freq_dim=self.freq_dim, time_embed_hidden=self.time_embed_hidden,
            time_embed_dim=self.time_embed_dim, rope_freq_dim=self.rope_freq_dim,
        )
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DiTConfig.{name} must be a positive int, got {value!r}")
        if self.num_refiner_layers < 0:
            raise ValueError(f"DiTConfig.num_refiner_layers must be >= 0, got {self.num_refiner_layers}")
        if len(self.patch) != 3 or any(p <= 0 for p in self.patch):
            raise ValueError(f"DiTConfig.patch must be three positive ints (t, h, w), got {self.patch!r}")
        if self.rope_dim > self.head_dim:
            raise ValueError(
                f"RoPE rotates 6*rope_freq_dim = {self.rope_dim} channels per head but head_dim is only "
                f"{self.head_dim}; lower rope_freq_dim to at most {self.head_dim // 6}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DiTConfig.head_dim must be even, got {self.head_dim}")
        if self.freq_dim % 2:
            raise ValueError(f"DiTConfig.freq_dim must be even (cos/sin halves), got {self.freq_dim}")
        if self.eps <= 0:
            raise ValueError(f"DiTConfig.eps must be > 0, got {self.eps}")
        if self.adaln_form not in ("mlp", "curve"):
            raise ValueError(f"DiTConfig.adaln_form must be 'mlp' or 'curve', got {self.adaln_form!r}")
        if self.adaln_curve_grid < 2 or self.adaln_curve_rank <= 0:
            raise ValueError(
                f"curve AdaLN needs adaln_curve_grid >= 2 and adaln_curve_rank > 0, got "
                f"{self.adaln_curve_grid} / {self.adaln_curve_rank}"
            )
