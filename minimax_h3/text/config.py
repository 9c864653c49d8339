"""Configuration of the H3 text conditioner (Qwen3-VL-32B's language model run to layer 50) and of its tiny
test-size twin (dims, and the tiny tokenizer's vocabulary, which the tiny config's embedding must cover).

Its own module so the checkpoint reader, the conditioner and the tiny-model writer all depend on it and not on each
other.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3VLTextConfig

from minimax_h3.text.vision import VisionConfig

# Special tokens of the tiny tokenizer, in id order after the 256 byte tokens (same names as the release).
TINY_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<d>",
    "</d>",
    "<|cutoff|>",
    "<|lyrics_start|>",
    "<|lyrics_end|>",
    "<|caption_start|>",
    "<|caption_end|>",
)
N_BYTES = 256
TINY_VOCAB_SIZE = N_BYTES + len(TINY_SPECIAL_TOKENS)

# The H3 conditioning layer: hidden_states[50] of the 64-layer Qwen3-VL-32B language model.
H3_CONDITIONING_LAYER = 50
DEFAULT_MAX_PROMPT_TOKENS = 2048  # generous: docs/model.md §6 sets no length limit; the server may pass its own


@dataclass(frozen=True)
class ConditionerConfig:
    hidden_size: int = 5120
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 25600
    num_layers: int = H3_CONDITIONING_LAYER  # layers run (and read); output = residual after the last one
    total_layers: int = 64  # layers in the released model (oracle / documentation only)
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    mrope_section: tuple[int, int, int] = (24, 20, 20)  # interleaved M-RoPE (t, h, w), sums to head_dim / 2
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 262144
    vision: VisionConfig = VisionConfig()  # keyframe vision tower (dims re-read from the file when it has one)

    @classmethod
    def full(cls) -> "ConditionerConfig":
        return cls()

    @classmethod
    def tiny(cls, vocab_size: int | None = None, num_layers: int = 2) -> "ConditionerConfig":
        """The tiny family: width 64; `num_layers` layers run (the embedded model: 2; a file may declare more)."""
        return cls(
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_layers=num_layers,
            total_layers=max(4, num_layers),
            vocab_size=TINY_VOCAB_SIZE if vocab_size is None else vocab_size,
            mrope_section=(4, 2, 2),  # head_dim 16 -> 8 rotary frequencies
            max_position_embeddings=4096,
            vision=VisionConfig.tiny(out_hidden_size=64),
        )

    def __post_init__(self):
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 1 <= self.num_layers <= self.total_layers:
            raise ValueError(f"num_layers {self.num_layers} must be in [1, total_layers={self.total_layers}]")

    def hf_text_config(self, num_layers: int | None = None, attn_implementation: str = "sdpa") -> Qwen3VLTextConfig:
        """The transformers config of the language model (``num_layers`` defaults to the used count)."""
        c = Qwen3VLTextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers or self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
        )
        c._attn_implementation = attn_implementation
        return c
