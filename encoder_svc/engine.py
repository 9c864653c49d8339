"""The text-encoder stage's engine: Qwen3-VL conditioner -> layer-50 states, with a prompt cache.

The tokenizer and the checkpoint identity are read at start-up (no weights), so
a prompt is validated and a cache hit is answered without ever loading the
25 GB encoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from encoder_svc.cache import CacheKey, TextStateCache
from minimax_h3.contract import TEXT_STATES, TEXT_TAGS
from minimax_h3.files import CHECKPOINT_PARTS, EMBEDDED_VERSION, resolve_checkpoint, shown_models_dir
from minimax_h3.media import EMBEDDED_REFERENCE_SIZES, ReferenceSizes
from minimax_h3.text.checkpoint import TextEncoderCheckpoint, conditioner_config_for
from minimax_h3.text.conditioner import Conditioner, ConditionerConfig, resolve_tokenizer
from minimax_h3.text.tiny import write_tiny_model
from minimax_h3.text.tokenizer import MAX_PROMPT_TOKENS, validate_prompt
from minimax_h3.text.vision import keyframe_items, reference_parts
from stagekit.checkpoints import CheckpointError, WeightSource
from stagekit.dist import RankGroup
from stagekit.engine import StageEngine
from stagekit.errors import FailedPrecondition
from stagekit.runtime import release_device_memory
from stagekit.wire import check_result

log = logging.getLogger("encoder_svc")

CHECKPOINT_PATTERNS = CHECKPOINT_PARTS["encoder"].patterns  # where the text encoder is found (minimax_h3.files)


@dataclass
class EncoderEngineConfig:
    weights: str
    models_dir: str
    cache_dir: Path
    device: str
    dtype: torch.dtype
    mode: str = "resident"            # "resident" | "stream" (host weights, layers streamed) | "compact" (stored
                                      # int8/nvfp4 on the device, dequantised per layer)
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    cache_bytes: int = 256 << 20      # prompt -> states cache (bf16 states are 10 KB/token at full size)


def resolve_weights(cfg: EncoderEngineConfig) -> tuple[Path, bool]:
    """(checkpoint path, is_embedded); the embedded tiny model comes with its own tokenizer.json."""
    return resolve_checkpoint(cfg.weights, cfg.models_dir, "encoder",
                              lambda: write_tiny_model(Path(cfg.cache_dir) / EMBEDDED_VERSION / "text_encoder",
                                                       variant="bf16"))


@dataclass(frozen=True)
class EncodeJob:
    """An Encode: the prompt and its (validated) token ids; keyframes or references, if any, are the job's inputs."""

    text: str
    ids: tuple[int, ...]


class EncoderEngine(StageEngine[EncodeJob]):
    name = "encoder"

    def __init__(self, cfg: EncoderEngineConfig, group: RankGroup):
        self.cfg = cfg
        self.group = group
        self.path, self.embedded = resolve_weights(cfg)
        # The geometry is the file's (a deeper tiny-family encoder just loads); the header validation below
        # refuses a file whose keys do not match it, naming the file and the key.
        self.model_cfg = conditioner_config_for(self.path)
        tiny = self.model_cfg.hidden_size == ConditionerConfig.tiny().hidden_size
        # References on the model's sizes (2048 px images, 768 px clips), smaller ones for the tiny family.
        self.reference_sizes = EMBEDDED_REFERENCE_SIZES if tiny else ReferenceSizes()
        header = TextEncoderCheckpoint(self.path, self.model_cfg)  # validates keys/shapes from the header
        self.variant = header.info.variant
        self.fingerprint = header.info.fingerprint
        self.has_vision = header.info.has_visual  # keyframe (fl2va) presentations need the vision tower
        header.close()
        self.tokenizer = resolve_tokenizer(None, self.path)
        if self.tokenizer is None:
            raise FailedPrecondition(f"no tokenizer.json next to {self.path}; copy the model's tokenizer.json there")
        if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
            raise CheckpointError(self.path, f"its tokenizer has {self.tokenizer.vocab_size} ids but the embedding "
                                             f"only {self.model_cfg.vocab_size} rows: not this model's tokenizer.json")
        self.model_id = f"{self.fingerprint[:16]}:{self.tokenizer.fingerprint[:16]}:L{self.model_cfg.num_layers}"
        self.cache = TextStateCache(cfg.cache_bytes)
        self.model: Conditioner | None = None

    def load(self, source: WeightSource) -> None:
        """The text encoder, read from its checkpoint on disk (it names no files for host copies: `source` is
        empty)."""
        if self.model is None:
            self.model = Conditioner.load(self.path, self.model_cfg, tokenizer=self.tokenizer, device=self.cfg.device,
                                          dtype=self.cfg.dtype, mode=self.cfg.mode,
                                          max_prompt_tokens=self.cfg.max_prompt_tokens)

    def unload(self) -> None:
        if self.model is not None:
            self.model.close()
        self.model = None
        release_device_memory(self.cfg.device)

    def resident_bytes(self) -> int:
        if self.model is None:
            return 0
        return self.model.device_bytes()

    def check_prompt(self, prompt: str | bytes) -> tuple[str, list[int]]:
        """Raises PromptError (INVALID_ARGUMENT) naming the token count and the limit."""
        return validate_prompt(prompt, self.cfg.max_prompt_tokens, self.tokenizer)

    def cache_key(self, text: str) -> CacheKey:
        return CacheKey.make(text, self.model_id, self.cfg.dtype)

    @torch.inference_mode()
    def run(self, spec: EncodeJob, inputs: dict, ctx) -> dict:
        if self.model is None:
            raise FailedPrecondition("text encoder not loaded")
        ctx.progress(0, 1)
        images = inputs.get("keyframes") or []
        references = inputs.get("references") or []
        if images or references:  # fl2va / ref2va: labels + vision blocks, then the prompt (not cached)
            encode, prompt = self.model.tokenizer.encode, list(spec.ids)
            if references:  # ref2va: labels per kind in request order (minimax_h3/text/vision.py)
                items, tail = reference_parts(encode, references, self.model.temporal_patch)
                prompt = tail + prompt
            else:
                items = keyframe_items(encode, images)
            states, tags = self.model.encode_presentation(prompt, items)
        else:
            states, tags = self.model.encode_ids(list(spec.ids)), None
        states = states.cpu()
        check_result("encoder", TEXT_STATES, states, "token")  # never cached nor sent when not finite
        prompt_only = tags is None
        if prompt_only:
            tags = torch.ones(states.shape[0], dtype=torch.int64)
        ctx.progress(1, 1)
        return {TEXT_STATES: states, TEXT_TAGS: tags, "tokens": int(states.shape[0]), "prompt_only": prompt_only}

    def on_result(self, spec: EncodeJob, result: dict) -> None:
        """In the stage process (stagekit.engine.StageEngine): a plain prompt's states (no keyframes) join the prompt
        cache, which outlives the device worker."""
        if result["prompt_only"]:
            self.cache.put(self.cache_key(spec.text), result[TEXT_STATES])

    def describe(self) -> dict:
        return {"weights": str(self.path), "variant": f"{self.variant} ({self.cfg.mode})",
                "embedded_model": self.embedded, "devices": [self.cfg.device],
                "models_dir": shown_models_dir(self.cfg.models_dir)}
