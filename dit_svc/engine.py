"""The DiT stage's engine: load this rank's shard, run the sampler, unload.

Every rank runs the same code on the same job (rank 0 broadcast it); the model's
own forward does the tensor-parallel all-reduces, and `ctx.should_stop()` makes
all ranks agree on cancellation at each step boundary.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dit_svc.checkpoint import inspect_checkpoint, load_dit_weights, tp_rule
from dit_svc.config import DiTConfig
from dit_svc.layout import build_layout, latent_shape, patchify_audio, patchify_video, unpatchify_audio, unpatchify_video
from dit_svc.model import H3DiT
from dit_svc.sampling import SamplerConfig, initial_noise, sample
from dit_svc.tiny_checkpoint import write_tiny_checkpoint
from dit_svc.tp import validate_tp
from stagekit.dist import RankGroup
from stagekit.errors import FailedPrecondition, InvalidArgument
from stagekit.models import ensure_embedded, find_checkpoint
from stagekit.quant import Int8ConvRotLinear, QuantizedWeight
from stagekit.render_params import RenderSpec, validate

log = logging.getLogger("dit_svc")

# File names users have (ComfyUI) and the diffusers directory, in preference order.
CHECKPOINT_PATTERNS = ["*minimax_h3*int8_convrot*.safetensors", "*minimax_h3*.safetensors", "transformer"]
EMBEDDED_FILE = "dit_tiny_bf16.safetensors"
EMBEDDED_SEED = 0


def embedded_config() -> DiTConfig:
    """The embedded default: tiny dims, one block and two heads so an 832x480x124 render stays quick on a
    2-core CPU (attention over ~15k rows dominates). Tests use DiTConfig.tiny() for the multi-block paths."""
    return DiTConfig.tiny(num_layers=1, num_heads=2)
# Text length assumed by estimates made before the text states are known (the encoder's usual prompt budget).
DEFAULT_TEXT_LEN = 512


@dataclass
class DiTEngineConfig:
    weights: str                 # file / diffusers dir; "" = embedded tiny model
    models_dir: str
    cache_dir: Path
    device: str
    compute_dtype: torch.dtype
    int8_mode: str = "kernel"    # "kernel" (comfy-kitchen) | "dequant" (dequantise once at load)
    chunk_rows: int = 4096       # MLP token chunk: bounds the [rows, 2*ffn] activation


def resolve_weights(cfg: DiTEngineConfig) -> tuple[Path, bool]:
    """(checkpoint path, is_embedded)."""
    if cfg.weights:
        p = Path(cfg.weights).expanduser()
        if not p.exists():
            raise FailedPrecondition(f"DiT weights {p} do not exist")
        return p, False
    if cfg.models_dir:
        return find_checkpoint(cfg.models_dir, CHECKPOINT_PATTERNS, "MiniMax-H3 DiT checkpoint"), False
    path = ensure_embedded(cfg.cache_dir, EMBEDDED_FILE,
                           lambda tmp: write_tiny_checkpoint(embedded_config(), tmp, "bf16", seed=EMBEDDED_SEED))
    return path, True


class DiTEngine:
    name = "dit"

    def __init__(self, cfg: DiTEngineConfig, group: RankGroup):
        self.cfg = cfg
        self.group = group
        self.path, self.embedded = resolve_weights(cfg)
        info = inspect_checkpoint(self.path)  # header only: config + variant for validation and Status
        self.model_cfg: DiTConfig = info.config
        self.variant = info.variant.name
        self._header_shapes = info.shapes  # for weight-size estimates before loading
        validate_tp(self.model_cfg, group.world_size)
        self.model: H3DiT | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def load(self) -> None:
        if self.model is not None:
            return
        t0 = time.monotonic()
        cfg = self.cfg
        weights = load_dit_weights(self.path, self.model_cfg, self.group.info.rank, self.group.world_size,
                                   quant_mode=cfg.int8_mode, dtype=cfg.compute_dtype)
        model = H3DiT(self.model_cfg, cfg.compute_dtype, cfg.chunk_rows, tp_group=self.group.compute, device="meta")
        dense = {}
        for key, value in weights.items():
            if isinstance(value, QuantizedWeight):
                name = key[: -len(".weight")]
                bias = weights.get(name + ".bias")
                layer = Int8ConvRotLinear.from_quantized(value.to(cfg.device), None if bias is None else bias.to(cfg.device),
                                                         mode=cfg.int8_mode, compute_dtype=cfg.compute_dtype)
                model.swap_linear(name, layer)
            else:
                dense[key] = value
        swapped = {k[: -len(".weight")] for k, v in weights.items() if isinstance(v, QuantizedWeight)}
        dense = {k: v.to(cfg.device) for k, v in dense.items() if k.rsplit(".", 1)[0] not in swapped}
        missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
        missing = [k for k in missing if k.rsplit(".", 1)[0] not in swapped]
        if missing or unexpected:
            raise FailedPrecondition(f"DiT weights do not fit the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
        model.rope.to(cfg.device)
        self.model = model.eval()
        log.info("rank %d loaded %s (%s) in %.2f s", self.group.info.rank, self.path.name, self.variant,
                 time.monotonic() - t0)

    def unload(self) -> None:
        self.model = None
        gc.collect()
        if self.cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def resident_bytes(self) -> int:
        if self.model is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    # ---- memory estimates (admission + shared-residency budget) -----------------------------------------------------
    def weight_bytes(self) -> int:
        """This rank's weight bytes once loaded, from the checkpoint header (no tensor data read).

        int8 weights stay 1 byte in `kernel` mode; everything float is held in the compute dtype; tensor-parallel
        tensors are split across ranks, replicated ones are not."""
        elem = torch.empty((), dtype=self.cfg.compute_dtype).element_size()
        world = self.group.world_size
        total = 0
        for key, entry in self._header_shapes.items():
            n = 1
            for d in entry.shape:
                n *= d
            size = 1 if entry.dtype == "I8" and self.cfg.int8_mode == "kernel" else elem
            if entry.dtype in ("F32",) and key.startswith("final_layer."):
                size = 4
            total += n * size // (world if tp_rule(key) != "replicate" else 1)
        return total

    def activation_bytes(self, spec: RenderSpec, text_len: int) -> int:
        """Peak activation bytes of one job on one rank: per packed row of this resolution / frame count.

        Per row: the fp32 residual stream and its normalised / updated copies (3 x hidden x 4 B), qkv and the
        roped q/k copies (5 x heads x head_dim / tp, compute dtype), the attention output and the all-reduced
        fp32 projection, RoPE cos/sin, and the sampler's fp32 latent state (~8 copies of a patch row). Plus the
        MLP's token chunk [min(rows, chunk_rows), 3 x ffn / tp] in the compute dtype. Attention itself is a
        memory-efficient SDPA (O(rows)). The sum is padded by 25 % for allocator slack; it is an estimate to
        budget with, checked against measured peaks in docs/residency.md, not a promise.
        """
        m = self.model_cfg
        world = self.group.world_size
        e = torch.empty((), dtype=self.cfg.compute_dtype).element_size()
        shp = latent_shape(m, spec.frames, spec.height, spec.width)
        _, ph, pw = m.patch
        video_rows = shp.latent_frames * (shp.latent_height // ph) * (shp.latent_width // pw)
        audio_rows = 2 * shp.audio_latents
        rows = text_len + video_rows + audio_rows
        inner = m.num_heads * m.head_dim // world
        per_row = (3 * m.hidden * 4 + 5 * inner * e + inner * e + m.hidden * 4 + 2 * m.head_dim * 4
                   + 8 * max(m.video_patch_dim, m.audio_in_channels) * 4)
        mlp = min(rows, self.cfg.chunk_rows) * 3 * (m.ffn // world) * e
        return int((rows * per_row + mlp) * 1.25)

    def estimate_bytes(self, spec: RenderSpec | None, text_len: int = DEFAULT_TEXT_LEN) -> int:
        """Per-rank peak bytes of a job (weights + activations); `spec=None`: weights alone."""
        w = self.weight_bytes()
        return w if spec is None else w + self.activation_bytes(spec, text_len)

    def estimate_peak_bytes(self, spec: RenderSpec | None, inputs: dict) -> int:
        """The runtime's hook (stagekit.runtime.Engine)."""
        text = inputs.get("text_states")
        return self.estimate_bytes(spec, int(text.shape[0]) if text is not None else DEFAULT_TEXT_LEN)

    # ---- validation (rank 0, before any rank starts work) ---------------------------------------------------------
    def check_request(self, spec: RenderSpec, text_states: torch.Tensor) -> None:
        validate(spec)
        SamplerConfig.from_params(spec).validate()
        want = self.model_cfg.text_dim
        if text_states.ndim != 2 or text_states.shape[1] != want or text_states.shape[0] == 0:
            raise InvalidArgument(
                f"text_states must be [L, {want}] for this DiT (L >= 1), got {list(text_states.shape)}; "
                f"was it produced by a matching text encoder?")
        if text_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidArgument(f"text_states must be a float tensor, got {text_states.dtype}")

    # ---- the job --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, spec: RenderSpec, inputs: dict, ctx) -> dict:
        if self.model is None:
            raise FailedPrecondition("DiT not loaded")
        cfg, mcfg, dev = self.cfg, self.model_cfg, self.cfg.device
        text = inputs["text_states"].to(dev)
        shape = latent_shape(mcfg, spec.frames, spec.height, spec.width)
        layout = build_layout(mcfg, text.shape[0], spec.frames, spec.height, spec.width).to(dev)
        sampler_cfg = SamplerConfig.from_params(spec)
        # Noise is drawn on the CPU from the seed: identical bits on every rank and every device.
        video_shape = (mcfg.in_channels, shape.latent_frames, shape.latent_height, shape.latent_width)
        v_noise, a_noise = initial_noise(spec.seed, video_shape, (2, mcfg.audio_in_channels, shape.audio_latents))
        v_rows = patchify_video(v_noise, mcfg.patch).to(dev)
        a_rows = patchify_audio(a_noise).to(dev)
        model = self.model
        step_t = [time.monotonic()]

        def denoise(xv, xa, tv, ta):
            return model(xv, xa, text, tv, ta, layout)

        def on_step(i, n):
            now = time.monotonic()
            ctx.progress(i, n, step_ms=(now - step_t[0]) * 1000)
            step_t[0] = now

        ctx.progress(0, sampler_cfg.steps)
        v0, a0 = sample(denoise, v_rows, a_rows, sampler_cfg, on_step=on_step, should_stop=ctx.should_stop)
        video = unpatchify_video(v0, mcfg.patch, *video_shape).cpu()
        audio = unpatchify_audio(a0).cpu()
        return {"video_latents": video, "audio_latents": audio}

    def describe(self) -> dict:
        return {"weights": str(self.path), "variant": self.variant, "embedded_model": self.embedded,
                "devices": [self.cfg.device]}
